"""Which Ray the cluster runs on, and the Ray head that `up` may own.

- `cluster.ray_address` set ("auto", "host:port"): join that Ray cluster; `down` leaves it.
- Unset, foreground `up`: `ray.init(address="local")` starts a Ray inside this process's
  lifetime; stopping `up` stops it.
- Unset, `up --detach`: `ray start --head --block` in a session of its own, so it outlives
  the CLI; `down` stops it by its recorded pid and then ends whatever is left in that
  session (nothing else on the machine is touched).

A local Ray stays on loopback (node address 127.0.0.1, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0,
no dashboard, a small object store) and uses token authentication: the token is
RAY_AUTH_TOKEN, or the file at RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token, which is made here
on first use, readable by its owner alone (`ray start` makes none, and Ray's own is
readable by all).
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from vllm_cluster.cluster.layout import Resources
from vllm_cluster.cluster.procs import ProcessRef, reap_when_done, session_members, terminate
from vllm_cluster.kv_index.redis_server import free_port

OBJECT_STORE_BYTES = 100 * 1024 * 1024
_HEAD_START_TIMEOUT_S = 300.0
_LOCAL_ENV = {
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",  # keeps Ray's node address on loopback
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0",  # our head has nothing to drain: stop at once
    # A loaded 2-core machine can take a minute to start Ray's agents; Ray's own defaults
    # would abort the head's start-up.
    "RAY_agent_register_timeout_ms": "300000",
    "RAY_raylet_start_wait_time_s": "300",
}


def local_ray_env() -> dict[str, str]:
    """This process's environment plus the settings of a Ray on this machine only: what a
    process that starts one (`ray start`) is given. Makes the auth token file if needed."""
    env = {**os.environ, **_LOCAL_ENV}
    env.setdefault("RAY_AUTH_MODE", "token")
    if env["RAY_AUTH_MODE"] == "token" and not env.get("RAY_AUTH_TOKEN"):
        make_auth_token(Path(env.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token"))
    return env


def use_local_ray() -> None:
    """Before Ray is imported or started in this process: the settings of a Ray on this
    machine only, written into this process's environment (Ray reads them there, and the
    processes it starts inherit them). Starting a head elsewhere writes nothing here."""
    os.environ.update(local_ray_env())


def make_auth_token(path: Path) -> None:
    """A token for Ray's token authentication at `path`, unless one is there (mode 0600)."""
    if path.exists():
        return
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:  # another process made it first
        return
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))


def start_in_process(num_cpus: float, namespace: str, attempts: int = 3) -> str:
    """A Ray that lives as long as this process; returns its address."""
    use_local_ray()  # before the import: Ray reads some of these once, at import
    import ray

    for attempt in range(1, attempts + 1):
        try:
            ray.init(
                address="local", _node_ip_address="127.0.0.1", include_dashboard=False, num_cpus=int(num_cpus),
                object_store_memory=OBJECT_STORE_BYTES, namespace=namespace, log_to_driver=False,
                logging_level=logging.WARNING,
            )
            break
        except Exception as e:  # Ray raises a bare Exception when its raylet gives up (see start_head)
            ray.shutdown()
            if attempt == attempts:
                raise RuntimeError(f"could not start a local Ray: {e}") from e
    return str(ray.get_runtime_context().gcs_address)


def start_head(log_file: Path, num_cpus: float, attempts: int = 3) -> tuple[str, ProcessRef]:
    """`ray start --head --block` in a new session; returns (address, its process) once the
    head answers. Tried again when it fails: on a loaded machine Ray's raylet gives up on its
    agents after a fixed 15 s."""
    for attempt in range(1, attempts + 1):
        try:
            return _start_head_once(log_file, num_cpus)
        except RuntimeError:
            if attempt == attempts:
                raise
    raise AssertionError("unreachable")


def _start_head_once(log_file: Path, num_cpus: float) -> tuple[str, ProcessRef]:
    port = free_port()
    ray_bin = Path(sys.executable).with_name("ray")
    cmd = [
        str(ray_bin) if ray_bin.exists() else "ray", "start", "--head", "--block",
        "--node-ip-address", "127.0.0.1", "--port", str(port), "--num-cpus", str(int(num_cpus)),
        "--include-dashboard", "false", "--include-log-monitor", "false",
        "--object-store-memory", str(OBJECT_STORE_BYTES), "--disable-usage-stats",
        # Ray's fixed default ports (10001, 52365, ...) would collide with another Ray here.
        "--ray-client-server-port", str(free_port()), "--dashboard-port", str(free_port()),
        "--dashboard-agent-listen-port", str(free_port()), "--dashboard-agent-grpc-port", str(free_port()),
        "--metrics-export-port", str(free_port()), "--runtime-env-agent-port", str(free_port()),
    ]
    log_file.parent.mkdir(parents=True, exist_ok=True)
    with open(log_file, "wb") as log:
        popen = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                 env=local_ray_env(), start_new_session=True)
    reap_when_done(popen)  # however it ends (stop_head, a crash), it leaves no zombie here
    head = ProcessRef.of(popen.pid)
    deadline = time.monotonic() + _HEAD_START_TIMEOUT_S
    while b"block forever" not in (text := log_file.read_bytes()):
        failed = popen.poll() is not None or b"Traceback (most recent call last)" in text
        if failed or time.monotonic() > deadline:
            stop_head(head, f"127.0.0.1:{port}")
            raise RuntimeError(f"the Ray head did not start; see {log_file}:\n{log_file.read_text()[-2000:]}")
        time.sleep(0.2)
    return f"127.0.0.1:{port}", head


def connect(address: str, namespace: str, local: bool) -> None:
    if local:
        use_local_ray()
    import ray

    ray.init(address=address, namespace=namespace, log_to_driver=False, logging_level=logging.WARNING)


def stop_head(head: ProcessRef, address: str = "", grace_s: float = 15.0) -> list[ProcessRef]:
    """Stop a head `start_head` made, then everything left in its session; returns what
    could not be stopped (should be nothing)."""
    survivors = terminate([head], grace_s) + terminate(session_members(head.pid), 5.0)
    if not survivors:  # Ray leaves each session's logs and sockets in its temp dir
        ray_dir = Path(tempfile.gettempdir()) / "ray"
        for session in ray_dir.glob(f"session_*_{head.pid}"):
            shutil.rmtree(session, ignore_errors=True)
        current = ray_dir / "ray_current_cluster"  # what `ray.init(address="auto")` would join
        if address and current.exists() and current.read_text().strip() == address:
            current.unlink(missing_ok=True)
    return survivors


def local_resources(device: str) -> Resources:
    """This machine, before Ray starts: its CPUs and (unless the engine is on CPU) GPUs."""
    num_gpus = 0
    if device != "cpu":
        import torch

        num_gpus = torch.cuda.device_count()
    return Resources(float(os.cpu_count() or 1), (num_gpus,))


def ray_resources() -> Resources:
    """The connected Ray cluster's live nodes."""
    import ray

    nodes = [n for n in ray.nodes() if n.get("Alive")]
    num_cpus = sum(float(n["Resources"].get("CPU", 0)) for n in nodes)
    custom: dict[str, float] = {}
    for node in nodes:
        for name, amount in node["Resources"].items():
            if name not in ("CPU", "GPU", "memory", "object_store_memory") and not name.startswith("node:"):
                custom[name] = max(custom.get(name, 0.0), float(amount))
    return Resources(num_cpus, tuple(int(n["Resources"].get("GPU", 0)) for n in nodes), custom)

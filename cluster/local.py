"""A whole cluster on this machine as plain processes: N prefill, M decode, one router.

    with LocalCluster.from_yaml("configs/local.yaml") as cluster:
        client = Client(cluster.router_address)

Each process gets its ready file (JSON with its port) and a log file under `log_dir`; the
cluster is up once every ready file exists. A random cluster token is made for the run
and handed to every process in its environment. `stop()` sends SIGTERM, then SIGKILL to
whatever is still alive after the grace period. (RayCluster, cluster/ray_cluster.py, has
the same surface and places the same processes with Ray: `vllm-cluster up`.)
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from vllm_cluster.cluster.config import ClusterConfig
from vllm_cluster.cluster.procs import reap_when_done
from vllm_cluster.engine.config import EngineConfig
from vllm_cluster.engine.resolve import CUDA_DEFAULTS, resolve_device
from vllm_cluster.kv_index.redis_server import EmbeddedRedis, start_embedded_redis
from vllm_cluster.worker.rpc import API_KEY_ENV, REDIS_URL_ENV, TOKEN_ENV


@dataclass
class _Process:
    name: str
    popen: subprocess.Popen[bytes]
    ready_file: Path
    log_file: Path
    info: dict[str, Any] = field(default_factory=dict)
    cmd: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)


class LocalCluster:
    def __init__(
        self,
        config_path: str | Path,
        config: ClusterConfig,
        log_dir: str | Path | None = None,
        router_port: int = 0,
        http_port: int = 0,
        api_key: str = "",
    ) -> None:
        self.config_path = Path(config_path)
        self.config = config
        self.log_dir = Path(log_dir or tempfile.mkdtemp(prefix="vllm-cluster-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.token = secrets.token_hex(16)
        self.router_port = router_port
        self.http_port = http_port
        self.api_key = api_key  # the client API key the router demands ("": none)
        self.processes: list[_Process] = []
        self.prefill_addresses: list[str] = []
        self.decode_addresses: list[str] = []
        self.router_address = ""  # gRPC client API
        self.http_address = ""  # OpenAI-compatible HTTP API: "http://host:port"
        self.redis: EmbeddedRedis | None = None
        self.redis_url = config.redis_url
        self._wants_prefix_index = False

    @classmethod
    def from_yaml(cls, path: str | Path, **overrides: Any) -> LocalCluster:
        data = yaml.safe_load(Path(path).read_text()) or {}
        section = {**(data.get("cluster") or {}), **overrides}
        cluster = cls(path, ClusterConfig.from_dict(section))
        router = data.get("router") or {}
        cluster._wants_prefix_index = (
            router.get("policy") == "prefix_aware" or bool(router.get("kv_pull")) or bool(router.get("redis_url"))
        )
        if router.get("redis_url") and not cluster.redis_url:
            cluster.redis_url = str(router["redis_url"])
        return cluster

    def start(self) -> LocalCluster:
        try:
            if self._wants_prefix_index and not self.redis_url:
                self.redis = start_embedded_redis(self.log_dir / "redis")
                self.redis_url = self.redis.url
            workers = [self._spawn(f"prefill-{i}", "prefill_service") for i in range(self.config.num_prefill)]
            share = self._decode_share(workers)
            workers += [self._spawn(f"decode-{i}", "decode_service", share) for i in range(self.config.num_decode)]
            for process in workers:
                self._wait_ready(process)
            self.prefill_addresses = [
                f"{self.config.host}:{p.info['port']}" for p in workers if p.name.startswith("prefill")
            ]
            self.decode_addresses = [
                f"{self.config.host}:{p.info['port']}" for p in workers if p.name.startswith("decode")
            ]
            args = ["--port", str(self.router_port), "--http-port", str(self.http_port)]
            for address in self.prefill_addresses:
                args += ["--prefill", address]
            for address in self.decode_addresses:
                args += ["--decode", address]
            router = self._spawn("router", "router", args)
            self._wait_ready(router)
            self.router_address = f"{self.config.host}:{router.info['port']}"
            self.http_address = f"http://{self.config.host}:{router.info['http_port']}"
        except BaseException:
            self.stop()
            raise
        return self

    def _decode_share(self, prefills: list[_Process]) -> list[str]:
        """On a shared GPU, the decode instances start once the prefill instances are up and
        split what those left of the default utilization (each prefill keeps only the KV it
        needs: worker/main.py share_gpu); elsewhere everything starts at once."""
        if not prefills or not self.config.num_decode or not self._engine_on_cuda():
            return []
        for process in prefills:
            self._wait_ready(process)
        total = prefills[0].info["gpu_total_bytes"]
        held = sum(p.info["gpu_bytes"] for p in prefills)
        assert CUDA_DEFAULTS.gpu_memory_utilization is not None
        share = (CUDA_DEFAULTS.gpu_memory_utilization - held / total) / self.config.num_decode
        if share <= 0.05:
            raise RuntimeError(
                f"the prefill instances hold {held / (1 << 30):.1f} GiB of the GPU's {total / (1 << 30):.1f} GiB, "
                "leaving the decode instances nothing: set cache.gpu_memory_utilization (each instance's share) "
                "or run fewer instances per GPU"
            )
        return ["--gpu-memory-utilization", f"{share:.4f}"]

    def _engine_on_cuda(self) -> bool:
        engine = EngineConfig.from_yaml(self.config_path)
        return not engine.cache.size_given and resolve_device(engine.device).type == "cuda"

    @property
    def metrics_addresses(self) -> dict[str, str]:
        """Process name -> "http://host:port" serving its Prometheus /metrics (the router's is
        its HTTP front)."""
        addresses = {}
        for p in self.processes:
            port = p.info.get("metrics_port", p.info.get("http_port"))
            if port:
                addresses[p.name] = f"http://{self.config.host}:{port}"
        return addresses

    def process(self, name: str) -> _Process:
        return next(p for p in self.processes if p.name == name)

    def kill(self, name: str) -> None:
        """SIGKILL one process (fault-injection tests)."""
        process = self.process(name)
        process.popen.kill()
        process.popen.wait(timeout=30)

    def stop(self, grace_s: float = 10.0) -> None:
        for process in self.processes:
            if process.popen.poll() is None:
                process.popen.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for process in self.processes:
            try:
                process.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.popen.kill()
                process.popen.wait(timeout=10)
        if self.redis is not None:
            self.redis.stop()
            self.redis = None

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _spawn(self, name: str, module: str, extra: list[str] | None = None) -> _Process:
        ready = self.log_dir / f"{name}.ready.json"
        ready.unlink(missing_ok=True)
        log = self.log_dir / f"{name}.log"
        cmd = [
            sys.executable, "-m", f"vllm_cluster.{module}",
            "--config", str(self.config_path), "--ready-file", str(ready),
        ]
        if module != "router":
            cmd += ["--name", name, "--host", self.config.host, "--kv-host", self.config.host,
                    "--transport", self.config.transport]
            if self.config.num_threads is not None:
                cmd += ["--num-threads", str(self.config.num_threads)]
            # Every instance of a local cluster runs on this machine's GPU(s).
            cmd += ["--instances-per-gpu", str(self.config.num_prefill + self.config.num_decode)]
            if self.config.kv_faults and module == "prefill_service":
                cmd += ["--kv-faults", self.config.kv_faults]
        cmd += extra or []
        env = {**os.environ, TOKEN_ENV: self.token}
        env.pop(REDIS_URL_ENV, None)
        if self.redis_url:  # in the environment, with the token: it may carry a password
            env[REDIS_URL_ENV] = self.redis_url
        if module == "router":
            env[API_KEY_ENV] = self.api_key
        with open(log, "wb") as out:
            popen = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=Path.cwd())
        reap_when_done(popen)  # a process that dies on its own is no zombie until stop()
        process = _Process(name, popen, ready, log, cmd=cmd, env=env)
        self.processes.append(process)
        return process

    def restart(self, name: str) -> None:
        """Start a process again with its old command line (after `kill`, or a crash): the
        router gets its old ports back, so clients reconnect to the same address."""
        process = self.process(name)
        if process.popen.poll() is None:
            raise RuntimeError(f"{name} is still running: kill it first")
        cmd = list(process.cmd)
        if name == "router":  # the same ports, so clients' addresses stay valid
            cmd[cmd.index("--port") + 1] = str(process.info["port"])
            cmd[cmd.index("--http-port") + 1] = str(process.info["http_port"])
        process.ready_file.unlink(missing_ok=True)
        with open(process.log_file, "ab") as out:
            process.popen = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=process.env, cwd=Path.cwd())
        reap_when_done(process.popen)
        self._wait_ready(process)

    def _wait_ready(self, process: _Process) -> None:
        deadline = time.monotonic() + self.config.startup_timeout_s
        while not process.ready_file.exists():
            if process.popen.poll() is not None:
                tail = process.log_file.read_text(errors="replace")[-3000:]
                raise RuntimeError(f"{process.name} exited with {process.popen.returncode} while starting:\n{tail}")
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{process.name} not ready after {self.config.startup_timeout_s}s; see {process.log_file}"
                )
            time.sleep(0.1)
        process.info = json.loads(process.ready_file.read_text())

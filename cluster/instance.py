"""`vllm-cluster worker ROLE -f FILE --index I`: one instance of a pool, outside Ray (a
container, a systemd unit). It resolves the pool's settings from the cluster YAML exactly
as `up` does (the pool's tensor/pipeline split in engine.parallel, its ports + I, the
overrides), writes the resolved YAML, and replaces itself with the worker process
(`python -m prefill_service ...`), which then owns the signals and the exit code.
"""

from __future__ import annotations

import argparse
import os
import shlex
import socket
import sys
import tempfile
from pathlib import Path

from vllm_cluster.cluster.argv import redis_env, worker_argv
from vllm_cluster.cluster.config_file import load_deployment
from vllm_cluster.cluster.layout import plan_instances
from vllm_cluster.engine.errors import ConfigError


def worker_main(args: argparse.Namespace) -> int:
    try:
        argv, env = worker_command(args)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.dry_run:
        print(shlex.join([f"{k}={v}" for k, v in env.items()] + argv))
        return 0
    sys.stdout.flush()
    os.environ.update(env)
    os.execv(argv[0], argv)
    raise AssertionError("execv returned")


def worker_command(args: argparse.Namespace) -> tuple[list[str], dict[str, str]]:
    """The worker's command line, and what its environment adds (the Redis URL)."""
    deployment = load_deployment(args.config, args.overrides)
    plans = [p for p in plan_instances(deployment, use_gpus=False) if p.role == args.role]
    if not 0 <= args.index < len(plans):
        raise ConfigError(f"--index {args.index}: cluster.num_{args.role} is {len(plans)}, so give 0..{len(plans) - 1}")
    plan = plans[args.index]
    resolved = args.resolved_config or Path(tempfile.mkdtemp(prefix="vllm-cluster-")) / f"{plan.name}.yaml"
    resolved.write_text(deployment.process_yaml(args.role))
    argv = worker_argv(deployment, plan, args.kv_host)
    at = argv.index("--ready-file")
    del argv[at:at + 2]  # nobody waits for a ready file here: the health service says when it is up
    node_ip = socket.gethostbyname(socket.gethostname())
    argv = [a.format(python=sys.executable, config=resolved, node_ip=node_ip) for a in argv]
    return argv, redis_env(deployment, deployment.redis_url)

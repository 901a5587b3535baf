"""The command lines of `vllm-cluster up | down | status | logs | worker`: argparse only, so
that building the parser (and `vllm-cluster health`, run by container healthchecks every
few seconds) imports nothing heavy; each command's module is imported when it runs.
"""

from __future__ import annotations

import argparse
from pathlib import Path

SAMPLE_CHAT = "What is the capital of France? Answer in one sentence."
# Specific flags and the keys they set (applied after --set, so they win).
FLAG_KEYS = {
    "name": "cluster.name", "port": "router.port", "http_port": "router.http_port",
    "num_prefill": "cluster.num_prefill", "num_decode": "cluster.num_decode", "ray_address": "cluster.ray_address",
}


def add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", "-f", default="configs/local.yaml", help="the cluster YAML (default %(default)s)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override one key of the file, e.g. --set router.port=9000 (repeatable)")
    p.add_argument("--state-dir", type=Path, default=None, help="where state files live (default ~/.vllm-cluster)")


def add_up_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("up", help="start a cluster on Ray from a YAML (router, prefill and decode pools)")
    add_config_args(p)
    p.add_argument("--detach", "-d", action="store_true", help="return once it is up; stop it with `down`")
    p.add_argument("--name", default=None, help="overrides cluster.name (its state file and Ray namespace)")
    p.add_argument("--port", type=int, default=None, help="overrides router.port (gRPC)")
    p.add_argument("--http-port", type=int, default=None, help="overrides router.http_port")
    p.add_argument("--num-prefill", type=int, default=None, help="overrides cluster.num_prefill")
    p.add_argument("--num-decode", type=int, default=None, help="overrides cluster.num_decode")
    p.add_argument("--ray-address", default=None, help="overrides cluster.ray_address")
    p.add_argument("--log-dir", type=Path, default=None, help="default <state-dir>/<name>/logs")
    p.add_argument("--chat", metavar="MESSAGE", nargs="?", const=SAMPLE_CHAT, default=None,
                   help="once up, send one chat message through the router and print the answer")
    p.add_argument("--max-tokens", type=int, default=64, help="for --chat")
    p.add_argument("--dry-run", action="store_true", help="validate and print the plan; start nothing")


def add_state_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--name", default=None, help="the cluster's name (cluster.name; default: -f's, else 'local')")
    p.add_argument("--config", "-f", default=None, help="find the cluster by this file's cluster.name")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="as given to `up` (only cluster.name matters here)")
    p.add_argument("--state-dir", type=Path, default=None, help="where state files live (default ~/.vllm-cluster)")


def add_status_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("status", help="every instance of a cluster: health, load, KV cache usage")
    add_state_args(p)
    p.add_argument("--json", action="store_true", help="one JSON object per line instead of a table")
    p = sub.add_parser("logs", help="an instance's log (prefill-0, decode-1, router, redis, ...)")
    p.add_argument("instance")
    add_state_args(p)
    p.add_argument("--tail", type=int, default=None, metavar="N", help="only the last N lines")


def add_repair_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("repair", help="place again the instances a cluster lost with a Ray node, once it is back")
    add_state_args(p)


def add_scale_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("scale", help="grow or shrink a running cluster's prefill and decode pools")
    add_state_args(p)
    p.add_argument("--prefill", type=int, default=None, metavar="N", help="prefill instances wanted (default: as now)")
    p.add_argument("--decode", type=int, default=None, metavar="M", help="decode instances wanted (default: as now)")


def add_autoscale_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("autoscale", help="run the autoscaler (the autoscaler: section) beside a cluster of "
                       "`up --detach`, until Ctrl-C")
    add_state_args(p)


def add_chaos_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("chaos", help="kill a running cluster's processes under load and check it heals (a soak)")
    add_state_args(p)
    p.add_argument("--num-faults", type=int, default=12, help="faults to inject (each kind at least once)")
    p.add_argument("--fault-interval-s", type=float, default=5.0, help="seconds between faults")
    p.add_argument("--concurrency", type=int, default=6, help="client threads of the steady load")
    p.add_argument("--seed", type=int, default=0, help="the fault schedule's seed")
    p.add_argument("--prompt", dest="prompts", action="append", default=[],
                   help="a prompt of the load (repeatable; default: six built-in sentences)")


def add_down_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("down", help="stop a cluster `up` started (by -f FILE or --name)")
    add_state_args(p)
    p.add_argument("--grace-s", type=float, default=10.0, help="how long servers get to finish after SIGTERM")


def add_worker_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("worker", help="run one prefill or decode instance of a cluster YAML, without Ray")
    p.add_argument("role", choices=["prefill", "decode"])
    p.add_argument("--config", "-f", required=True, help="the cluster YAML")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override one key of the file (repeatable)")
    p.add_argument("--index", type=int, default=0, help="which instance of the pool: its ports are the pool's + index")
    p.add_argument("--kv-host", default="", help="the address others reach its KV listener at "
                   "(default: cluster.host, or this host's address when that is 0.0.0.0)")
    p.add_argument("--resolved-config", type=Path, default=None,
                   help="where to write the pool's resolved YAML (default: a temporary file)")
    p.add_argument("--dry-run", action="store_true", help="print the worker's command line instead of running it")

"""Which instances a change of pool sizes adds and removes: pure, from the names the
cluster has and the sizes wanted.

A new instance takes the lowest free index of its pool (`decode-1` after `decode-0`), and
with it the pool's ports + index, as `up` would have placed it (cluster/layout.py). A
shrinking pool loses its highest indices first: the newest instances, and never the ones
`up` placed while newer ones remain.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from vllm_cluster.cluster.config import ROLES, Deployment
from vllm_cluster.cluster.layout import InstancePlan, plan_instances
from vllm_cluster.engine.config import EngineRole
from vllm_cluster.engine.errors import ConfigError


@dataclass(frozen=True, slots=True)
class PoolSizes:
    num_prefill: int
    num_decode: int

    def of(self, role: str) -> int:
        return self.num_prefill if role == EngineRole.PREFILL else self.num_decode

    def check(self) -> None:
        if self.num_decode < 1:
            raise ConfigError(f"--decode {self.num_decode}: a cluster needs at least 1 decode instance")
        if self.num_prefill < 0:
            raise ConfigError(f"--prefill {self.num_prefill}: give 0 or more (0: decode computes every prompt)")


@dataclass(frozen=True, slots=True)
class PoolChange:
    add: tuple[InstancePlan, ...]  # lowest free index first
    remove: tuple[str, ...]  # instance names, highest index first

    @property
    def empty(self) -> bool:
        return not self.add and not self.remove


def index_of(name: str) -> int:
    """`decode-3` -> 3."""
    return int(name.rsplit("-", 1)[1])


def plan_change(deployment: Deployment, names: list[str], wanted: PoolSizes, use_gpus: bool) -> PoolChange:
    """`names`: the prefill and decode instances the cluster has now (`prefill-0`, ...)."""
    wanted.check()
    add: list[InstancePlan] = []
    remove: list[str] = []
    for role in ROLES:
        held = sorted((n for n in names if n.rsplit("-", 1)[0] == role), key=index_of)
        surplus = len(held) - wanted.of(role)
        if surplus > 0:
            remove += reversed(held[-surplus:])
        elif surplus < 0:
            taken = {index_of(n) for n in held}
            new = [i for i in range(len(held) - surplus) if i not in taken][:-surplus]
            add += [p for p in _plans(deployment, role, max(new) + 1, use_gpus) if index_of(p.name) in new]
    return PoolChange(tuple(add), tuple(remove))


def _plans(deployment: Deployment, role: str, count: int, use_gpus: bool) -> list[InstancePlan]:
    """The plans of `count` instances of `role`, as `up` would make them."""
    cluster = dataclasses.replace(deployment.cluster, num_prefill=count, num_decode=count)
    return [p for p in plan_instances(dataclasses.replace(deployment, cluster=cluster), use_gpus) if p.role == role]

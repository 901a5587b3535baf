"""Which rank does what: the tensor x pipeline grid, each stage's layers, each rank's
attention heads, and the checks a model must pass before any process starts.

Rank 0 is the driver: it runs the scheduler and the sampler, so it holds tensor rank 0
of the *last* pipeline stage, where the logits come out. Ranks 0..tp-1 form the last
stage; ranks tp..2tp-1 the first, and so on around:

    stage(rank) = (rank // tp + pp - 1) % pp        rank(stage, t) = ((stage + 1) % pp) * tp + t

With pp = 1 this is the usual layout (stage 0 = ranks 0..tp-1).
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm_cluster.engine.errors import ConfigError
from vllm_cluster.engine.models import ModelArchConfig


@dataclass(frozen=True, slots=True)
class Placement:
    """One rank's share: its pipeline stage and layers, its tensor rank."""

    rank: int
    stage: int
    tp_rank: int
    layers: range
    is_first_stage: bool
    is_last_stage: bool


@dataclass(frozen=True, slots=True)
class Topology:
    tensor_parallel_size: int
    pipeline_parallel_size: int
    num_layers: int
    # MoE layers: each stage's tp ranks hold num_experts / tp experts (engine/parallel/expert.py).
    enable_expert_parallel: bool = False

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def stage_of(self, rank: int) -> int:
        tp, pp = self.tensor_parallel_size, self.pipeline_parallel_size
        return (rank // tp + pp - 1) % pp

    def rank_of(self, stage: int, tp_rank: int) -> int:
        assert 0 <= stage < self.pipeline_parallel_size and 0 <= tp_rank < self.tensor_parallel_size
        return ((stage + 1) % self.pipeline_parallel_size) * self.tensor_parallel_size + tp_rank

    def stage_ranks(self, stage: int) -> list[int]:
        """The global ranks of one stage, by tensor rank."""
        return [self.rank_of(stage, t) for t in range(self.tensor_parallel_size)]

    def stage_layers(self, stage: int) -> range:
        """Contiguous layers; the first num_layers % pp stages take one more (the last stage,
        on the driver, also schedules and samples)."""
        pp = self.pipeline_parallel_size
        base, extra = divmod(self.num_layers, pp)
        start = stage * base + min(stage, extra)
        return range(start, start + base + (1 if stage < extra else 0))

    def place(self, rank: int) -> Placement:
        assert 0 <= rank < self.world_size, f"rank {rank} outside 0..{self.world_size - 1}"
        stage = self.stage_of(rank)
        return Placement(
            rank=rank,
            stage=stage,
            tp_rank=rank % self.tensor_parallel_size,
            layers=self.stage_layers(stage),
            is_first_stage=stage == 0,
            is_last_stage=stage == self.pipeline_parallel_size - 1,
        )


def kv_heads_of(tp_rank: int, tp_size: int, num_kv_heads: int) -> range:
    """The KV heads one tensor rank holds: a 1/tp share, or, when tp exceeds them, the one
    head its query heads attend with (replicated on tp / num_kv_heads ranks)."""
    if tp_size <= num_kv_heads:
        per_rank = num_kv_heads // tp_size
        return range(tp_rank * per_rank, (tp_rank + 1) * per_rank)
    head = tp_rank // (tp_size // num_kv_heads)
    return range(head, head + 1)


def vocab_shard_size(vocab_size: int, tp_size: int) -> int:
    """Rows of the embedding / lm_head per rank; the last rank's tail is zero padding."""
    return -(-vocab_size // tp_size)


def check_model(arch: ModelArchConfig, tp: int, pp: int, enable_expert_parallel: bool = False) -> None:
    """Raise a ConfigError saying what to change when the model cannot split this way."""
    if enable_expert_parallel:
        check_expert_parallel(arch, tp)
    problem = _tp_problem(arch, tp)
    if problem is not None:
        valid = [n for n in range(1, arch.num_attention_heads + 1) if _tp_problem(arch, n) is None]
        raise ConfigError(f"tensor_parallel_size {tp}: {problem}; for this model use one of {valid}")
    if pp > arch.num_hidden_layers:
        raise ConfigError(
            f"pipeline_parallel_size {pp} exceeds the model's {arch.num_hidden_layers} layers: "
            f"use at most {arch.num_hidden_layers} stages"
        )


def check_expert_parallel(arch: ModelArchConfig, tp: int) -> None:
    """Expert parallelism spreads a MoE model's experts over the tp ranks, evenly."""
    if not arch.num_experts:
        raise ConfigError(
            f"enable_expert_parallel needs a MoE model (e.g. Mixtral); {arch.architecture} has no experts: "
            "set enable_expert_parallel to false"
        )
    if arch.num_experts % tp:
        valid = [n for n in range(1, arch.num_experts + 1) if arch.num_experts % n == 0]
        raise ConfigError(
            f"enable_expert_parallel spreads the model's {arch.num_experts} experts over tensor_parallel_size "
            f"{tp} ranks, which must divide them: use tensor_parallel_size in {valid}, or turn expert "
            "parallelism off"
        )


def _tp_problem(arch: ModelArchConfig, tp: int) -> str | None:
    heads, kv_heads = arch.num_attention_heads, arch.num_key_value_heads
    if heads % tp:
        return f"it must divide num_attention_heads ({heads})"
    if kv_heads % tp and tp % kv_heads:
        return (
            f"KV heads are split across ranks or replicated, so it must divide num_key_value_heads "
            f"({kv_heads}) or be a multiple of it"
        )
    if arch.intermediate_size % tp:
        return f"it must divide intermediate_size ({arch.intermediate_size})"
    if arch.shared_expert_intermediate_size % tp:
        return f"it must divide shared_expert_intermediate_size ({arch.shared_expert_intermediate_size})"
    if arch.mla is not None and arch.attention_bias and tp > 1:
        return f"{arch.architecture} with attention_bias has a bias on o_proj, which runs on one rank only"
    if arch.post_norms and tp > 1:
        return f"{arch.architecture} normalises q and k over all heads at once, which runs on one rank only"
    return None

"""An engine's counters at one moment: what the loop publishes, the router scores and
/metrics exports."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm_cluster.engine.kv_offload import TierStats
from vllm_cluster.engine.lora import LoRAManager
from vllm_cluster.engine.scheduler import Scheduler


@dataclass(frozen=True, slots=True)
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_free_blocks: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    num_transferring: int = 0
    num_total_blocks: int = 0
    # Since start: prompts computed here, tokens sampled here, finished requests by reason.
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_finished: dict[str, int] = field(default_factory=dict)
    # LoRA adapters loaded here, and those resident in a slot now (the router routes by them).
    lora_names: tuple[str, ...] = ()
    lora_resident_names: tuple[str, ...] = ()
    # KV offload (engine/kv_offload.py): prompt tokens loaded from each tier for admitted
    # requests (not in prefix_cache_hits), and each tier's counters by name ("host", "disk").
    prefix_cache_host_hits: int = 0
    prefix_cache_disk_hits: int = 0
    kv_tiers: dict[str, TierStats] = field(default_factory=dict)


def engine_stats(scheduler: Scheduler, lora: LoRAManager | None) -> EngineStats:
    kv = scheduler.kv
    return EngineStats(
        num_running=len(scheduler.running),
        num_waiting=len(scheduler.waiting),
        kv_cache_usage=kv.usage,
        num_free_blocks=kv.pool.num_free_blocks,
        prefix_cache_queries=kv.prefix_stats.num_queries,
        prefix_cache_hits=kv.prefix_stats.num_hits,
        num_preemptions=scheduler.num_preemptions,
        num_transferring=len(scheduler.transferring),
        num_total_blocks=kv.pool.num_blocks,
        num_prompt_tokens=scheduler.num_prompt_tokens,
        num_generation_tokens=scheduler.num_generation_tokens,
        num_finished=dict(scheduler.num_finished),
        lora_names=() if lora is None else tuple(sorted(lora.adapters)),
        lora_resident_names=() if lora is None else tuple(lora.resident_names),
        prefix_cache_host_hits=kv.prefix_stats.num_host_hits,
        prefix_cache_disk_hits=kv.prefix_stats.num_disk_hits,
        kv_tiers={} if kv.offload is None else kv.offload.snapshot(),
    )

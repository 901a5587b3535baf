"""How much memory an engine's KV cache may take.

Three ways to say it (CacheConfig): a number of blocks; `gpu_memory_utilization`, vLLM's
meaning: the fraction of the GPU's total memory this instance may hold, weights,
activations and KV cache together, so two instances sharing a GPU can each take 0.45; or
`memory_fraction`, of the memory still free once the weights are loaded (the CPU default).

Under `gpu_memory_utilization` the KV cache gets the instance's share less what this
process already holds (torch's reserved memory plus an allowance for the CUDA context and
library workspaces, which torch does not see) and less a bound on one step's activations.
The bound is computed from the model's shapes and the step's token budget rather than
profiled by a forward pass: it overestimates a little, which costs a few blocks, never an
out-of-memory error in the middle of serving.
"""

from __future__ import annotations

import os

import torch

from vllm_cluster.engine.config import CacheConfig, SchedulerConfig
from vllm_cluster.engine.errors import ConfigError
from vllm_cluster.engine.models import ModelArchConfig

GiB = 1 << 30
# The CUDA context, cuBLAS and Triton workspaces, NCCL buffers: outside torch's allocator.
CUDA_CONTEXT_BYTES = 1 * GiB
# CUDA graphs' private pool and the caching allocator's fragmentation.
GRAPH_AND_SLACK_BYTES = 512 << 20


def available_memory_bytes(device: torch.device) -> int:
    """Free memory now: the GPU's (all processes counted), or the host's MemAvailable."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return (os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")) // 2


def activation_bytes(arch: ModelArchConfig, sched: SchedulerConfig, element_size: int) -> int:
    """A bound on one step's activations: a layer's widest per-token tensors (residual and
    norm, QKV, the MLP's gate_up and its product) for the step's token budget, the logits of
    its sequences in fp32 with the sampler's copies, and room for CUDA graphs."""
    max_num_seqs, max_num_batched_tokens = sched.batch_limits()
    tokens = max(max_num_batched_tokens, max_num_seqs)
    q_width = arch.num_attention_heads * arch.head_dim
    kv_width = arch.num_key_value_heads * arch.head_dim
    if arch.mla is not None:  # q, the absorbed query [H, R + P] and the latent outputs [H, R], [H, V]
        m = arch.mla
        q_width = arch.num_attention_heads * (m.qk_nope_head_dim + 2 * m.cache_entry_size + m.v_head_dim)
        kv_width = m.cache_entry_size
    moe_width = arch.moe_intermediate_size * arch.num_experts_per_tok + arch.shared_expert_intermediate_size
    mlp_width = 3 * max(arch.intermediate_size, moe_width)
    per_token = (4 * arch.hidden_size + q_width + 2 * kv_width + mlp_width) * element_size
    logits = max_num_seqs * arch.vocab_size * 4 * 3
    return tokens * per_token + logits + GRAPH_AND_SLACK_BYTES


def prefill_kv_tokens(max_model_len: int, sched: SchedulerConfig) -> int:
    """The KV a prefill instance keeps when it shares its GPU with decode instances: one
    longest prompt, and two steps' prompts on their way to a decode instance. It hands every
    prompt's blocks over as soon as they are computed; the decode side needs the room."""
    return max_model_len + 2 * sched.batch_limits()[1]


def footprint_bytes(device: torch.device, activations: int) -> int:
    """What this process holds (or will, at its largest step) of a GPU, for a launcher that
    sizes the next instance on the same GPU: torch's reserved memory, the CUDA context
    allowance, and the activation bound where the steps so far did not reserve it yet."""
    return torch.cuda.memory_reserved(device) + CUDA_CONTEXT_BYTES + activations


def kv_cache_bytes(cache: CacheConfig, device: torch.device, activations: int, cap: int | None = None) -> int:
    """The bytes this engine's KV cache may take (`cache.num_blocks` unset, defaults resolved),
    at most `cap` (cache.max_total_tokens in bytes)."""
    if cache.gpu_memory_utilization is None:
        assert cache.memory_fraction is not None, "defaults not resolved"
        size = int(available_memory_bytes(device) * cache.memory_fraction)
        return size if cap is None else min(size, cap)
    utilization = cache.gpu_memory_utilization
    free, total = (int(x) for x in torch.cuda.mem_get_info(device))
    held = torch.cuda.memory_reserved(device) + CUDA_CONTEXT_BYTES
    budget = int(total * utilization) - held - activations
    if budget <= 0:
        raise ConfigError(
            f"cache.gpu_memory_utilization {utilization} gives this instance {total * utilization / GiB:.1f} GiB "
            f"of {device}'s {total / GiB:.1f} GiB, and the weights and runtime ({held / GiB:.1f} GiB) plus one "
            f"step's activations ({activations / GiB:.1f} GiB) already take that: raise it, or lower "
            "scheduler.max_num_batched_tokens / max_num_seqs"
        )
    if cap is not None:
        budget = min(budget, cap)
    if budget + activations > free:
        others = max(0, total - free - held)
        raise ConfigError(
            f"cache.gpu_memory_utilization {utilization} asks for {(budget + activations) / GiB:.1f} GiB more of "
            f"{device}, but only {free / GiB:.1f} GiB are free (other processes hold about {others / GiB:.1f} GiB): "
            "lower it (instances sharing a GPU need fractions that add up to at most 1, e.g. 0.45 for two), "
            "or free the GPU"
        )
    return budget

"""Tensor parallelism, applied to a built model from outside (as gpt-fast's `apply_tp`):
the model files have no distributed code.

Over the tp ranks of one pipeline stage, `apply_tp` keeps in place, on each rank:
  - attention: its 1/tp of the query heads, and their KV heads (a 1/tp share, or the
    one head they use, replicated, when tp exceeds the KV heads): qkv_proj keeps those
    output rows; o_proj becomes row-parallel (the matching input columns + all-reduce).
    The rank's KV cache then holds only its KV heads.
  - multi-head latent attention (DeepSeek): its 1/tp of the heads: the query projection
    (q_proj or q_b_proj) and kv_b_proj keep those heads' rows, o_proj becomes row-parallel.
    The latent every head shares (q_a_proj, kv_a_proj_with_mqa) is computed whole on every
    rank, and every rank caches it whole.
  - MLP (dense, or a MoE model's shared expert or dense layer): 1/tp of its intermediate
    size: gate_up_proj keeps those rows of gate and of up, down_proj becomes row-parallel.
  - embedding and lm_head: a 1/tp block of the vocabulary (vocab-parallel embedding;
    logits gathered on the stage's first rank). Tied weights stay tied.
Norms, rotary tables and q/k norms are per head or per hidden unit: replicated.
Every rank ends a layer with the same hidden states, bit for bit (the all-reduce gives
all ranks one result), so the residual stream needs no communication.
"""

from __future__ import annotations

import torch
from torch import nn

from vllm_cluster.engine.layers.attention import Attention
from vllm_cluster.engine.layers.mlp import MLP
from vllm_cluster.engine.models import CausalLM
from vllm_cluster.engine.models.deepseek import MlaAttention
from vllm_cluster.engine.parallel.groups import Group
from vllm_cluster.engine.parallel.layers import ParallelLMHead, RowParallelLinear, VocabParallelEmbedding
from vllm_cluster.engine.parallel.topology import kv_heads_of, vocab_shard_size


def apply_tp(model: CausalLM, group: Group) -> None:
    """Shard `model` (whatever of it this pipeline stage kept) over `group`, in place."""
    if group.size == 1:
        return
    rank, size = group.rank_in_group, group.size
    for module in list(model.modules()):
        if isinstance(module, Attention):
            _shard_attention(module, rank, size, group)
        elif isinstance(module, MlaAttention):
            _shard_mla(module, rank, size, group)
        elif isinstance(module, MLP):
            _shard_mlp(module, rank, size, group)
    _shard_vocab(model, rank, size, group)


def _shard_attention(attn: Attention, rank: int, size: int, group: Group) -> None:
    d = attn.head_dim
    num_heads = attn.num_heads // size
    kv_heads = kv_heads_of(rank, size, attn.num_kv_heads)
    q_rows = torch.arange(rank * num_heads * d, (rank + 1) * num_heads * d)
    k_rows = torch.arange(kv_heads.start * d, kv_heads.stop * d) + attn.q_size
    v_rows = k_rows + attn.kv_size
    _keep_rows(attn.qkv_proj, torch.cat([q_rows, k_rows, v_rows]))
    assert attn.o_proj.bias is None, "a row-parallel o_proj with a bias would add it tp times"
    attn.o_proj = RowParallelLinear(attn.o_proj.weight.data[:, q_rows].contiguous(), group)
    attn.num_heads, attn.num_kv_heads = num_heads, len(kv_heads)
    attn.q_size, attn.kv_size = num_heads * d, len(kv_heads) * d


def _shard_mla(attn: MlaAttention, rank: int, size: int, group: Group) -> None:
    num_heads = attn.num_heads // size

    def rows_of(width: int) -> torch.Tensor:  # this rank's heads' rows, `width` rows per head
        return torch.arange(rank * num_heads * width, (rank + 1) * num_heads * width)

    q_proj = attn.q_proj if attn.q_proj is not None else attn.q_b_proj
    assert q_proj is not None
    _keep_rows(q_proj, rows_of(attn.nope_dim + attn.rope_dim))
    _keep_rows(attn.kv_b_proj, rows_of(attn.nope_dim + attn.v_head_dim))
    assert attn.o_proj.bias is None, "a row-parallel o_proj with a bias would add it tp times"
    attn.o_proj = RowParallelLinear(attn.o_proj.weight.data[:, rows_of(attn.v_head_dim)].contiguous(), group)
    attn.num_heads = num_heads


def _shard_mlp(mlp: MLP, rank: int, size: int, group: Group) -> None:
    full, local = mlp.intermediate_size, mlp.intermediate_size // size
    gate_rows = torch.arange(rank * local, (rank + 1) * local)
    _keep_rows(mlp.gate_up_proj, torch.cat([gate_rows, gate_rows + full]))
    assert mlp.down_proj.bias is None, "a row-parallel down_proj with a bias would add it tp times"
    mlp.down_proj = RowParallelLinear(mlp.down_proj.weight.data[:, gate_rows].contiguous(), group)
    mlp.intermediate_size = local


def _keep_rows(linear: nn.Linear, rows: torch.Tensor) -> None:
    rows = rows.to(linear.weight.device)
    linear.weight = nn.Parameter(linear.weight.data.index_select(0, rows), requires_grad=False)
    if linear.bias is not None:
        linear.bias = nn.Parameter(linear.bias.data.index_select(0, rows), requires_grad=False)
    linear.out_features = len(rows)


def _shard_vocab(model: CausalLM, rank: int, size: int, group: Group) -> None:
    vocab = model.config.vocab_size
    rows = vocab_shard_size(vocab, size)
    start = rank * rows
    decoder = model.model
    embed = getattr(decoder, "embed_tokens", None)  # absent on later pipeline stages
    head = getattr(model, "lm_head", None)  # absent on earlier ones
    tied = embed is not None and head is not None and head.weight is embed.weight
    embed_shard = None
    if embed is not None:
        embed_shard = _vocab_block(embed.weight.data, start, rows)
        decoder.embed_tokens = VocabParallelEmbedding(embed_shard, start, group)  # type: ignore[assignment]
    if head is not None:
        head_shard = embed_shard if tied and embed_shard is not None else _vocab_block(head.weight.data, start, rows)
        model.lm_head = ParallelLMHead(head_shard, vocab, group)  # type: ignore[assignment]


def _vocab_block(weight: torch.Tensor, start: int, rows: int) -> nn.Parameter:
    # weight: [V, D] -> rows start .. start + rows - 1, zero past V.
    block = weight.new_zeros(rows, weight.shape[1])
    stop = min(start + rows, weight.shape[0])
    if stop > start:
        block[: stop - start] = weight[start:stop]
    return nn.Parameter(block, requires_grad=False)

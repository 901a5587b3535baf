"""What the driver tells the other ranks, and how it travels: JSON bytes in a uint8
tensor, broadcast from rank 0 on the control group (gloo, on CPU even when the model
runs on GPUs). Nothing is pickled: a rank decodes only ints, strings and lists.

Per message: a header broadcast (int64 [kind, num_bytes]), then the payload broadcast.
  INIT  once, after the weights: the KV cache size (and dtype) every rank allocates.
  STEP  every engine step: the SchedulerOutput.
  STOP  shut down.
  GATHER_KV / SCATTER_KV  (prefill / decode role, tp > 1) the block ids whose KV moves
        between the ranks' head shards and rank 0's full-head transfer cache (kv_mirror.py).
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from typing import Any

import torch

from vllm_cluster.engine.block_pool import BlockId
from vllm_cluster.engine.parallel.groups import Group
from vllm_cluster.engine.request import RequestId
from vllm_cluster.engine.scheduler_output import ScheduledRequest, SchedulerOutput


class Kind(enum.IntEnum):
    INIT = 1
    STEP = 2
    STOP = 3
    GATHER_KV = 4
    SCATTER_KV = 5


@dataclass(frozen=True, slots=True)
class KVCacheInit:
    num_blocks: int
    block_size: int
    max_model_len: int
    kv_cache_dtype: str  # a torch dtype's name: "bfloat16", "float8_e4m3fn", ...


_KV_CACHE_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
                    "float8_e4m3fn": torch.float8_e4m3fn}


def encode_init(init: KVCacheInit) -> bytes:
    return json.dumps([init.num_blocks, init.block_size, init.max_model_len, init.kv_cache_dtype]).encode()


def decode_init(data: bytes) -> KVCacheInit:
    num_blocks, block_size, max_model_len, kv_cache_dtype = json.loads(data)
    assert kv_cache_dtype in _KV_CACHE_DTYPES, f"unknown KV cache dtype {kv_cache_dtype!r}"
    return KVCacheInit(int(num_blocks), int(block_size), int(max_model_len), str(kv_cache_dtype))


def kv_cache_dtype_of(init: KVCacheInit) -> torch.dtype:
    return _KV_CACHE_DTYPES[init.kv_cache_dtype]


def encode_block_ids(block_ids: list[int]) -> bytes:
    return json.dumps([int(b) for b in block_ids], separators=(",", ":")).encode()


def decode_block_ids(data: bytes) -> list[int]:
    return [int(b) for b in json.loads(data)]


def encode_step(output: SchedulerOutput) -> bytes:
    scheduled = [
        [item.request_id, item.token_ids, item.num_computed_tokens, item.new_block_ids, item.is_new, item.samples,
         item.num_prompt_logits]
        for item in output.scheduled
    ]
    return json.dumps([scheduled, sorted(output.removed_request_ids)], separators=(",", ":")).encode()


def decode_step(data: bytes) -> SchedulerOutput:
    scheduled, removed = json.loads(data)
    items = [_scheduled_request(fields) for fields in scheduled]
    return SchedulerOutput(
        scheduled=items,
        num_scheduled_tokens=sum(len(item.token_ids) for item in items),
        removed_request_ids=frozenset(RequestId(str(r)) for r in removed),
    )


def _scheduled_request(fields: list[Any]) -> ScheduledRequest:
    request_id, token_ids, num_computed, block_ids, is_new, samples, num_prompt_logits = fields
    return ScheduledRequest(
        request_id=RequestId(str(request_id)),
        token_ids=[int(t) for t in token_ids],
        num_computed_tokens=int(num_computed),
        new_block_ids=[BlockId(int(b)) for b in block_ids],
        is_new=bool(is_new),
        samples=bool(samples),
        num_prompt_logits=int(num_prompt_logits),
    )


class ControlChannel:
    """Rank 0 sends, every other rank of `group` receives, in the same order."""

    def __init__(self, group: Group) -> None:
        self.group = group
        self.src = group.ranks[0]

    def send(self, kind: Kind, payload: bytes = b"") -> None:
        assert self.group.rank == self.src
        self.group.broadcast_(torch.tensor([int(kind), len(payload)], dtype=torch.int64), self.src)
        if payload:
            self.group.broadcast_(torch.frombuffer(bytearray(payload), dtype=torch.uint8), self.src)

    def receive(self) -> tuple[Kind, bytes]:
        header = torch.empty(2, dtype=torch.int64)
        self.group.broadcast_(header, self.src)
        kind, num_bytes = Kind(int(header[0])), int(header[1])
        payload = torch.empty(num_bytes, dtype=torch.uint8)
        if num_bytes:
            self.group.broadcast_(payload, self.src)
        return kind, payload.numpy().tobytes()

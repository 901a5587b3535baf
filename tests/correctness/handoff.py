"""The prefill -> decode hand-off between two engines of one process, by direct copy
between their transfer caches (what a KV transport does, minus the wire)."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm_cluster.engine import SamplingParams
from vllm_cluster.engine.engine_core import EngineCore
from vllm_cluster.engine.scheduler import SampledToken


@dataclass
class CopyPush:
    """A KVPush that copies each layer's blocks straight into the decode engine's cache
    (the transfer caches: every KV head, whatever each engine's tensor parallelism)."""

    src: EngineCore
    dst: EngineCore
    dst_block_ids: list[int]
    num_skip_blocks: int
    layers_pushed: list[int] = field(default_factory=list)
    num_blocks_pushed: int = 0
    finished: bool = False

    def push_layer(self, layer: int, src_block_ids: list[int]) -> None:
        dst_ids = self.dst_block_ids[self.num_skip_blocks : self.num_skip_blocks + len(src_block_ids)]
        assert len(dst_ids) == len(src_block_ids)
        self.dst.transfer_caches[layer][dst_ids] = self.src.transfer_caches[layer][src_block_ids]
        self.layers_pushed.append(layer)
        self.num_blocks_pushed = len(src_block_ids)

    def finish(self) -> None:
        self.finished = True


def run_disaggregated(
    prefill: EngineCore, decode: EngineCore, prompts: list[list[int]], params: SamplingParams
) -> tuple[list[list[int]], list[CopyPush]]:
    pushes = []
    for i, prompt in enumerate(prompts):
        rid = f"r{i}"
        block_ids = decode.reserve(decode.make_request(rid, prompt, params), lease_s=60)
        assert block_ids is not None
        num_skip = decode.scheduler.requests[rid].num_cached_tokens // decode.kv.block_size
        push = CopyPush(prefill, decode, block_ids, num_skip)
        prefill.add_request(prefill.make_request(rid, prompt, params), push)
        pushes.append(push)
    first: dict[str, SampledToken] = {}
    while prefill.has_unfinished():
        for update in prefill.step():
            assert update.finished and len(update.new_token_ids) == 1
            first[update.request.request_id] = SampledToken(update.new_token_ids[0], None)
    outputs: dict[str, list[int]] = {}
    for rid, token in first.items():
        update = decode.land(rid, token)
        assert update is not None
        outputs[rid] = list(update.new_token_ids)
    while decode.has_unfinished():
        for update in decode.step():
            outputs[update.request.request_id] += update.new_token_ids
    return [outputs[f"r{i}"] for i in range(len(prompts))], pushes

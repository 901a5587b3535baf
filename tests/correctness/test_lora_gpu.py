"""Multi-LoRA on CUDA (skipped without a GPU), on a tiny fp32 dummy Llama: a mixed batch
(two adapters and the base model) whose decode steps replay CUDA graphs (token-block Triton
shrink/expand over the static slot buffer) equals the eager engine, and equals each
request run alone. (Dummy weights are drawn on the device, so CUDA is not compared with
CPU here; tests/unit/test_lora_manager.py covers the CPU path.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.lora_adapters import write_adapter
from tests.unit.test_lora_manager import PROMPTS, TINY
from vllm_cluster.engine import LLM, LoRARequest, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def _llm(enforce_eager: bool) -> LLM:
    return LLM("llama-3.2-1b", load_format="dummy", hf_overrides=TINY, device="cuda", dtype="float32",
               num_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=64, enforce_eager=enforce_eager,
               enable_lora=True, max_loras=2, max_lora_rank=8)


def test_graphs_equal_eager_and_one_by_one(tmp_path: Path) -> None:
    graphs, eager = _llm(False), _llm(True)
    arch = graphs.core.model.config
    adapters = [
        LoRARequest(f"a{i}", i + 1, str(write_adapter(tmp_path / f"a{i}", arch, rank=4 + 4 * i, seed=i, std=0.5)))
        for i in range(2)
    ]
    loras: list[LoRARequest | None] = [adapters[0], None, adapters[1]] * 2
    prompts = PROMPTS * 2
    mixed = [[o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras)]
             for llm in (graphs, eager)]
    alone = [graphs.generate([p], GREEDY, use_tqdm=False, lora_request=r)[0].outputs[0].token_ids
             for p, r in zip(prompts, loras, strict=True)]
    assert mixed[0] == mixed[1], mixed
    assert mixed[0] == alone, (mixed[0], alone)
    assert mixed[0][0] != graphs.generate([prompts[0]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids

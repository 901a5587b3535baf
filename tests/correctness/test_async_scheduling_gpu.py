"""On a GPU: async scheduling (CUDA graph replays and eager steps, placeholders filled on
the device) gives the synchronous engine's tokens and finish reasons, through stop tokens,
max_tokens, min_tokens, seeded sampling and requests joining mid-run. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from vllm_cluster.engine import LLM, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

SMALL = {"num_hidden_layers": 2, "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 2048, "eos_token_id": 1}


@pytest.mark.parametrize("enforce_eager", [False, True], ids=["cuda-graphs", "eager"])
def test_async_equals_sync_on_gpu(enforce_eager: bool) -> None:
    sync = LLM("llama-3.2-1b", load_format="dummy", hf_overrides=SMALL, device="cuda", dtype="float32",
               num_blocks=256, block_size=16, max_model_len=512, max_num_batched_tokens=64, max_num_seqs=4,
               enforce_eager=enforce_eager, async_scheduling=False)
    asyn = sync.derive(async_scheduling=True)
    assert asyn.core._async is not None
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 2048, (n,), generator=g).tolist() for n in (3, 40, 100, 7, 1, 70)]
    reference = sync.generate(prompts[0], SamplingParams(temperature=0.0, max_tokens=20), use_tqdm=False)
    stop_token = reference[0].outputs[0].token_ids[9]
    params = [
        SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=[stop_token]),
        SamplingParams(temperature=0.0, max_tokens=33, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=5),
        SamplingParams(temperature=1.0, top_k=50, seed=11, max_tokens=24),
        SamplingParams(temperature=0.0, max_tokens=12, min_tokens=12, stop_token_ids=[stop_token]),
        SamplingParams(temperature=0.0, max_tokens=1),
    ]
    expected = sync.generate(prompts, params, use_tqdm=False)
    got = asyn.generate(prompts, params, use_tqdm=False)
    summary = [[(c.token_ids, c.finish_reason, c.stop_reason) for c in o.outputs] for o in expected]
    assert [[(c.token_ids, c.finish_reason, c.stop_reason) for c in o.outputs] for o in got] == summary
    assert expected[0].outputs[0].finish_reason == "stop"
    assert not asyn.core.has_unfinished()
    assert asyn.core.kv.pool.num_free_blocks == 256

"""On two GPUs (NCCL): tp=2 and pp=2 give the same greedy tokens as one GPU (fp32, random
weights), and a worker killed mid-run fails the next step with WorkerDiedError instead of
hanging NCCL. Skipped with fewer than two CUDA devices."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator

import pytest
import torch

from vllm_cluster.engine import LLM, SamplingParams
from vllm_cluster.engine.errors import WorkerDiedError
from vllm_cluster.engine.parallel.launch import ProcessLauncher

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")

CONFIG = dict(
    vocab_size=4096, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
    num_attention_heads=8, num_key_value_heads=2, head_dim=64, max_position_embeddings=2048,
    tie_word_embeddings=False,
)
OPTIONS = dict(load_format="dummy", hf_overrides=CONFIG, device="cuda", dtype="float32",
               num_blocks=256, max_model_len=1024, max_num_batched_tokens=128, max_num_seqs=16)
PARAMS = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 4096, (n,), generator=g).tolist() for n in (1, 7, 33, 300, 64)]
    return [*prompts, prompts[3][:100] + [5, 6, 7]]  # the last shares the 300-token prompt's blocks


@pytest.fixture(scope="module")
def single() -> LLM:
    llm = LLM("llama-3.2-1b", **OPTIONS)
    with torch.no_grad():  # a peaked next-token distribution: no near-ties to flip
        llm.core.model.lm_head.weight.mul_(15.0)
    return llm


@pytest.fixture(scope="module")
def reference(single: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in single.generate(_prompts(), PARAMS, use_tqdm=False)]


@pytest.fixture(scope="module", params=[(2, 1), (1, 2)], ids=["tp2", "pp2"])
def parallel(request: pytest.FixtureRequest, single: LLM) -> Iterator[LLM]:
    tp, pp = request.param
    llm = single.derive(tensor_parallel_size=tp, pipeline_parallel_size=pp)
    yield llm
    llm.core.shutdown()


def test_greedy_tokens_equal_one_gpu(parallel: LLM, reference: list[list[int]]) -> None:
    outputs = parallel.generate(_prompts(), PARAMS, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == reference
    assert outputs[-1].num_cached_tokens >= 96
    assert parallel.core.kv.pool.num_free_blocks == parallel.core.kv.pool.num_blocks


def test_dead_worker_fails_the_step_instead_of_hanging(single: LLM) -> None:
    llm = single.derive(tensor_parallel_size=2)
    try:
        executor = llm.core.executor
        assert executor is not None and isinstance(executor.launcher, ProcessLauncher)
        llm.generate(_prompts()[:2], PARAMS, use_tqdm=False)
        os.kill(executor.launcher.pid(1), signal.SIGKILL)
        with pytest.raises(WorkerDiedError, match=r"rank 1 \(pipeline stage 0, tensor rank 1\) was killed by SIGKILL"):
            llm.generate(_prompts(), PARAMS, use_tqdm=False)
    finally:
        llm.core.shutdown()

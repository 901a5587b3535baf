"""Session-wide fixtures: the bundled SmolLM2 is loaded once, by us and by HF transformers.

Tests that need other cache or scheduler settings call `smollm2.derive(...)`, which builds
a new engine over the same weights in well under a second.

Without a GPU the Triton kernels run under the interpreter (tests/kernels). Triton reads
TRITON_INTERPRET when it is first imported, and libraries loaded by other tests (peft,
transformers' integrations) may import it long before tests/kernels is collected, so it
is set here, before anything else. The engine never runs Triton on CPU tensors, so
nothing else is affected.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from vllm_cluster.engine import LLM

torch.set_num_threads(2)


@pytest.fixture(scope="session")
def smollm2() -> LLM:
    return LLM(
        "smollm2-135m-instruct",
        device="cpu",
        dtype="float32",
        num_threads=2,
        num_blocks=512,
        max_model_len=2048,
        max_num_batched_tokens=256,
        max_num_seqs=32,
    )


@pytest.fixture(scope="session")
def hf_smollm2(smollm2: LLM) -> Any:
    from transformers import AutoModelForCausalLM

    path = smollm2.core.source.path
    assert path is not None
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    return model.eval()

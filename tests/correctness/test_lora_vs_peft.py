"""Greedy tokens of SmolLM2 under LoRA adapters equal HF transformers + PEFT on the same
adapters (same GGUF weights, fp32), in one batch that mixes the base model and two
adapters. The adapters are random, drawn from a seeded generator (lora_B is zero at PEFT's
init, and PEFT draws lora_A from the global RNG). Mixed batches against
one-by-one runs, and LRU swapping: tests/unit/test_lora_manager.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from vllm_cluster.engine import LLM, LoRARequest, SamplingParams

peft = pytest.importorskip("peft")

MAX_NEW_TOKENS = 8
PROMPTS = ["The quick brown fox", "def fibonacci(n):\n    "]
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS)
CONFIGS = {
    "all": dict(
        r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    ),
    "some": dict(r=4, lora_alpha=8, use_rslora=True, target_modules=["q_proj", "v_proj", "down_proj"]),
}


@pytest.fixture(scope="module")
def lora_llm() -> LLM:
    return LLM("smollm2-135m-instruct", device="cpu", dtype="float32", num_threads=2, num_blocks=128,
               max_model_len=512, max_num_batched_tokens=64, max_num_seqs=8,
               enable_lora=True, max_loras=2, max_lora_rank=8)


@pytest.fixture(scope="module")
def peft_model(lora_llm: LLM, tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, dict[str, LoRARequest]]:
    """HF's SmolLM2 with both adapters attached (randomized), and where each was saved."""
    from transformers import AutoModelForCausalLM

    path = lora_llm.core.source.path
    assert path is not None
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    model = None
    for name, options in CONFIGS.items():
        config = peft.LoraConfig(lora_dropout=0.0, **options)
        if model is None:
            model = peft.get_peft_model(hf, config, adapter_name=name)
        else:
            model.add_adapter(name, config)
    assert model is not None
    # Both factors from one seeded generator: PEFT draws lora_A from the global RNG, whose
    # state depends on which tests ran before, and with some draws the adapters changed no
    # greedy token of these prompts. 0.05 on both makes each adapter's delta a sizeable
    # share of the base weights, so every adapter changes a completion.
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if "lora_A" in param_name or "lora_B" in param_name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.05)
    root = tmp_path_factory.mktemp("adapters")
    model.save_pretrained(str(root))  # each adapter in root/<name>
    requests = {name: LoRARequest(name, i + 1, str(root / name)) for i, name in enumerate(CONFIGS)}
    assert all((Path(r.lora_path) / "adapter_model.safetensors").is_file() for r in requests.values())
    return model.eval(), requests


def _hf_greedy(model: Any, ids: list[int], adapter: str | None) -> list[int]:
    with torch.inference_mode():
        args = dict(attention_mask=torch.ones(1, len(ids), dtype=torch.long), max_new_tokens=MAX_NEW_TOKENS,
                    do_sample=False, pad_token_id=model.generation_config.eos_token_id)
        if adapter is None:
            with model.disable_adapter():
                out = model.generate(torch.tensor([ids]), **args)
        else:
            model.set_adapter(adapter)
            out = model.generate(torch.tensor([ids]), **args)
    return out[0, len(ids):].tolist()


def test_mixed_batch_equals_hf_peft(lora_llm: LLM, peft_model: tuple[Any, dict[str, LoRARequest]]) -> None:
    model, requests = peft_model
    ids = [lora_llm.tokenizer.encode(p) for p in PROMPTS]
    loras: list[LoRARequest | None] = [None, requests["all"], requests["some"]]
    batch_ids = [p for p in ids for _ in loras]
    batch_loras = loras * len(ids)
    outputs = lora_llm.generate(batch_ids, GREEDY, use_tqdm=False, lora_request=batch_loras)
    ours = [o.outputs[0].token_ids for o in outputs]
    expected = [
        _hf_greedy(model, p, None if r is None else r.lora_name) for p, r in zip(batch_ids, batch_loras, strict=True)
    ]
    assert ours == expected
    for k in (1, 2):  # each adapter changes a completion: the comparison means something
        assert any(ours[3 * i] != ours[3 * i + k] for i in range(len(ids)))


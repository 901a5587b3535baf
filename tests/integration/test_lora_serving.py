"""Multi-LoRA through a real disaggregated cluster (router + 1 prefill + 1 decode): an
adapter named in the worker config at start-up and one loaded at run time through
/v1/load_lora_adapter serve requests whose `model` names them, token for token as the
offline engine with the same adapter; unknown and unloaded adapters get vLLM's 404."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.lora_adapters import write_adapter
from vllm_cluster.cluster.local import LocalCluster
from vllm_cluster.engine import LLM, LoRARequest, SamplingParams
from vllm_cluster.engine.config import ModelConfig
from vllm_cluster.engine.loader import resolve
from vllm_cluster.engine.models import ModelArchConfig

pytestmark = pytest.mark.slow

CONFIG = Path(__file__).with_name("lora_cluster.yaml")
PROMPT = "The capital of France is"
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    arch = ModelArchConfig.from_hf_dict(resolve(ModelConfig()).hf_config)
    root = tmp_path_factory.mktemp("adapters")
    return {
        name: str(write_adapter(root / name, arch, rank=8, seed=seed, std=0.02))
        for seed, name in enumerate(["boot", "late"])
    }


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, adapters: dict[str, str]) -> Iterator[LocalCluster]:
    pytest.importorskip("ucxx")
    data = yaml.safe_load(CONFIG.read_text())
    data["engine"]["lora"]["lora_modules"] = {"boot": adapters["boot"]}
    path = tmp_path_factory.mktemp("lora-cluster") / "cluster.yaml"
    path.write_text(yaml.safe_dump(data))
    local = LocalCluster.from_yaml(path)
    local.log_dir = path.parent
    with local:
        yield local


def _post(cluster: LocalCluster, route: str, body: dict[str, Any]) -> tuple[int, Any]:
    request = urllib.request.Request(cluster.http_address + route, data=json.dumps(body).encode(), method="POST")
    request.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            status, payload = response.status, response.read()
    except urllib.error.HTTPError as e:
        status, payload = e.code, e.read()
    try:
        return status, json.loads(payload)
    except json.JSONDecodeError:
        return status, payload.decode()


def _complete(cluster: LocalCluster, model: str) -> tuple[int, Any]:
    return _post(
        cluster, "/v1/completions", {"model": model, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0}
    )


def test_adapters_served_as_offline(cluster: LocalCluster, adapters: dict[str, str]) -> None:
    status, reply = _post(cluster, "/v1/load_lora_adapter", {"lora_name": "late", "lora_path": adapters["late"]})
    assert status == 200, reply
    with urllib.request.urlopen(cluster.http_address + "/v1/models", timeout=30) as response:
        models = {m["id"]: m["parent"] for m in json.loads(response.read())["data"]}
    assert models == {"smollm2-135m-instruct": None, "boot": "smollm2-135m-instruct", "late": "smollm2-135m-instruct"}
    served = {}
    for model in ("smollm2-135m-instruct", "boot", "late"):
        status, reply = _complete(cluster, model)
        assert status == 200, reply
        assert reply["model"] == model  # as vLLM: the adapter's name, not the base model's
        served[model] = reply["choices"][0]["text"]
    llm = LLM("smollm2-135m-instruct", device="cpu", dtype="float32", num_threads=1, num_blocks=64,
              max_model_len=512, enable_lora=True, max_loras=2, max_lora_rank=8)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    loras = [None, LoRARequest("boot", 1, adapters["boot"]), LoRARequest("late", 2, adapters["late"])]
    offline = [o.outputs[0].text for o in llm.generate([PROMPT] * 3, params, use_tqdm=False, lora_request=loras)]
    assert list(served.values()) == offline
    assert len(set(offline)) == 3  # each adapter changes the completion


def test_unknown_and_unloaded_adapters_404(cluster: LocalCluster, adapters: dict[str, str]) -> None:
    status, error = _complete(cluster, "nope")
    assert status == 404
    assert error["error"]["message"] == "The model `nope` does not exist."
    assert error["error"]["type"] == "NotFoundError" and error["error"]["param"] == "model"
    status, reply = _post(cluster, "/v1/load_lora_adapter", {"lora_name": "gone", "lora_path": adapters["late"]})
    assert status == 200, reply
    status, reply = _post(cluster, "/v1/unload_lora_adapter", {"lora_name": "gone"})
    assert status == 200, reply
    status, error = _complete(cluster, "gone")
    assert status == 404 and error["error"]["message"] == "The model `gone` does not exist."
    status, error = _post(cluster, "/v1/unload_lora_adapter", {"lora_name": "gone"})
    assert status == 404 and error["error"]["message"] == "The lora adapter 'gone' cannot be found."

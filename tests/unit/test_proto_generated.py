"""The generated protobuf/gRPC code in proto/ matches the .proto files."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_generated_code_is_fresh() -> None:
    pytest.importorskip("grpc_tools")
    result = subprocess.run(
        [sys.executable, "-m", "vllm_cluster.proto.generate", "--check"], cwd=ROOT, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr


def test_roundtrip_of_sampling_params() -> None:
    from vllm_cluster.engine import SamplingParams
    from vllm_cluster.worker.convert import sampling_params_from_proto, sampling_params_to_proto

    for params in (
        SamplingParams(),
        SamplingParams(temperature=0.7, top_p=0.9, top_k=40, min_p=0.05, seed=3, max_tokens=None,
                       stop=["\n\n"], stop_token_ids=[2], logprobs=3, repetition_penalty=1.1),
    ):
        assert sampling_params_from_proto(sampling_params_to_proto(params)) == params

"""schemathesis, as users run it (`st run`), against the HTTP front's own /openapi.json:
generated requests, valid and not, on every route, judged by its default checks (no
server error, status codes, content types and bodies as documented, ...). The front is the
real one (build_app over the router's gRPC API, the bundled tokenizer) in front of the
canned-token server instead of a cluster, so that hundreds of generated requests take
seconds: validation, errors and response shapes are the front's own.

Two checks are left out. positive_data_acceptance (a request the schema allows must
succeed) cannot hold where the rules are not JSON Schema's to state: token ids inside the
model's vocabulary, exactly one of prompt or messages. negative_data_rejection (a request
the schema forbids must fail) is at odds with lax parsing, which vLLM's server shares:
`"stream": 0` is read as false."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.openai_support import KEY, MODEL, start_front
from vllm_cluster.engine.loader import bundled_model_path
from vllm_cluster.engine.tokenizer import load_tokenizer
from vllm_cluster.loadtest.canned import CannedConfig, canned_server

pytestmark = pytest.mark.slow


def test_schemathesis_finds_nothing(tmp_path: Path) -> None:
    st = shutil.which("st", path=str(Path(sys.executable).parent)) or shutil.which("st")
    if st is None:
        pytest.skip("schemathesis is not installed")
    with canned_server(CannedConfig(model=MODEL)) as canned, start_front(
        canned.grpc_address, tokenizer=load_tokenizer(bundled_model_path())
    ) as front:
        run = subprocess.run(
            [st, "run", f"{front.http_address}/openapi.json", "--header", f"Authorization: Bearer {KEY}",
             "--max-examples", "30", "--seed", "1", "--request-timeout", "30", "--no-color",
             "--generation-database", "none", "--exclude-checks", "positive_data_acceptance,negative_data_rejection"],
            capture_output=True, text=True, timeout=900, cwd=tmp_path,
        )
    assert run.returncode == 0, run.stdout[-8000:] + run.stderr[-2000:]

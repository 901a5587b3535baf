"""schemathesis, as users run it (`st run`), against the HTTP front's own /openapi.json:
generated requests, valid and not, on every route, judged by all of its default checks (no
server error, status codes, content types and bodies as documented, a request the schema
allows is accepted, one it forbids is refused). The front is the real one (build_app over
the router's gRPC API, the bundled tokenizer) in front of the canned-token server instead of
a cluster, so that hundreds of generated requests take seconds: validation, errors and
response shapes are the front's own.

The document states the server's rules and the server keeps to them: field types (a value of
another JSON type is refused, not converted: `"stream": 0` is a 400), ranges, enums and
patterns, token ids below the tokenizer's vocabulary and max_tokens below the context length
(both known only to the running server, written into the document by openapi.py), required
and exclusive fields (oneOf, if/then). What no schema keyword can state is declared in
schemathesis.toml beside this file, which says which rules and which routes: rules spanning
fields, the model or its chat template (the prompt plus max_tokens over the context length,
min_tokens over max_tokens, a tool_choice naming a function not among tools, tool-call
arguments that are not JSON text, ...). On the routes that have such rules (generation, and
those rendering the chat template) a 400 answering a valid request is accepted; on the
others, positive_data_acceptance holds in full."""

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
CONFIG = Path(__file__).with_name("schemathesis.toml")


def test_schemathesis_finds_nothing(tmp_path: Path) -> None:
    st = shutil.which("st", path=str(Path(sys.executable).parent)) or shutil.which("st")
    if st is None:
        pytest.skip("schemathesis is not installed")
    with canned_server(CannedConfig(model=MODEL)) as canned, start_front(
        canned.grpc_address, tokenizer=load_tokenizer(bundled_model_path())
    ) as front:
        run = subprocess.run(
            [st, "--config-file", str(CONFIG), "run", f"{front.http_address}/openapi.json",
             "--header", f"Authorization: Bearer {KEY}", "--max-examples", "30", "--seed", "1",
             "--request-timeout", "30", "--no-color", "--generation-database", "none"],
            capture_output=True, text=True, timeout=900, cwd=tmp_path,
        )
    assert run.returncode == 0, run.stdout[-8000:] + run.stderr[-2000:]

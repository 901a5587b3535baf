"""router.chat_template (vLLM's --chat-template): a file or the template's text replaces the
tokenizer's own for chat requests; a value that is neither is refused when the config loads."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.openai_support import http, refusing_address, start_front
from vllm_cluster.engine.errors import ConfigError
from vllm_cluster.engine.loader import bundled_model_path
from vllm_cluster.engine.tokenizer import apply_chat_template, chat_template_text, load_tokenizer
from vllm_cluster.worker.router_config import RouterConfig

TEMPLATE = (
    "{% for m in messages %}<<{{ m.role }}>> {{ m.content }}\n{% endfor %}{% if add_generation_prompt %}>>{% endif %}"
)
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


def test_a_file_or_the_text_is_taken_and_anything_else_refused(tmp_path: Path) -> None:
    path = tmp_path / "template.jinja"
    path.write_text(TEMPLATE)
    assert chat_template_text(str(path)) == chat_template_text(TEMPLATE) == TEMPLATE
    assert RouterConfig.from_dict({"chat_template": str(path)}).chat_template == str(path)
    with pytest.raises(ConfigError, match=r"router\.chat_template: '.*nowhere.jinja' is no file"):
        RouterConfig.from_dict({"chat_template": str(tmp_path / "nowhere.jinja")})


def test_the_front_renders_chats_with_the_given_template() -> None:
    tokenizer = load_tokenizer(bundled_model_path())
    default = apply_chat_template(tokenizer, CHAT)
    tokenizer.chat_template = chat_template_text(TEMPLATE)  # what the router does with router.chat_template
    with refusing_address() as nowhere, start_front(nowhere, tokenizer=tokenizer) as front:
        status, _, body = http(front, "POST", "/tokenize", {"messages": CHAT})
    assert status == 200, body
    assert body["tokens"] != default
    assert tokenizer.decode(body["tokens"]) == "<<user>> What is the capital of France?\n>>"

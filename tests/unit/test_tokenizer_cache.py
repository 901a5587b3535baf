"""A GGUF file's tokenizer is converted once and read back from the cache after that."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from vllm_cluster.engine import tokenizer as tokenizer_module
from vllm_cluster.engine.loader import bundled_model_path
from vllm_cluster.engine.tokenizer import load_tokenizer, tokenizer_cache_dir


def test_the_second_load_reads_the_converted_tokenizer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert tokenizer_cache_dir() == tmp_path / "vllm_cluster" / "tokenizers"
    converted = load_tokenizer(bundled_model_path())
    (entry,) = tokenizer_cache_dir().iterdir()
    assert (entry / "tokenizer.json").is_file()
    assert (tokenizer_cache_dir().stat().st_mode & 0o077) == 0  # nobody else's to read or swap

    cached = load_tokenizer(bundled_model_path())
    assert Path(cached.name_or_path) == entry
    text = "Hello <|im_start|> world, 123 \u00fcn\u00efcode\n\n  x"
    assert cached.encode(text) == converted.encode(text)
    assert cached.get_vocab() == converted.get_vocab()
    assert cached.chat_template == converted.chat_template
    assert (cached.eos_token_id, cached.all_special_ids) == (converted.eos_token_id, converted.all_special_ids)


class _Saves:
    def __init__(self) -> None:
        self.num_saves = 0

    def save_pretrained(self, path: str) -> Any:
        self.num_saves += 1
        (Path(path) / "tokenizer_config.json").write_text("{}")


def test_an_entry_another_process_kept_first_stands(tmp_path: Path) -> None:
    entry = tmp_path / "tokenizers" / "abc"
    tokenizer_module._keep(_Saves(), entry)
    (entry / "mine").write_text("x")
    tokenizer_module._keep(_Saves(), entry)  # replaces it whole
    assert not (entry / "mine").exists() and (entry / "tokenizer_config.json").is_file()
    assert [p.name for p in entry.parent.iterdir()] == ["abc"]  # no staging directory left


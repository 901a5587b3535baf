"""Tokenizer loading (HF tokenizers, also from GGUF metadata) and the chat template."""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from vllm_cluster.engine.errors import ConfigError, InvalidRequestError, ModelLoadError

logger = logging.getLogger(__name__)


def load_tokenizer(path: Path) -> Any:
    """An HF tokenizer for a model directory or a .gguf file."""
    from transformers import AutoTokenizer

    try:
        if path.is_file():
            return _gguf_tokenizer(path)
        return AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot load a tokenizer from {path}: {e}") from e


def tokenizer_cache_dir() -> Path:
    """Where tokenizers converted from GGUF files are kept: $XDG_CACHE_HOME/vllm_cluster/tokenizers
    (~/.cache by default)."""
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "vllm_cluster" / "tokenizers"


def _gguf_tokenizer(path: Path) -> Any:
    """transformers builds a GGUF file's tokenizer from its metadata in about 10 s of CPU; every
    router and worker of a cluster needs it. The first load saves the result as a tokenizer
    directory keyed by the file (path, size, mtime) and the transformers version; later loads
    read that (about 0.4 s). A cache that cannot be written only costs the next load its time."""
    import transformers
    from transformers import AutoTokenizer

    resolved = path.resolve()
    stat = resolved.stat()
    key = f"{resolved}\0{stat.st_size}\0{stat.st_mtime_ns}\0{transformers.__version__}"
    cached = tokenizer_cache_dir() / hashlib.sha256(key.encode()).hexdigest()[:32]
    if (cached / "tokenizer_config.json").is_file():
        try:
            return AutoTokenizer.from_pretrained(str(cached))
        except (OSError, ValueError):
            pass  # a damaged entry: convert again and replace it
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    try:
        _keep(tokenizer, cached)
    except OSError as e:
        logger.warning("could not keep the tokenizer converted from %s in %s: %s", path, cached.parent, e)
    return tokenizer


def _keep(tokenizer: Any, cached: Path) -> None:
    """Save `tokenizer` as the cache entry `cached`, replacing any entry there."""
    cached.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    staging = Path(tempfile.mkdtemp(dir=cached.parent, prefix=".staging-"))
    try:
        tokenizer.save_pretrained(str(staging))
        shutil.rmtree(cached, ignore_errors=True)
        os.replace(staging, cached)  # whole or absent: a concurrent reader never sees half an entry
    except OSError:
        if not (cached / "tokenizer_config.json").is_file():  # else another process kept it first
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def chat_template_text(value: str, where: str = "chat_template") -> str:
    """vLLM's --chat-template: the Jinja template itself (text holding `{`), or a file's path."""
    if "{" in value:
        return value
    path = Path(value).expanduser()
    if not path.is_file():
        raise ConfigError(f"{where}: {value!r} is no file, nor a Jinja template (one holds '{{'); "
                          "give the template's path or its text")
    return path.read_text()


# What apply_chat_template itself decides; chat_template_kwargs may not set these.
_RESERVED_TEMPLATE_KWARGS = frozenset({"conversation", "messages", "chat_template", "tokenize", "return_dict",
                                       "return_tensors", "padding", "truncation", "max_length", "tokenizer_kwargs"})


def apply_chat_template(
    tokenizer: Any, messages: Sequence[Mapping[str, Any]], template_kwargs: Mapping[str, Any] | None = None,
    tools: list[dict[str, Any]] | None = None,
) -> list[int]:
    """The chat's prompt token ids. `template_kwargs` (vLLM's chat_template_kwargs) are extra
    variables of the template render, e.g. Qwen3's enable_thinking; they may override
    add_generation_prompt, as in vLLM. `tools`: the functions the model may call, in
    OpenAI's shape, as HF templates read them."""
    if not getattr(tokenizer, "chat_template", None):
        raise ModelLoadError("this model's tokenizer has no chat template; use generate() with a plain prompt")
    render = {"add_generation_prompt": True, **check_template_kwargs(template_kwargs or {})}
    if tools is not None:
        render["tools"] = tools
    ids = tokenizer.apply_chat_template(list(messages), tokenize=True, **render)
    # transformers 5 returns a BatchEncoding here, 4.x a list.
    if hasattr(ids, "input_ids") or isinstance(ids, dict):
        ids = ids["input_ids"]
    return list(ids)


def check_template_kwargs(template_kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """chat_template_kwargs as the render takes them; InvalidRequestError on a reserved name."""
    reserved = sorted(k for k in template_kwargs if k in _RESERVED_TEMPLATE_KWARGS or not isinstance(k, str))
    if reserved:
        raise InvalidRequestError(f"chat_template_kwargs may not set {reserved}: the server decides those")
    return dict(template_kwargs)


def encode_bad_words(tokenizer: Any, bad_words: list[str]) -> list[list[int]]:
    """Each bad word's token sequences, as vLLM builds them: the word alone, and with a
    leading space when that tokenizes to a different first token of the same length (so
    the word is banned at the start of the text and after a space)."""
    sequences: list[list[int]] = []
    for word in bad_words:
        alone = list(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        spaced = list(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        sequences.append(alone)
        if spaced and spaced[0] != alone[0] and len(spaced) == len(alone):
            sequences.append(spaced)
    return sequences

"""A GGUF file's metadata is parsed once per process while the file is unchanged
(engine/loader/gguf_file.py): the config and the weights of one engine, and the engines
after it, share the parse; a rewritten file is parsed again."""

from __future__ import annotations

import os
from pathlib import Path

import gguf
import pytest

from vllm_cluster.engine.errors import ModelLoadError
from vllm_cluster.engine.loader import gguf_file


def _write(path: Path, value: int) -> None:
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_uint32("test.value", value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_one_parse_per_unchanged_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    parses: list[str] = []
    real = gguf.GGUFReader
    monkeypatch.setattr(gguf, "GGUFReader", lambda path: parses.append(path) or real(path))
    path = tmp_path / "m.gguf"
    _write(path, 7)
    first = gguf_file._reader(path)
    assert gguf_file._reader(path) is first and len(parses) == 1
    assert first.fields["test.value"].contents() == 7

    _write(path, 8)  # the same size: told apart by its modification time
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    again = gguf_file._reader(path)
    assert again is not first and len(parses) == 2
    assert again.fields["test.value"].contents() == 8


def test_a_damaged_file_is_refused_every_time(tmp_path: Path) -> None:
    path = tmp_path / "bad.gguf"
    path.write_bytes(b"not a gguf file at all")
    for _ in range(2):  # a failed parse is not remembered
        with pytest.raises(ModelLoadError, match="not a readable GGUF file"):
            gguf_file._reader(path)

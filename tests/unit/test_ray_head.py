"""The local Ray's token authentication: a token exists before Ray needs one, readable by
its owner alone, so that `up --detach` (`ray start --head`, which makes none) starts on a
machine where Ray has never run."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from vllm_cluster.cluster.ray_head import make_auth_token, use_local_ray


def test_the_token_is_made_once_and_readable_by_its_owner_alone(tmp_path: Path) -> None:
    path = tmp_path / ".ray" / "auth_token"
    make_auth_token(path)
    token = path.read_text()
    assert len(token) == 64 and int(token, 16) >= 0
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    make_auth_token(path)
    assert path.read_text() == token


def test_use_local_ray_leaves_a_given_token_alone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("RAY_AUTH_TOKEN", "0" * 64)
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    use_local_ray()
    assert not (tmp_path / ".ray").exists()
    monkeypatch.delenv("RAY_AUTH_TOKEN")
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(tmp_path / "elsewhere"))
    use_local_ray()
    assert len((tmp_path / "elsewhere").read_text()) == 64


def test_a_detached_head_starts_where_ray_never_ran(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("ray")
    from vllm_cluster.cluster.ray_head import start_head, stop_head

    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    for name in ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_AUTH_MODE"):
        monkeypatch.delenv(name, raising=False)
    address, head = start_head(tmp_path / "ray-head.log", num_cpus=1)
    try:
        token = home / ".ray" / "auth_token"
        assert stat.S_IMODE(token.stat().st_mode) == 0o600
    finally:
        assert stop_head(head, address) == []

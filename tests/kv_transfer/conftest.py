"""Fixtures for the KV transfer tests: one parameter per backend, and leak checks."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

# Threads that ucxx starts once per process and keeps (see kv_transfer/ucx.py).
PROCESS_WIDE_THREADS = {"kv-transfer-ucx", "UCX-Py Async Notifier Thread"}


@pytest.fixture(params=["local", "ucx", "nccl"], ids=["local", "ucx", "gloo"])
def backend(request: pytest.FixtureRequest) -> str:
    if request.param == "ucx":
        pytest.importorskip("ucxx")
    return str(request.param)


@pytest.fixture
def closing() -> Iterator[list[Any]]:
    """Senders and receivers appended here are closed after the test, newest first."""
    objects: list[Any] = []
    yield objects
    for obj in reversed(objects):
        obj.close()


@pytest.fixture(autouse=True)
def no_leaked_threads() -> Iterator[None]:
    before = set(threading.enumerate())
    yield
    deadline = time.monotonic() + 5.0
    while True:
        leaked = [
            t.name
            for t in threading.enumerate()
            if t not in before and t.name not in PROCESS_WIDE_THREADS
        ]
        if not leaked or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert not leaked, f"threads left running after close(): {leaked}"

"""Kernel tests run the Triton kernels under the interpreter when there is no GPU.

TRITON_INTERPRET must be set before triton is first imported: tests/conftest.py sets it
for the whole session (other tests' libraries may import triton first); it is set here too
for a run of this folder with another rootdir conftest.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _patch_interpreter_scalar_index() -> None:
    """The triton 3.6 interpreter holds scalars as 1-element arrays and converts them with
    int(), which numpy >= 2.3 refuses, so `range(start, end)` over runtime bounds fails.
    Convert with .item() instead; compiled kernels are unaffected."""
    import triton.runtime.interpreter as triton_interpreter

    original = triton_interpreter._patch_lang_tensor

    def patch(tensor, scope) -> None:  # type: ignore[no-untyped-def]
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    if getattr(original, "__name__", "") != "patch":
        triton_interpreter._patch_lang_tensor = patch


if os.environ.get("TRITON_INTERPRET") == "1":
    _patch_interpreter_scalar_index()

"""`--vary MODULE.ATTR=A,B` for the benchmarks: compare values of a module attribute (a
kernel's switch or tuning constant) in one run, on one machine."""

from __future__ import annotations

import ast
import importlib


def parse(specs: list[str]) -> list[tuple[str, list[str]]]:
    """["kernels.x.FLAG=False,True", ...] -> [("kernels.x.FLAG", ["False", "True"]), ...]."""
    return [(name, values.split(",")) for name, values in (spec.split("=", 1) for spec in specs)]


def set_attribute(name: str, value: str) -> None:
    """Set MODULE.ATTR to `value`, a Python literal."""
    module, attr = name.rsplit(".", 1)
    setattr(importlib.import_module(module), attr, ast.literal_eval(value))

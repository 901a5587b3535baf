"""Nothing read off a network is unpickled: no module of ours imports a pickle-based
deserializer or calls one (torch.load without weights_only, broadcast_object_list and
friends, yaml.load, marshal, eval of data). The listeners' side is tested with real
payloads in tests/integration/test_faults.py."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ["engine", "kernels", "cluster", "proto", "kv_transfer", "kv_index", "prefill_service", "decode_service",
            "router", "loadtest", "metrics"]
FORBIDDEN = {
    r"^\s*(import|from)\s+(c?pickle|dill|cloudpickle|marshal|shelve|jsonpickle)\b": "a pickle-family module",
    r"\bpickle\.loads?\(": "pickle.load(s)",
    r"\btorch\.load\((?![^)]*weights_only\s*=\s*True)": "torch.load without weights_only=True",
    r"\b(broadcast|scatter|gather|all_gather|recv|send)_object(_list)?\(": (
        "torch.distributed object collectives (pickle)"
    ),
    r"\byaml\.load\(": "yaml.load (use yaml.safe_load)",
    r"\bnp\.load\([^)]*allow_pickle\s*=\s*True": "numpy allow_pickle",
    r"(?<![\w.])eval\(": "eval",
}


def test_no_module_deserializes_with_pickle() -> None:
    files = [f for package in PACKAGES for f in (ROOT / package).rglob("*.py") if "_pb2" not in f.name]
    assert len(files) > 50
    found = []
    for path in files:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            for pattern, what in FORBIDDEN.items():
                if re.search(pattern, line):
                    found.append(f"{path.relative_to(ROOT)}:{number}: {what}: {line.strip()}")
    assert not found, "\n".join(found)


def test_the_scan_catches_what_it_looks_for() -> None:
    lines = ["import pickle", "x = torch.load(path)", "dist.broadcast_object_list(objs)", "yaml.load(f)", "eval(s)"]
    assert all(any(re.search(p, line) for p in FORBIDDEN) for line in lines)
    assert not any(re.search(p, "model.eval()") for p in FORBIDDEN)
    assert not any(re.search(p, "torch.load(path, weights_only=True)") for p in FORBIDDEN)

"""Running the `vllm-cluster` command as a user does, from the repository root."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def cli(*args: str, timeout_s: float = 120.0, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`env`: the command's whole environment (None: this process's)."""
    return subprocess.run([sys.executable, "-m", "vllm_cluster.cluster.cli", *args], capture_output=True, text=True,
                          timeout=timeout_s, cwd=Path(__file__).resolve().parents[2], env=env)

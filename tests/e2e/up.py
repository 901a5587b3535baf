"""Running the `vllm-cluster` command as a user does, from the repository root."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

# The engine section of the e2e clusters' YAML: SmolLM2 on one CPU thread, a small batch.
ENGINE_YAML = """\
engine:
  model:
    model: smollm2-135m-instruct
    dtype: float32
  cache:
    num_blocks: 128
  scheduler:
    max_num_seqs: 4
    max_num_batched_tokens: 128
    max_model_len: 1024
  device: cpu
  num_threads: 1
"""


def cli(*args: str, timeout_s: float = 120.0, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`env`: the command's whole environment (None: this process's)."""
    return subprocess.run([sys.executable, "-m", "vllm_cluster.cluster.cli", *args], capture_output=True, text=True,
                          timeout=timeout_s, cwd=Path(__file__).resolve().parents[2], env=env)

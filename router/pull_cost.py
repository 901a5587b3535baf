"""The pull cost model as measured: the configured link bandwidth and prompt rate
(`router.kv_pull_link_gib_s`, `kv_pull_recompute_tokens_s`) are where it starts, and the
router's own observations move it from there.

- Link: every pull that pushed blocks is timed at the router (the PushCached call); less
  the configured fixed cost (`kv_pull_setup_s`), its bytes over that time are one sample
  of the bandwidth between two instances.
- Prompt rate: every prefill reply says how long the prefill computed and how many prompt
  tokens it did not find cached; tokens over seconds is one sample of the rate at which an
  instance computes a prompt (what a pull saves). Replies under `MIN_PROMPT_TOKENS` are not
  samples: a few tokens measure the step's fixed overhead, not a rate. Without a prefill
  pool (decode computes prompts, and its timings do not separate compute from queueing)
  the prompt rate stays as configured.

Each estimate is an exponentially weighted mean of its samples (`ALPHA` the newest
sample's weight), so a changed link or load shows within a few pulls and one slow pull
does not swing the decision.
"""

from __future__ import annotations

import threading
from dataclasses import replace

from vllm_cluster.router.pull import PullCost

ALPHA = 0.2
MIN_PROMPT_TOKENS = 64
_MIN_TRANSFER_S = 1e-4  # a pull faster than its configured fixed cost: bandwidth from this floor


class MeasuredPullCost:
    def __init__(self, configured: PullCost) -> None:
        self.configured = configured
        self._lock = threading.Lock()
        self._link_bytes_per_s = configured.link_bytes_per_s
        self._recompute_tokens_per_s = configured.recompute_tokens_per_s
        self.num_link_samples = 0
        self.num_prompt_samples = 0

    def current(self) -> PullCost:
        with self._lock:
            return replace(self.configured, link_bytes_per_s=self._link_bytes_per_s,
                           recompute_tokens_per_s=self._recompute_tokens_per_s)

    def observe_pull(self, num_bytes: int, elapsed_s: float) -> None:
        """A pull that moved `num_bytes` in `elapsed_s` (the whole call, as the router saw it)."""
        if num_bytes <= 0 or elapsed_s <= 0:
            return
        rate = num_bytes / max(elapsed_s - self.configured.setup_s, _MIN_TRANSFER_S)
        with self._lock:
            self._link_bytes_per_s += ALPHA * (rate - self._link_bytes_per_s)
            self.num_link_samples += 1

    def observe_prompt(self, num_tokens: int, compute_s: float) -> None:
        """A prefill that computed `num_tokens` prompt tokens in `compute_s`."""
        if num_tokens < MIN_PROMPT_TOKENS or compute_s <= 0:
            return
        rate = num_tokens / compute_s
        with self._lock:
            self._recompute_tokens_per_s += ALPHA * (rate - self._recompute_tokens_per_s)
            self.num_prompt_samples += 1

    @property
    def link_bytes_per_s(self) -> float:
        return self._link_bytes_per_s

    @property
    def recompute_tokens_per_s(self) -> float:
        return self._recompute_tokens_per_s

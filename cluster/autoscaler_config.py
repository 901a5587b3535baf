"""The `autoscaler:` section of the cluster YAML: off by default.

    autoscaler:
      enabled: true
      ttft_p99_ms: 2000     # the targets: time to first token and inter-token latency, p99
      itl_p99_ms: 200
      max_queue: 4          # waiting requests per instance before its pool grows
      min_decode: 1
      max_decode: 4
      min_prefill: 0
      max_prefill: 2
      interval_s: 5         # how often it looks (the p99s are over this window)
      cooldown_s: 30        # after a change, none for this long
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm_cluster.engine.config import build_section, check_types
from vllm_cluster.engine.errors import ConfigError


@dataclass(slots=True)
class AutoscalerConfig:
    enabled: bool = False
    ttft_p99_ms: float = 2000.0
    itl_p99_ms: float = 200.0
    max_queue: int = 4
    min_prefill: int = 0
    max_prefill: int = 2
    min_decode: int = 1
    max_decode: int = 4
    interval_s: float = 5.0
    cooldown_s: float = 30.0

    def validate(self) -> None:
        for key in ("ttft_p99_ms", "itl_p99_ms", "interval_s"):
            if getattr(self, key) <= 0:
                raise ConfigError(f"autoscaler.{key}: {getattr(self, key)} must be > 0")
        if self.cooldown_s < 0:
            raise ConfigError(f"autoscaler.cooldown_s: {self.cooldown_s} must be >= 0 (0: no pause after a change)")
        if self.max_queue < 0:
            raise ConfigError(f"autoscaler.max_queue: {self.max_queue} must be >= 0 (waiting requests per instance)")
        if self.min_decode < 1:
            raise ConfigError(f"autoscaler.min_decode: {self.min_decode} must be >= 1 (a cluster needs a decode "
                              "instance)")
        if self.min_prefill < 0:
            raise ConfigError(f"autoscaler.min_prefill: {self.min_prefill} must be >= 0")
        for pool in ("prefill", "decode"):
            low, high = getattr(self, f"min_{pool}"), getattr(self, f"max_{pool}")
            if high < low:
                raise ConfigError(f"autoscaler.max_{pool}: {high} is below autoscaler.min_{pool} ({low}): raise "
                                  f"max_{pool} or lower min_{pool}")

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> AutoscalerConfig:
        config: AutoscalerConfig = build_section(cls, "autoscaler", data)
        check_types(config, "autoscaler.")
        config.validate()
        return config

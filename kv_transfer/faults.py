"""Fault injection on the KV wire, for tests and soak runs: off unless configured, e.g.
`configure("corrupt=0.2,drop=0.1,delay_ms=50,seed=1")` (workers: `--kv-faults`; the
cluster YAML: `cluster.kv_faults`, given to the prefill instances, which send).

  corrupt   probability that a chunk's bytes are altered after its checksum is taken
            (the receiver must detect it and fail the transfer)
  drop      probability that a chunk is never sent (the receiver's transfer never
            completes: decode gives up after its transfer timeout)
  delay_ms  added before each push of a layer's chunks

Counts of what was injected are kept in `INJECTED`.
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from dataclasses import dataclass

import torch

INJECTED: Counter[str] = Counter()


@dataclass(frozen=True, slots=True)
class Faults:
    corrupt: float = 0.0
    drop: float = 0.0
    delay_ms: float = 0.0
    seed: int = 0

    @classmethod
    def parse(cls, spec: str) -> Faults:
        values: dict[str, float] = {}
        for item in filter(None, (part.strip() for part in spec.split(","))):
            name, _, value = item.partition("=")
            if name not in ("corrupt", "drop", "delay_ms", "seed"):
                raise ValueError(f"kv faults: unknown fault {name!r}; use corrupt, drop, delay_ms, seed")
            values[name] = float(value)
        faults = cls(values.get("corrupt", 0.0), values.get("drop", 0.0), values.get("delay_ms", 0.0),
                     int(values.get("seed", 0)))
        if not (0 <= faults.corrupt <= 1 and 0 <= faults.drop <= 1 and faults.delay_ms >= 0):
            raise ValueError(f"kv faults: probabilities must be in [0, 1] and delay_ms >= 0, got {spec!r}")
        return faults


_lock = threading.Lock()
_state: tuple[Faults, random.Random] | None = None


def configure(spec: str) -> None:
    """Inject the faults `spec` describes from now on ("" : none). Raises ValueError."""
    global _state
    with _lock:
        if not spec:
            _state = None
            return
        faults = Faults.parse(spec)
        _state = (faults, random.Random(faults.seed))


def active() -> tuple[Faults, random.Random] | None:
    """The configured faults and their RNG, or None (the normal case)."""
    return _state


def corrupted(payload: torch.Tensor, rng: random.Random) -> torch.Tensor:
    """A copy of `payload` with one byte flipped."""
    copy = payload.clone()
    flat = copy.view(-1).view(torch.uint8)
    index = rng.randrange(flat.numel())
    flat[index] = flat[index] ^ 0xFF
    return copy


def delay(faults: Faults) -> None:
    if faults.delay_ms > 0:
        INJECTED["delay"] += 1
        time.sleep(faults.delay_ms / 1e3)

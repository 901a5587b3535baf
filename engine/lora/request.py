"""How a request names its adapter (vLLM's LoRARequest) and how that enters block hashes."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LoRARequest:
    """`LoRARequest("sql", 1, "/adapters/sql")`: the adapter named lora_name, loaded from
    the PEFT directory lora_path on first use. Adapters are told apart by name."""

    lora_name: str
    lora_int_id: int
    lora_path: str


def lora_extra_key(lora_name: str) -> str:
    """The block-hash extra key of an adapter: the same prompt under two adapters (or under
    an adapter and the base model) never shares cached blocks. The router computes the same."""
    return f"lora:{lora_name}"

"""Which adapters are loaded, which are resident, and each step's per-token slots.

Registered adapters (`add`) stay on the host. At most `max_loras` are resident, one per
slot of every LoRALinear. The scheduler `acquire`s an adapter's slot when it admits a
request and `release`s it when the request finishes or is preempted; an adapter no
running request holds may be swapped out, least recently used first. When every slot is
held, `acquire` says no and the request waits. `prepare_step` fills the token-slot buffer
that every LoRALinear (and every CUDA graph) reads.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from vllm_cluster.engine.config import LoRAConfig
from vllm_cluster.engine.lora.adapter import LoRAAdapter, LoRAAdapterError
from vllm_cluster.engine.lora.layers import LoRAContext, LoRALinear, apply_lora
from vllm_cluster.engine.models import CausalLM
from vllm_cluster.engine.request import RequestId
from vllm_cluster.engine.scheduler_output import ScheduledRequest
from vllm_cluster.kernels.lora.dispatch import SlotGroups


class LoRAManager:
    def __init__(
        self, config: LoRAConfig, model: CausalLM, dtype: torch.dtype, device: torch.device, max_num_tokens: int
    ) -> None:
        self.max_loras = config.max_loras
        self.max_rank = config.max_lora_rank
        slots = torch.full((max_num_tokens,), -1, dtype=torch.long, device=device)
        self.context = LoRAContext(token_slots=slots)
        self.targets: dict[tuple[int, str], tuple[LoRALinear, int]] = apply_lora(
            model, self.context, config.max_loras, config.max_lora_rank, dtype
        )
        self.adapters: dict[str, LoRAAdapter] = {}
        self.resident: OrderedDict[str, int] = OrderedDict()  # name -> slot, least recent first
        self._holders: dict[RequestId, str] = {}
        self.num_swaps = 0

    def add(self, adapter: LoRAAdapter) -> None:
        missing = sorted({module for _, module in adapter.weights} - {module for _, module in self.targets})
        if missing:
            raise LoRAAdapterError(f"LoRA adapter {adapter.name!r} adapts {missing}, which this model does not have")
        self.adapters[adapter.name] = adapter

    def remove(self, name: str) -> None:
        """Forget an adapter; refused while a running request holds it."""
        held = sum(1 for n in self._holders.values() if n == name)
        if held:
            raise LoRAAdapterError(
                f"LoRA adapter {name!r} is in use by {held} running requests: retry when they finish"
            )
        self.adapters.pop(name, None)
        slot = self.resident.pop(name, None)
        if slot is not None:
            self._write(slot, None)

    @property
    def resident_names(self) -> list[str]:
        return list(self.resident)

    def acquire(self, request_id: RequestId, name: str) -> bool:
        """Make `name` resident for this request; False when every slot is held by others."""
        assert name in self.adapters, f"LoRA adapter {name!r} is not loaded"
        if name not in self.resident:
            slot = self._free_slot()
            if slot is None:
                return False
            self._write(slot, self.adapters[name])
            self.resident[name] = slot
        self.resident.move_to_end(name)
        self._holders[request_id] = name
        return True

    def release(self, request_id: RequestId) -> None:
        self._holders.pop(request_id, None)

    def slot_of(self, request_id: RequestId) -> int:
        name = self._holders.get(request_id)
        return -1 if name is None else self.resident[name]

    def _free_slot(self) -> int | None:
        used = set(self.resident.values())
        for slot in range(self.max_loras):
            if slot not in used:
                return slot
        held = set(self._holders.values())
        for name in self.resident:  # least recently used first
            if name not in held:
                self.num_swaps += 1
                return self.resident.pop(name)
        return None

    def _write(self, slot: int, adapter: LoRAAdapter | None) -> None:
        for key, (linear, part) in self.targets.items():
            pair = adapter.weights.get(key) if adapter is not None else None
            a, b = pair if pair is not None else (None, None)
            linear.write_slot(slot, part, a, b, adapter.scale if adapter is not None else 0.0)

    def prepare_step(self, scheduled: list[ScheduledRequest]) -> None:
        """Fill the token-slot buffer for this step's flattened tokens (-1 past them).

        A fresh host tensor each step: with async scheduling the previous step's copy may
        still be queued when this one is prepared, so a reused staging buffer would race."""
        host = torch.full_like(self.context.token_slots, -1, device="cpu")
        start = 0
        for item in scheduled:
            end = start + len(item.token_ids)
            if item.lora_slot >= 0:
                host[start:end] = item.lora_slot
            start = end
        self.context.active = any(item.lora_slot >= 0 for item in scheduled)
        self.context.token_slots.copy_(host, non_blocking=True)
        # On CUDA the Triton kernels serve eager steps too: one grouped matmul per
        # adapter and linear cost 4x their time on an H200 at 16 adapters (docs/benchmarks.md).
        on_cpu = self.context.token_slots.device.type == "cpu"
        self.context.groups = self._groups(scheduled, start) if self.context.active and on_cpu else None

    def _groups(self, scheduled: list[ScheduledRequest], num_tokens: int) -> SlotGroups:
        """Token indices per slot (None: every token), for the eager path."""
        tokens: dict[int, list[int]] = {}
        start = 0
        for item in scheduled:
            end = start + len(item.token_ids)
            if item.lora_slot >= 0:
                tokens.setdefault(item.lora_slot, []).extend(range(start, end))
            start = end
        device = self.context.token_slots.device
        return [(slot, None if len(ids) == num_tokens else torch.tensor(ids, device=device))
                for slot, ids in tokens.items()]

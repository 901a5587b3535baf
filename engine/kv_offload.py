"""KV offloading: the device prefix cache spills to a host-memory tier, and that to a disk tier.

Lifecycle of a block's KV:
  1. Computed into a device block and cached under its hash (engine/block_pool.py).
  2. Evicted from the device cache (its block is about to be reused): `on_evict` copies it
     to the host tier, before the new owner can write the block (the copy is queued on the
     device's stream ahead of any later step). A hash already in the host tier is only
     touched: a tier's copy of a hash never goes stale, the hash names the content.
  3. Evicted from the host tier to make room: written to the disk tier if there is one,
     else dropped. The disk tier evicts its own LRU file the same way.
  4. A later prompt whose prefix runs past the device cache into the tiers: `load` copies
     the blocks (host first, then disk, in prompt order) into freshly allocated device
     blocks, which then join the device cache (engine/kv_cache_manager.py). The tiers keep
     their copies (inclusive caches), so evicting such a block again costs no copy.

Copy-out on eviction rather than write-through on store: only blocks actually leaving the
device are copied, once each, and a block that lives and dies on the device costs nothing.
Every tier is LRU and sees blocks in the device cache's eviction order (tail-first).

Invariants:
  - The tiers' contents are sets of hashes, each with the KV its hash names.
  - A load is a prefix: it stops at the first hash that is in no tier or fails to load
    (a corrupt or missing file), and the caller recomputes from there.
  - On CUDA a copy to the host gathers its blocks on the current stream, in order with the
    steps, and crosses to the host on a copy stream of its own (overlapping a load queued
    after it); a load from a host slot still being written waits for that copy. A read of host
    memory on the CPU (a disk write) first waits for the copies into it.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from vllm_cluster.engine.block_hash import BlockHash
from vllm_cluster.engine.errors import ConfigError
from vllm_cluster.engine.kv_tiers import DiskTier, HostTier

# Device memory that gathered blocks may hold while their copy to the host is in flight.
_MAX_STAGED_BYTES = 512 << 20


class Tier(str, enum.Enum):
    """Where an instance holds a block, fastest first (the index and the router use these)."""

    DEVICE = "device"
    HOST = "host"
    DISK = "disk"


@dataclass(slots=True)
class TierStats:
    """One tier's counters since start (vLLM's KV offloading metrics, per tier)."""

    num_stored_blocks: int = 0
    num_stored_bytes: int = 0
    num_hit_blocks: int = 0  # found here by a prefix lookup and loaded to the device
    num_loaded_bytes: int = 0
    num_failed_loads: int = 0  # found here but unreadable: recomputed
    load_time_s: float = 0.0
    num_evicted_blocks: int = 0
    num_blocks: int = 0  # held now (filled in by `snapshot`)
    max_num_blocks: int = 0  # capacity


@dataclass(slots=True)
class DiskTierConfig:
    directory: str | Path
    num_blocks: int


TierEvent = Callable[[Tier, bool, list[BlockHash]], None]  # (tier, stored?, hashes)


@dataclass(slots=True, frozen=True)
class _Staged:
    done: torch.cuda.Event
    num_bytes: int
    slots: frozenset[int]


@dataclass(slots=True)
class _Pending:
    block_ids: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    hashes: list[BlockHash] = field(default_factory=list)


class KVOffload:
    def __init__(self, kv_caches: list[torch.Tensor], num_host_blocks: int, disk: DiskTierConfig | None = None) -> None:
        """`kv_caches`: the device cache, one tensor per layer [num_blocks, 2, block_size, heads, head_dim]."""
        assert kv_caches
        self.kv_caches = kv_caches
        self.device = kv_caches[0].device
        on_cuda = self.device.type == "cuda"
        block_shape = tuple(kv_caches[0].shape[1:])
        self.host = HostTier(num_host_blocks, block_shape, kv_caches[0].dtype, len(kv_caches), pin=on_cuda)
        self.disk = None if disk is None else DiskTier(disk.directory, disk.num_blocks)
        self.block_bytes = sum(c[0].numel() * c.element_size() for c in kv_caches)
        self.stats = {Tier.HOST: TierStats(), Tier.DISK: TierStats()}
        self.on_event: TierEvent | None = None  # the prefix index's feed
        # On CUDA the copies to the host run on a stream of their own: the device-to-host
        # transfer overlaps the step and any host-to-device load queued after it.
        self._copy_stream = torch.cuda.Stream(self.device) if on_cuda else None
        self._copy_event: torch.cuda.Event | None = None
        self._staged: list[_Staged] = []  # copies to the host in flight, oldest first

    # -- device -> tiers -----------------------------------------------------------------

    def on_evict(self, block_ids: Sequence[int], block_hashes: Sequence[BlockHash]) -> None:
        """The device cache drops these cached blocks (oldest first); save them before reuse."""
        num_stored = num_removed = 0
        pending = _Pending()
        for block_id, block_hash in zip(block_ids, block_hashes, strict=True):
            if block_hash in self.host:
                self.host.touch(block_hash)
                continue
            if len(pending.slots) == self.host.num_blocks:  # the next slot may be one queued here
                self._copy_out(pending)
                pending = _Pending()
            slot, evicted = self.host.reserve(block_hash)
            if evicted is not None:
                num_removed += 1
                self._emit(Tier.HOST, False, [evicted[0]])  # events in order: a hash may come and go
                self._spill(*evicted)
            pending.block_ids.append(block_id)
            pending.slots.append(slot)
            pending.hashes.append(block_hash)
            num_stored += 1
            self._emit(Tier.HOST, True, [block_hash])
        self._copy_out(pending)
        host = self.stats[Tier.HOST]
        host.num_stored_blocks += num_stored
        host.num_stored_bytes += num_stored * self.block_bytes
        host.num_evicted_blocks += num_removed

    def _spill(self, block_hash: BlockHash, slot: int) -> None:
        """The host tier evicts `block_hash` from `slot`: move it to the disk tier, if any."""
        if self.disk is None:
            return
        if block_hash in self.disk:
            self.disk.touch(block_hash)
            return
        self.sync()  # the slot's data may still be in flight from the device
        evicted, ok = self.disk.store(block_hash, self.host.block(slot))
        disk = self.stats[Tier.DISK]
        if evicted is not None:
            disk.num_evicted_blocks += 1
            self._emit(Tier.DISK, False, [evicted])
        if ok:
            disk.num_stored_blocks += 1
            disk.num_stored_bytes += self.block_bytes
            self._emit(Tier.DISK, True, [block_hash])

    def _copy_out(self, pending: _Pending) -> None:
        if not pending.slots:
            return
        self._prompt_order(pending)
        if self._copy_stream is None:  # CPU: plain synchronous copies
            ids = torch.tensor(pending.block_ids)
            for cache, buffer in zip(self._bytes(self.kv_caches), self._bytes(self.host.buffers), strict=True):
                _scatter_runs(cache.index_select(0, ids), buffer, pending.slots)
            return
        # The blocks are gathered on the compute stream (device to device, in order before any
        # later write to them), then sent to the host from that copy on the copy stream. At
        # most _MAX_STAGED_BYTES of gathered copies wait there; past that the compute stream
        # waits for the oldest.
        compute = torch.cuda.current_stream(self.device)
        chunk = max(1, _MAX_STAGED_BYTES // 2 // self.block_bytes)
        for start in range(0, len(pending.slots), chunk):
            block_ids, slots = pending.block_ids[start : start + chunk], pending.slots[start : start + chunk]
            self._bound_staging(compute, len(block_ids) * self.block_bytes)
            ids = self._device_index(block_ids)
            staged = [cache.index_select(0, ids) for cache in self._bytes(self.kv_caches)]
            self._copy_stream.wait_stream(compute)
            with torch.cuda.stream(self._copy_stream):
                for staging, buffer in zip(staged, self._bytes(self.host.buffers), strict=True):
                    _scatter_runs(staging, buffer, slots)
                    staging.record_stream(self._copy_stream)  # kept until the copy is done
                event = torch.cuda.Event()
                event.record()
            self._staged.append(_Staged(event, len(block_ids) * self.block_bytes, frozenset(slots)))
            self._copy_event = event

    def _prompt_order(self, pending: _Pending) -> None:
        """Hand the batch's slots out again, ascending against eviction order, and leave the
        batch in that order (consecutive slots copy as one piece). A request's blocks leave
        the device tail first, so its prefix lands in ascending slots, as its device blocks
        are when it comes back: a run of both then loads as one copy. The tier's LRU order
        stays the eviction order."""
        pending.slots = sorted(pending.slots)
        pending.block_ids.reverse()
        pending.hashes.reverse()
        for block_hash, slot in zip(pending.hashes, pending.slots, strict=True):
            self.host.assign(block_hash, slot)

    def _bound_staging(self, compute: torch.cuda.Stream, incoming: int) -> None:
        """Make the compute stream wait for the oldest copies until `incoming` more bytes fit."""
        self._staged = [staged for staged in self._staged if not staged.done.query()]
        while self._staged and sum(staged.num_bytes for staged in self._staged) + incoming > _MAX_STAGED_BYTES:
            compute.wait_event(self._staged.pop(0).done)

    def _await_slots(self, slots: list[int]) -> None:
        """Make the compute stream wait for the copies still writing any of these host slots."""
        wanted = set(slots)
        compute = torch.cuda.current_stream(self.device)
        for staged in self._staged:
            if not staged.slots.isdisjoint(wanted):
                compute.wait_event(staged.done)

    def _device_index(self, block_ids: list[int]) -> torch.Tensor:
        """Block ids on the device without a host sync (from pinned memory, asynchronously)."""
        return torch.tensor(block_ids, dtype=torch.long, pin_memory=True).to(self.device, non_blocking=True)

    def sync(self) -> None:
        """Wait for the copies queued so far (before the CPU reads host memory, or before
        anything outside the device's stream writes a block just evicted)."""
        if self._copy_event is not None:
            self._copy_event.synchronize()
            self._copy_event = None
            self._staged.clear()

    # -- tiers -> device -----------------------------------------------------------------

    def find(self, block_hashes: list[BlockHash]) -> list[Tier]:
        """The tier of each leading hash held below the device (stops at the first miss)."""
        tiers = []
        for block_hash in block_hashes:
            if block_hash in self.host:
                tiers.append(Tier.HOST)
            elif self.disk is not None and block_hash in self.disk:
                tiers.append(Tier.DISK)
            else:
                break
        return tiers

    def load(self, block_hashes: list[BlockHash], block_ids: list[int]) -> list[Tier]:
        """Copy the leading `block_hashes` found in the tiers into device blocks `block_ids`;
        the tiers they came from, one per block loaded (a prefix of the hashes)."""
        tiers = self.find(block_hashes[: len(block_ids)])
        host_ids: list[int] = []
        host_slots: list[int] = []
        loaded: list[Tier] = []
        disk_time_s = 0.0
        for block_hash, block_id, tier in zip(block_hashes, block_ids, tiers, strict=False):
            if tier is Tier.HOST:
                host_ids.append(block_id)
                host_slots.append(self.host.slot(block_hash))
                self.host.touch(block_hash)
            else:
                disk_start = time.perf_counter()
                ok = self._load_from_disk(block_hash, block_id)
                disk_time_s += time.perf_counter() - disk_start
                if not ok:
                    break
            loaded.append(tier)
        start = time.perf_counter()
        self._copy_in(host_slots, host_ids)
        self._count_load(Tier.HOST, len(host_ids), time.perf_counter() - start)
        self._count_load(Tier.DISK, len(loaded) - len(host_ids), disk_time_s)
        return loaded

    def _load_from_disk(self, block_hash: BlockHash, block_id: int) -> bool:
        assert self.disk is not None
        layers = self.disk.load(block_hash, self.host.block(0))
        if layers is None:
            self.stats[Tier.DISK].num_failed_loads += 1
            self._emit(Tier.DISK, False, [block_hash])
            return False
        for cache, layer in zip(self._bytes(self.kv_caches), self._bytes(layers), strict=True):
            cache[block_id].copy_(layer)
        return True

    def _copy_in(self, slots: list[int], block_ids: list[int]) -> None:
        if not slots:
            return
        order = sorted(range(len(slots)), key=lambda i: slots[i])
        slots = [slots[i] for i in order]
        sorted_ids = [block_ids[i] for i in order]
        if self._copy_stream is not None:
            self._await_slots(slots)  # a block evicted moments ago may still be on its way here
        runs = _joint_runs(slots, sorted_ids)
        caches, buffers = self._bytes(self.kv_caches), self._bytes(self.host.buffers)
        if len(runs) * 8 <= len(slots):  # long runs: straight into the device blocks
            for cache, buffer in zip(caches, buffers, strict=True):
                for slot, block_id, n in runs:
                    cache[block_id : block_id + n].copy_(buffer[slot : slot + n], non_blocking=True)
            return
        # Scattered: each slot run into a staging tensor, then one scatter into the blocks.
        ids = torch.tensor(sorted_ids) if self._copy_stream is None else self._device_index(sorted_ids)
        for cache, buffer in zip(caches, buffers, strict=True):
            staging = torch.empty((len(slots), *cache.shape[1:]), dtype=cache.dtype, device=self.device)
            for start, end, slot in _runs(slots):
                staging[start:end].copy_(buffer[slot : slot + end - start], non_blocking=True)
            cache.index_copy_(0, ids, staging)

    @staticmethod
    def _bytes(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """The tensors viewed as bytes: every copy kernel has a uint8 version (not so fp8)."""
        return [t.view(torch.uint8) for t in tensors]

    def _count_load(self, tier: Tier, num_blocks: int, elapsed_s: float) -> None:
        stats = self.stats[tier]
        stats.num_hit_blocks += num_blocks
        stats.num_loaded_bytes += num_blocks * self.block_bytes
        stats.load_time_s += elapsed_s

    # -- the whole ------------------------------------------------------------------------

    def hashes(self, tier: Tier) -> list[BlockHash]:
        """What `tier` holds, least recently used first (HOST or DISK)."""
        if tier is Tier.HOST:
            return self.host.hashes()
        return [] if self.disk is None else self.disk.hashes()

    def snapshot(self) -> dict[str, TierStats]:
        """Each tier's counters and occupancy now, by tier name (a copy)."""
        out = {}
        for tier, store in ((Tier.HOST, self.host), (Tier.DISK, self.disk)):
            if store is not None:
                out[tier.value] = replace(self.stats[tier], num_blocks=len(store), max_num_blocks=store.num_blocks)
        return out

    def clear(self) -> None:
        """Forget every block in every tier (a prefix-cache reset)."""
        self.sync()
        self._emit(Tier.HOST, False, self.host.clear())
        if self.disk is not None:
            self._emit(Tier.DISK, False, self.disk.clear())

    def _emit(self, tier: Tier, stored: bool, block_hashes: list[BlockHash]) -> None:
        if block_hashes and self.on_event is not None:
            self.on_event(tier, stored, block_hashes)


def _scatter_runs(staged: torch.Tensor, buffer: torch.Tensor, slots: list[int]) -> None:
    """staged[i] -> buffer[slots[i]], one copy per run of consecutive slots."""
    for start, end, slot in _runs(slots):
        buffer[slot : slot + end - start].copy_(staged[start:end], non_blocking=True)


def _joint_runs(slots: list[int], block_ids: list[int]) -> list[tuple[int, int, int]]:
    """Runs where slot and block id both advance by one, as (first slot, first block id, length)."""
    runs: list[tuple[int, int, int]] = []
    for slot, block_id in zip(slots, block_ids, strict=True):
        if runs and runs[-1][0] + runs[-1][2] == slot and runs[-1][1] + runs[-1][2] == block_id:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((slot, block_id, 1))
    return runs


def _runs(slots: list[int]) -> list[tuple[int, int, int]]:
    """Runs of consecutive slots in `slots`, as (start index, end index, first slot)."""
    runs = []
    start = 0
    for i in range(1, len(slots) + 1):
        if i == len(slots) or slots[i] != slots[i - 1] + 1:
            runs.append((start, i, slots[start]))
            start = i
    return runs


def build_offload(
    host_kv_gib: float, disk_kv_dir: str | None, disk_kv_gib: float, kv_caches: list[torch.Tensor]
) -> KVOffload | None:
    """The tiers `cache.host_kv_gib` / `disk_kv_*` ask for over this device cache (None: off)."""
    if host_kv_gib <= 0:
        return None
    block_bytes = sum(c[0].numel() * c.element_size() for c in kv_caches)
    num_host = _num_blocks(host_kv_gib, block_bytes, "host_kv_gib")
    disk = None
    if disk_kv_dir and disk_kv_gib > 0:
        disk = DiskTierConfig(disk_kv_dir, _num_blocks(disk_kv_gib, block_bytes, "disk_kv_gib"))
    return KVOffload(kv_caches, num_host, disk)


def _num_blocks(gib: float, block_bytes: int, knob: str) -> int:
    num_blocks = int(gib * 2**30 / block_bytes + 1e-6)
    if num_blocks < 1:
        raise ConfigError(
            f"cache.{knob}: {gib} GiB holds no KV block of {block_bytes} bytes: raise it to at least "
            f"{block_bytes / 2**30:.6f}, or set 0 to turn the tier off"
        )
    return num_blocks

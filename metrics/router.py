"""The router's metrics, observed in RouterServicer.Generate: every client request once,
whether it came over the gRPC API or through the OpenAI HTTP front (which calls Generate).

Lifecycle of a request's observations (`RequestMetrics`, one per Generate call):
  1. `start_request`: requests in flight +1.
  2. `on_response`, for each streamed response as the router relays it: the first tokens
     give the time to first token; each later message's gap since the previous one gives
     the inter-token latency (a message with k tokens counts k gaps of 1/k of its wait).
     The last response (finish_reason set) carries Usage and Timings: e2e latency, queue
     time (prefill queue + decode queue), token counts, success by finish reason and the
     hand-off figures (KV transfer time, blocks sent, prefill skipped, recomputed).
  3. `end(code)`: in flight -1; a request that never got its last response counts as
     failed, by the gRPC status code it ended with.
Between Reserve and the start of Decode a request also counts in `num_reservations_waiting`.
Series carry `model_name` and role="router": instances export some of the same `vllm:`
names (tokens, successes) under their own role.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from vllm_cluster.metrics import buckets
from vllm_cluster.proto import cluster_pb2 as pb

FINISH_REASONS = ("stop", "length", "abort")
_LABELS = ("model_name", "role")
_DEFAULT_MAX_MODEL_LEN = 131072  # token-count buckets when the context length is not known


class RouterMetrics:
    def __init__(self, model_name: str, max_model_len: int = 0) -> None:
        self.registry = CollectorRegistry()
        self._values = (model_name, "router")
        token_buckets = buckets.build_1_2_5_buckets(max_model_len or _DEFAULT_MAX_MODEL_LEN)
        self.time_to_first_token = self._histogram(
            "vllm:time_to_first_token_seconds", "Time to first token, at the router.", buckets.TTFT_S)
        self.inter_token_latency = self._histogram(
            "vllm:inter_token_latency_seconds", "Time between tokens, as the router relays them.",
            buckets.INTER_TOKEN_S)
        self.e2e_request_latency = self._histogram(
            "vllm:e2e_request_latency_seconds", "Arrival to last token, at the router.",
            buckets.REQUEST_LATENCY_S)
        self.request_queue_time = self._histogram(
            "vllm:request_queue_time_seconds", "Time waiting in the prefill queue plus the decode queue.",
            buckets.REQUEST_LATENCY_S)
        self.request_prompt_tokens = self._histogram(
            "vllm:request_prompt_tokens", "Prompt tokens per finished request.", token_buckets)
        self.request_generation_tokens = self._histogram(
            "vllm:request_generation_tokens", "Generated tokens per finished request.", token_buckets)
        self.prompt_tokens = self._counter("vllm:prompt_tokens", "Prompt tokens of finished requests.")
        self.generation_tokens = self._counter("vllm:generation_tokens", "Tokens generated for finished requests.")
        self._success = Counter("vllm:request_success", "Finished requests, by finish reason.",
                                [*_LABELS, "finished_reason"], registry=self.registry)
        for reason in FINISH_REASONS:
            self._success.labels(*self._values, reason)  # exported from the start, at 0
        self.request_kv_transfer_time = self._histogram(
            "vllm_cluster:request_kv_transfer_seconds",
            "Per request: prefill's first token sampled to all KV landed on decode.", buckets.KV_TRANSFER_S)
        self.kv_blocks_sent = self._counter(
            "vllm_cluster:kv_blocks_sent", "KV blocks (per layer) sent from prefill to decode.")
        self.prefill_skipped = self._counter(
            "vllm_cluster:prefill_skipped", "Requests whose prompt decode computed, skipping prefill by policy.")
        self.requests_recomputed = self._counter(
            "vllm_cluster:requests_recomputed", "Requests decode recomputed after a failed hand-off.")
        self._failure = Counter("vllm_cluster:request_failure", "Requests that failed, by gRPC status code.",
                                [*_LABELS, "code"], registry=self.registry)
        self.num_requests_in_flight = self._gauge(
            "vllm_cluster:num_requests_in_flight", "Requests inside the router's Generate.")
        self.num_reservations_waiting = self._gauge(
            "vllm_cluster:num_reservations_waiting", "Requests holding a decode reservation, Decode not yet started.")

    def watch_pull_cost(self, link_bytes_per_s: Callable[[], float], prompt_tokens_per_s: Callable[[], float]) -> None:
        """The cross-instance pull's cost model as measured (router/pull_cost.py), read at scrape time."""
        self._gauge("vllm_cluster:kv_pull_link_bytes_per_second",
                    "Measured KV bandwidth of cross-instance pulls (starts at router.kv_pull_link_gib_s).",
                    ).set_function(link_bytes_per_s)
        self._gauge("vllm_cluster:kv_pull_recompute_tokens_per_second",
                    "Measured prompt tokens per second of prefill (starts at router.kv_pull_recompute_tokens_s).",
                    ).set_function(prompt_tokens_per_s)

    def start_request(self, arrival: float) -> RequestMetrics:
        self.num_requests_in_flight.inc()
        return RequestMetrics(self, arrival)

    def count_success(self, finish_reason: str) -> None:
        self._success.labels(*self._values, finish_reason).inc()

    def count_failure(self, code: str) -> None:
        self._failure.labels(*self._values, code).inc()

    def _histogram(self, name: str, doc: str, bounds: list[float] | list[int]) -> Histogram:
        return Histogram(name, doc, _LABELS, buckets=bounds, registry=self.registry).labels(*self._values)

    def _counter(self, name: str, doc: str) -> Counter:
        return Counter(name, doc, _LABELS, registry=self.registry).labels(*self._values)

    def _gauge(self, name: str, doc: str) -> Gauge:
        return Gauge(name, doc, _LABELS, registry=self.registry).labels(*self._values)


class RequestMetrics:
    """One request's observations; see the module docstring for when each is made."""

    def __init__(self, metrics: RouterMetrics, arrival: float) -> None:
        self._metrics = metrics
        self._arrival = arrival
        self._last_token_time: float | None = None
        self.finished = False

    def on_response(self, response: pb.GenerateResponse, now: float) -> None:
        m = self._metrics
        num_tokens = len(response.token_ids)
        if num_tokens:
            if self._last_token_time is None:
                # A first message with several tokens delivers them all at the first-token time.
                m.time_to_first_token.observe(now - self._arrival)
            else:
                gap_s = (now - self._last_token_time) / num_tokens
                for _ in range(num_tokens):
                    m.inter_token_latency.observe(gap_s)
            self._last_token_time = now
        if response.finish_reason and not self.finished:
            self._finish(response, now)

    def end(self, code: str) -> None:
        """The call is over; `code`: the gRPC status it ended with (unused when finished)."""
        self._metrics.num_requests_in_flight.dec()
        if not self.finished:
            self._metrics.count_failure(code)

    def _finish(self, response: pb.GenerateResponse, now: float) -> None:
        m = self._metrics
        self.finished = True
        usage, timings = response.usage, response.timings
        m.e2e_request_latency.observe(now - self._arrival)
        m.request_queue_time.observe(timings.prefill_queue_s + timings.decode_queue_s)
        m.request_prompt_tokens.observe(usage.prompt_tokens)
        m.request_generation_tokens.observe(usage.completion_tokens)
        m.prompt_tokens.inc(usage.prompt_tokens)
        m.generation_tokens.inc(usage.completion_tokens)
        m.count_success(response.finish_reason)
        if timings.prefill_skipped:
            m.prefill_skipped.inc()
        else:
            m.request_kv_transfer_time.observe(timings.transfer_s)
        if timings.recomputed:
            m.requests_recomputed.inc()
        m.kv_blocks_sent.inc(timings.num_kv_blocks_sent)

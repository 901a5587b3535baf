"""The router's settings: the `router:` section of the cluster YAML.

It lives below the services so that cluster/ validates a whole YAML file without importing
the router; the router reads the same dataclass.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_cluster.engine.config import build_section
from vllm_cluster.engine.errors import ConfigError
from vllm_cluster.engine.tokenizer import chat_template_text

FAILURE_POLICIES = ("recompute", "fail")
# The routing policies router/policy.py implements (it checks that it implements exactly these).
POLICIES = ("least_loaded", "round_robin", "power_of_two", "prefix_aware")
# The tool-call parsers router/openai/tool_parsers.py implements (its tests check the two agree).
TOOL_CALL_PARSERS = ("hermes", "llama3_json")


@dataclass(slots=True)
class RouterConfig:
    host: str = "127.0.0.1"  # both client listeners; "0.0.0.0" to serve other machines
    port: int = 50051  # the gRPC client API
    http_port: int = 8000  # the OpenAI-compatible HTTP API (and /metrics); 0 picks a free port
    # Clients must send `Authorization: Bearer <key>` (HTTP header or gRPC metadata) on every
    # route but /health. Empty: the VLLM_API_KEY environment variable, else no key.
    api_key: str = ""
    max_request_bytes: int = 16 * 1024 * 1024  # larger HTTP bodies get 413
    # The chat template for chat requests, instead of the tokenizer's own (vLLM's
    # --chat-template): a file's path, or the Jinja text itself.
    chat_template: str = ""
    # Reasoning parser for chat responses (vLLM's --reasoning-parser): "" (none), "deepseek_r1"
    # or "qwen3"; <think> text then goes to `reasoning_content`.
    reasoning_parser: str = ""
    # Tool calling (vLLM's --tool-call-parser and --enable-auto-tool-choice): the parser that
    # takes calls out of the model's text, "" (none), "hermes" (Qwen2.5/Qwen3: <tool_call>
    # JSON) or "llama3_json" (Llama 3.x JSON); and whether requests may leave the choice to the
    # model (tool_choice "auto", the default when tools are sent). "required" and a named
    # function are enforced by structured output and need neither.
    tool_call_parser: str = ""
    enable_auto_tool_choice: bool = False
    # A request's line and headers must be whole this long after its first byte (or after the
    # connection opened), its body this long after the request began; else 408 and close.
    http_header_timeout_s: float = 10.0
    http_body_timeout_s: float = 60.0
    # TLS for both client listeners (PEM files; both or neither). The HTTP front then reaches
    # the gRPC API over an extra plaintext listener on 127.0.0.1.
    tls_certfile: str = ""
    tls_keyfile: str = ""
    policy: str = "least_loaded"  # one of POLICIES
    # Prompts with fewer uncached tokens than this skip prefill: decode computes them.
    min_prefill_tokens: int = 64
    # Send the prefill's first token to the client as soon as the prefill answers, instead of
    # after the decode instance takes the request in (router/first_token.py says when it can).
    early_first_token: bool = True
    on_transfer_failure: str = "recompute"  # or "fail"
    # A decode instance lost mid-stream: replay prompt + tokens so far on another, up to this
    # many times per request (0: the client gets UNAVAILABLE / an error frame instead).
    max_migrations: int = 1
    # Admission control: when every decode instance is full, up to this many requests wait
    # (each up to queue_timeout_s) for room; more are shed at once (RESOURCE_EXHAUSTED / 429).
    max_queued_requests: int = 256
    queue_timeout_s: float = 10.0
    lease_s: float = 30.0  # a reservation's blocks are freed if decoding has not started by then
    transfer_timeout_s: float = 30.0  # how long decode waits for the KV to land
    prefill_timeout_s: float = 300.0  # a Prefill call that takes longer counts as failed
    stats_interval_s: float = 0.5
    drain_grace_s: float = 30.0  # on SIGTERM, how long requests in flight get to finish
    # Prefix-aware routing: the Redis the instances publish their block events to ("" with
    # `vllm-cluster serve`: the embedded one it starts), and the score's weights.
    redis_url: str = ""
    prefix_index_timeout_s: float = 0.05  # a slower lookup routes on load alone
    prefix_weight_overlap: float = 2.0
    prefix_weight_usage: float = 1.0
    prefix_weight_load: float = 1.0
    # Cross-instance KV reuse (docs/kv_tiers.md): a request whose instance lacks a prefix that
    # another instance holds pulls those blocks from it when moving them is cheaper than
    # computing them: blocks x bytes / kv_pull_link_gib_s + kv_pull_setup_s (+ a load for each
    # block the holder keeps in its host or disk tier, priced as prefix-aware routing prices a
    # tier hit) against their tokens at kv_pull_recompute_tokens_s. Needs the prefix index (Redis).
    kv_pull: bool = False
    kv_pull_link_gib_s: float = 1.0
    kv_pull_recompute_tokens_s: float = 2000.0
    kv_pull_setup_s: float = 0.02
    kv_pull_timeout_s: float = 5.0  # the holder's sends; a slower pull pushes nothing

    @property
    def tls(self) -> tuple[Path, Path] | None:
        return (Path(self.tls_certfile), Path(self.tls_keyfile)) if self.tls_certfile else None

    def validate(self) -> None:
        if self.policy not in POLICIES:
            raise ConfigError(f"router.policy: {self.policy!r} is not one of {POLICIES}")
        if self.on_transfer_failure not in FAILURE_POLICIES:
            raise ConfigError(
                f"router.on_transfer_failure: {self.on_transfer_failure!r} is not one of {FAILURE_POLICIES}"
            )
        for name in ("port", "http_port"):
            if not 0 <= getattr(self, name) <= 65535:
                raise ConfigError(f"router.{name} must be a TCP port (0 picks a free one)")
        if bool(self.tls_certfile) != bool(self.tls_keyfile):
            raise ConfigError("router.tls_certfile and router.tls_keyfile go together: set both or neither")
        for name in ("tls_certfile", "tls_keyfile"):
            if getattr(self, name) and not Path(getattr(self, name)).is_file():
                raise ConfigError(f"router.{name}: {getattr(self, name)!r} is not a file")
        if self.chat_template:
            chat_template_text(self.chat_template, "router.chat_template")
        if self.reasoning_parser not in ("", "deepseek_r1", "qwen3"):
            raise ConfigError(f"router.reasoning_parser {self.reasoning_parser!r}: give deepseek_r1, qwen3 or ''")
        if self.tool_call_parser not in ("", *TOOL_CALL_PARSERS):
            raise ConfigError(f"router.tool_call_parser {self.tool_call_parser!r}: give "
                              f"{' or '.join(TOOL_CALL_PARSERS)}, or '' for none")
        if self.enable_auto_tool_choice and not self.tool_call_parser:
            raise ConfigError("router.enable_auto_tool_choice needs router.tool_call_parser: set it to "
                              f"{' or '.join(TOOL_CALL_PARSERS)} (the format your model writes its calls in)")
        if self.max_request_bytes < 1024:
            raise ConfigError("router.max_request_bytes must be >= 1024")
        if self.max_queued_requests < 0:
            raise ConfigError("router.max_queued_requests must be >= 0 (0: shed at once when full)")
        if self.queue_timeout_s < 0:
            raise ConfigError("router.queue_timeout_s must be >= 0")
        if self.max_migrations < 0:
            raise ConfigError("router.max_migrations must be >= 0 (0: no migration)")
        if self.kv_pull_setup_s < 0:
            raise ConfigError("router.kv_pull_setup_s must be >= 0")
        if self.min_prefill_tokens < 0:
            raise ConfigError("router.min_prefill_tokens must be >= 0 (0: always prefill)")
        for name in (
            "drain_grace_s", "lease_s", "transfer_timeout_s", "prefill_timeout_s", "stats_interval_s",
            "prefix_index_timeout_s", "http_header_timeout_s", "http_body_timeout_s", "kv_pull_link_gib_s",
            "kv_pull_recompute_tokens_s", "kv_pull_timeout_s",
        ):
            if getattr(self, name) <= 0:
                raise ConfigError(f"router.{name} must be > 0")

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> RouterConfig:
        config: RouterConfig = build_section(cls, "router", data)
        config.validate()
        return config

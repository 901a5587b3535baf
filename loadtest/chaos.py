"""A chaos run against a live, self-healing cluster (`vllm-cluster up`): a steady load of
greedy requests over gRPC and HTTP while processes die, Redis stalls, and slow, malformed
and bursty clients come and go.

A run, in order:
  1. Reference: each prompt once over each API, before any fault: the answer every later
     request for it must give, token for token.
  2. Steady load: `concurrency` client threads send the prompts in turn, alternating gRPC
     and HTTP, from the first fault to the end of the schedule.
  3. Faults, one every `fault_interval_s`, from a seeded schedule that holds every kind at
     least once: SIGKILL of each process (its actor starts it again), Redis stopped with
     SIGSTOP for a few seconds, a burst of requests at once, slow clients (headers or a body
     dribbled past the server's deadlines) and malformed ones (bytes that are neither HTTP
     nor HTTP/2, a body that is not JSON, a lone surrogate in a prompt).
  4. Recovery: every process SERVING again, each prompt answers its reference again over
     both APIs, and every instance, once idle, has all its KV blocks free.
A request must end: with the reference answer, or with a clean error (a gRPC status other
than UNKNOWN or INTERNAL, an HTTP error other than 500 with an error body that says what
happened, a refused or reset connection while the router restarts). A wrong answer, a 500,
or no answer within `request_timeout_s` is unclean, and so is a slow or malformed client
the server failed to cut off or answered with a 5xx.
"""

from __future__ import annotations

import http.client
import json
import random
import signal
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import Protocol
from urllib.parse import urlsplit

import grpc

from vllm_cluster.client import Client, ClientError
from vllm_cluster.proto import cluster_pb2 as pb

UNCLEAN_GRPC = {"UNKNOWN", "INTERNAL"}
# Plain sentences (a model is sure of its next words there, so greedy answers do not hang
# on rounding), sharing prefixes so the prefix cache and its Redis index are used.
_STORY = ("The lighthouse keeper climbed the stairs at dusk, as he had every evening for thirty years. "
          "Below him the harbor lights came on one by one, and the fishing boats turned for home.")
DEFAULT_PROMPTS = (
    "The capital of France is",
    "The capital of Italy is",
    "List three primary colors:",
    _STORY + " When he reached the top,",
    _STORY + " The storm that night",
    "Water boils at a temperature of",
)
CLIENT_FAULTS = ("burst", "slow_client", "malformed")


class ChaosTarget(Protocol):
    """The cluster under test, by process name ("router", "redis", "prefill-0", ...)."""

    def process_names(self) -> list[str]: ...

    def signal(self, name: str, sig: int) -> None:
        """Signal the process that serves `name` now (the one its watchdog last started)."""

    def recovered(self) -> bool:
        """Every process alive and SERVING."""

    def worker_stats(self) -> dict[str, pb.WorkerStats]:
        """Every prefill and decode instance's Stats, by name."""


@dataclass(frozen=True, slots=True)
class ChaosSettings:
    router_address: str  # gRPC
    http_address: str  # "http://host:port"
    api_key: str = ""
    prompts: tuple[str, ...] = DEFAULT_PROMPTS
    max_tokens: int = 12
    concurrency: int = 6
    num_faults: int = 10
    fault_interval_s: float = 5.0
    redis_pause_s: float = 3.0
    burst_size: int = 40
    slow_client_limit_s: float = 20.0  # the server must have cut a slow client off by then
    request_timeout_s: float = 120.0  # a request with no answer by then hung
    recover_timeout_s: float = 180.0
    seed: int = 0


@dataclass
class ChaosReport:
    faults: list[tuple[float, str]] = field(default_factory=list)  # (seconds into the run, fault)
    outcomes: Counter[str] = field(default_factory=Counter)  # "completed", "grpc UNAVAILABLE", "http 429", ...
    unclean: Counter[str] = field(default_factory=Counter)
    wrong_answers: list[str] = field(default_factory=list)  # what came back instead of the reference
    recovered_after_s: float | None = None  # None: not every process came back
    final_mismatches: list[str] = field(default_factory=list)  # prompts not answered as before the faults
    blocks_in_use: dict[str, int] = field(default_factory=dict)  # per instance, once idle: leaked blocks
    duration_s: float = 0.0

    @property
    def clean(self) -> bool:
        return (not self.unclean and self.recovered_after_s is not None and not self.final_mismatches
                and not self.blocks_in_use)


def schedule(process_names: list[str], num_faults: int, rng: random.Random) -> list[str]:
    """Every kind of fault once (a kill of each process, a Redis stop, each client fault),
    shuffled, then random ones up to `num_faults`."""
    kinds = [f"kill {name}" for name in process_names] + list(CLIENT_FAULTS)
    if "redis" in process_names:
        kinds.append("stop redis")
    faults = rng.sample(kinds, len(kinds))
    return faults + [rng.choice(kinds) for _ in range(num_faults - len(faults))]


class Chaos:
    def __init__(self, target: ChaosTarget, settings: ChaosSettings) -> None:
        assert settings.prompts, "give the prompts the load sends"
        self.target = target
        self.settings = settings
        self.report = ChaosReport()
        self._rng = random.Random(settings.seed)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._reference: dict[tuple[str, int], str] = {}  # the fault-free text
        url = urlsplit(settings.http_address)
        self._http_host, self._http_port = url.hostname or "127.0.0.1", url.port or 80
        self._client = Client(settings.router_address, api_key=settings.api_key or None)

    def run(self) -> ChaosReport:
        for api in ("grpc", "http"):
            for i in range(len(self.settings.prompts)):
                outcome, text = self._send(api, i)
                assert outcome == "completed", f"the fault-free reference over {api} failed: {outcome}"
                self._reference[(api, i)] = text
        start = time.monotonic()
        faults = schedule(self.target.process_names(), self.settings.num_faults, self._rng)
        with ThreadPoolExecutor(self.settings.concurrency + 4) as pool:
            loads = [pool.submit(self._load, i) for i in range(self.settings.concurrency)]
            side = []
            for fault in faults:
                with self._lock:
                    self.report.faults.append((round(time.monotonic() - start, 1), fault))
                side.append(pool.submit(self._inject, fault))
                self._stop.wait(self.settings.fault_interval_s)
            for future in side:
                future.result()
            self._stop.set()
            for future in loads:
                future.result()
        self._recover(start)
        self.report.duration_s = time.monotonic() - start
        self._client.close()
        return self.report

    # -- the load ------------------------------------------------------------------------

    def _load(self, worker: int) -> None:
        rng = random.Random(self.settings.seed * 7919 + worker)
        while not self._stop.is_set():
            api = "grpc" if rng.random() < 0.5 else "http"
            outcome, _ = self._send_checked(api, rng.randrange(len(self.settings.prompts)))
            if outcome != "completed":
                time.sleep(0.2)  # the router may be restarting: do not spin on refusals

    def _send_checked(self, api: str, index: int) -> tuple[str, str]:
        outcome, text = self._send(api, index)
        if outcome == "completed" and text != self._reference[(api, index)]:
            outcome = "wrong answer"
            with self._lock:
                self.report.wrong_answers.append(
                    f"{time.strftime('%H:%M:%S')} prompt {index} over {api}: {text!r}, "
                    f"not {self._reference[(api, index)]!r}"
                )
        clean = outcome == "completed" or not (
            outcome == "wrong answer" or outcome in ("hung", "http 500", "http no error body")
            or outcome.removeprefix("grpc ") in UNCLEAN_GRPC
        )
        self._count(outcome, clean)
        return outcome, text

    def _count(self, outcome: str, clean: bool) -> None:
        with self._lock:
            self.report.outcomes[outcome] += 1
            if not clean:
                self.report.unclean[outcome] += 1

    def _send(self, api: str, index: int) -> tuple[str, str]:
        prompt = self.settings.prompts[index]
        return self._send_grpc(prompt) if api == "grpc" else self._send_http(prompt)

    def _send_grpc(self, prompt: str) -> tuple[str, str]:
        try:
            result = self._client.generate(prompt, max_tokens=self.settings.max_tokens, temperature=0,
                                           ignore_eos=True, timeout_s=self.settings.request_timeout_s)
        except ClientError as e:
            return ("hung" if e.code == grpc.StatusCode.DEADLINE_EXCEEDED else f"grpc {e.code.name}"), ""
        return "completed", result.text

    def _send_http(self, prompt: str) -> tuple[str, str]:
        body = {"prompt": prompt, "max_tokens": self.settings.max_tokens, "temperature": 0, "ignore_eos": True}
        try:
            status, answer = self._post("/v1/completions", json.dumps(body).encode())
        except TimeoutError:
            return "hung", ""
        except OSError:  # refused or reset: the router is restarting
            return "connection refused", ""
        if status != 200:
            try:
                assert json.loads(answer)["error"]["message"]
            except (ValueError, KeyError, TypeError, AssertionError):
                return "http no error body", ""
            return f"http {status}", ""
        return "completed", json.loads(answer)["choices"][0]["text"]

    def _post(self, path: str, body: bytes) -> tuple[int, bytes]:
        connection = http.client.HTTPConnection(self._http_host, self._http_port,
                                                timeout=self.settings.request_timeout_s)
        headers = {"Content-Type": "application/json"}
        if self.settings.api_key:
            headers["Authorization"] = f"Bearer {self.settings.api_key}"
        try:
            connection.request("POST", path, body=body, headers=headers)
            response = connection.getresponse()
            return response.status, response.read()
        finally:
            connection.close()

    # -- the faults ----------------------------------------------------------------------

    def _inject(self, fault: str) -> None:
        kind, _, name = fault.partition(" ")
        if kind == "kill":
            self.target.signal(name, signal.SIGKILL)
        elif kind == "stop":
            self.target.signal(name, signal.SIGSTOP)
            time.sleep(self.settings.redis_pause_s)
            self.target.signal(name, signal.SIGCONT)
        elif not self._front_up():
            self._count(f"{kind}: the router never came back", False)
        elif kind == "burst":
            with ThreadPoolExecutor(self.settings.burst_size) as pool:
                list(pool.map(lambda i: self._send_checked("http", i % len(self.settings.prompts)),
                              range(self.settings.burst_size)))
        elif kind == "slow_client":
            self._count(*self._slow_client())
        else:
            assert kind == "malformed", fault
            for probe in (self._garbage_http, self._garbage_grpc, self._bad_json, self._lone_surrogate):
                self._count(*probe())

    def _front_up(self) -> bool:
        """Wait for the HTTP front (it may be restarting): a client fault is meant for a
        server that is there."""
        deadline = time.monotonic() + self.settings.recover_timeout_s
        while time.monotonic() < deadline:
            try:
                socket.create_connection((self._http_host, self._http_port), timeout=1).close()
                return True
            except OSError:
                time.sleep(0.5)
        return False

    def _slow_client(self) -> tuple[str, bool]:
        """Headers dribbled a byte every 0.2 s, then a body that stops after 10 of its 1,000
        bytes: the server's header and body deadlines must hang up on both."""
        head = (f"POST /v1/completions HTTP/1.1\r\nHost: {self._http_host}\r\n"
                "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n").encode()
        for dribble, stall in ((head, b""), (b"", head + b'{"prompt":')):
            try:
                with socket.create_connection((self._http_host, self._http_port), timeout=2) as sock:
                    sock.sendall(stall)
                    if not _hangs_up(sock, dribble, self.settings.slow_client_limit_s):
                        return "slow client held", False
            except OSError:
                pass  # refused (the router restarting) or cut off: either way not held
        return "slow client cut off", True

    def _garbage_http(self) -> tuple[str, bool]:
        return self._raw(self._http_port, b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03 not http at all\r\n\r\n")

    def _garbage_grpc(self) -> tuple[str, bool]:
        port = int(self.settings.router_address.rpartition(":")[2])
        return self._raw(port, b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes(range(256)) * 4)

    def _raw(self, port: int, data: bytes) -> tuple[str, bool]:
        """Bytes that are no protocol at all: an error status or a closed connection is fine."""
        try:
            with socket.create_connection((self._http_host, port), timeout=5) as sock:
                sock.sendall(data)
                answer = sock.recv(64)
        except OSError:
            return "malformed: closed", True
        server_error = answer.startswith(b"HTTP/1.1 5")
        return ("malformed: 5xx" if server_error else "malformed: refused"), not server_error

    def _bad_json(self) -> tuple[str, bool]:
        return self._refused(b'{"prompt": "hi", "max_tokens": ')

    def _lone_surrogate(self) -> tuple[str, bool]:
        return self._refused(b'{"prompt": "hi \\ud800", "max_tokens": 4}')

    def _refused(self, body: bytes) -> tuple[str, bool]:
        try:
            status, _ = self._post("/v1/completions", body)
        except OSError:
            return "malformed: router down", True
        return f"malformed: http {status}", 400 <= status < 500

    # -- recovery ------------------------------------------------------------------------

    def _recover(self, start: float) -> None:
        deadline = time.monotonic() + self.settings.recover_timeout_s
        while not self.target.recovered():
            if time.monotonic() > deadline:
                return
            time.sleep(1.0)
        self.report.recovered_after_s = round(time.monotonic() - start, 1)
        for api, index in self._reference:
            outcome, text = _until_answered(partial(self._send, api, index), deadline)
            if outcome != "completed" or text != self._reference[(api, index)]:
                self.report.final_mismatches.append(f"prompt {index} over {api}: {outcome}")
        self.report.blocks_in_use = _blocks_in_use_once_idle(self.target.worker_stats, deadline)


def _until_answered(send: Callable[[], tuple[str, str]], deadline: float) -> tuple[str, str]:
    """A restarted router may be SERVING before it has polled its instances: retry the
    refusals of that moment (429, UNAVAILABLE, a refused connection) until the deadline."""
    while True:
        outcome, text = send()
        if outcome == "completed" or time.monotonic() > deadline or outcome in ("wrong answer", "hung"):
            return outcome, text
        time.sleep(0.5)


def _blocks_in_use_once_idle(stats: Callable[[], dict[str, pb.WorkerStats]], deadline: float) -> dict[str, int]:
    """Blocks still held per instance once nothing runs (a reservation whose request died is
    freed when its lease ends): empty when none leaked."""
    while True:
        now = stats()
        idle = all(not (s.num_running or s.num_waiting or s.num_transferring) for s in now.values())
        in_use = {name: s.num_total_blocks - s.num_free_blocks for name, s in now.items()
                  if s.num_free_blocks != s.num_total_blocks}
        if (idle and not in_use) or time.monotonic() > deadline:
            return in_use
        time.sleep(0.5)


def _hangs_up(sock: socket.socket, dribble: bytes, limit_s: float) -> bool:
    """Send `dribble` a byte every 0.2 s, then wait: whether the server hung up (or answered
    and hung up) within `limit_s`."""
    deadline = time.monotonic() + limit_s
    for byte in dribble:
        sock.sendall(bytes([byte]))
        if _answered(sock, 0.2):
            return True
        if time.monotonic() > deadline:
            return False
    return _answered(sock, max(0.001, deadline - time.monotonic()))


def _answered(sock: socket.socket, wait_s: float) -> bool:
    sock.settimeout(wait_s)
    try:
        sock.recv(4096)  # b"": closed; bytes: an error status (then it closes)
    except TimeoutError:
        return False
    except OSError:
        pass  # reset
    return True

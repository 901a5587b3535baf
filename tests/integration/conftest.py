"""Clusters shared by the OpenAI, Anthropic, structured-output and prompt-logprobs tests:
each takes 25-45 s to start on a 2-core machine, and those modules only send requests (a
module that kills or drains an instance starts a cluster of its own). Each module checks
that every block came back after its requests, so a module leaves the cluster as it found it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.openai_support import KEY, start_cluster
from vllm_cluster.cluster.local import LocalCluster

COLOCATED = Path(__file__).with_name("colocated_cluster.yaml")


@pytest.fixture(scope="session")
def openai_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """Router + 1 prefill + 1 decode (openai_cluster.yaml), the API key set."""
    yield from start_cluster(tmp_path_factory, "openai-cluster")


@pytest.fixture(scope="session")
def colocated_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """Router + 1 decode that computes its own prompts (colocated_cluster.yaml), the API key set."""
    local = LocalCluster.from_yaml(COLOCATED)
    local.api_key = KEY
    local.log_dir = tmp_path_factory.mktemp("colocated-cluster")
    with local:
        yield local

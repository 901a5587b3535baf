"""The gRPC client library for the router's client API: `Client(address).generate(...)`.

Used by the `vllm-cluster` CLI, the load-testing harness and users' own programs.
"""

from vllm_cluster.client.client import Client, ClientError, Completion, Stream

__all__ = ["Client", "ClientError", "Completion", "Stream"]

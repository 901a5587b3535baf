"""The router's admin service over real gRPC, served beside the client API as the router
serves it: calls with the cluster token change the pools, calls without it or with another
token are refused, and the client API key opens no admin call (nor the token a client one)."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest

from vllm_cluster.proto import cluster_pb2 as pb
from vllm_cluster.proto import cluster_pb2_grpc as pb_grpc
from vllm_cluster.router.admin import SERVICE_NAME, RouterAdminServicer
from vllm_cluster.router.registry import Registry
from vllm_cluster.worker.rpc import make_channel, make_server

TOKEN = "admin-test-token"
API_KEY = "admin-test-key"


class _Generation(pb_grpc.GenerationServicer):
    def ListModels(self, msg: pb.ListModelsRequest, context: grpc.ServicerContext) -> pb.ListModelsResponse:
        return pb.ListModelsResponse(models=[pb.ModelCard(id="m")])


class _Decode(pb_grpc.DecodeWorkerServicer):
    def Stats(self, request: pb.StatsRequest, context: grpc.ServicerContext) -> pb.WorkerStats:
        return pb.WorkerStats(num_waiting=5, num_running=1)


@pytest.fixture
def router() -> Iterator[tuple[str, str, Registry]]:
    """(router address, a decode instance's address, the router's registry)."""
    decode, decode_port, _ = make_server("127.0.0.1:0", ["vllm_cluster.DecodeWorker"], token=TOKEN)
    pb_grpc.add_DecodeWorkerServicer_to_server(_Decode(), decode)
    decode.start()
    registry = Registry([], [], TOKEN, interval_s=3600)
    server, port, _ = make_server("127.0.0.1:0", ["vllm_cluster.Generation", SERVICE_NAME], token=TOKEN,
                                  api_key=API_KEY, token_services=[SERVICE_NAME])
    pb_grpc.add_GenerationServicer_to_server(_Generation(), server)
    pb_grpc.add_RouterAdminServicer_to_server(RouterAdminServicer(registry), server)
    server.start()
    yield f"127.0.0.1:{port}", f"127.0.0.1:{decode_port}", registry
    server.stop(0)
    registry.close()
    decode.stop(0)


def _code(call: object) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as info:
        call()  # type: ignore[operator]
    return info.value.code()  # type: ignore[attr-defined, no-any-return]


def test_the_token_changes_the_pools(router: tuple[str, str, Registry]) -> None:
    address, decode, registry = router
    with make_channel(address, TOKEN) as channel:
        admin = pb_grpc.RouterAdminStub(channel)
        added = admin.AddInstance(pb.AddInstanceRequest(role="decode", address=decode, name="decode-3"))
        assert (added.name, added.added) == ("decode-3", True)
        registry.poll()
        [info] = admin.ListInstances(pb.ListInstancesRequest()).instances
        assert (info.name, info.role, info.address, info.healthy, info.draining) == (
            "decode-3", "decode", decode, True, False)
        assert (info.num_waiting, info.num_running, info.num_inflight) == (5, 1, 0)
        held = registry.acquire("decode-3")
        removed = admin.RemoveInstance(pb.RemoveInstanceRequest(address=decode))
        assert (removed.found, removed.num_inflight) == (True, 1)
        [info] = admin.ListInstances(pb.ListInstancesRequest()).instances
        assert info.draining and info.num_inflight == 1
        registry.release(held)
        removed = admin.RemoveInstance(pb.RemoveInstanceRequest(address=decode))
        assert (removed.found, removed.num_inflight) == (True, 0)
        assert not admin.ListInstances(pb.ListInstancesRequest()).instances
        bad = pb.AddInstanceRequest(role="router", address=decode)
        assert _code(lambda: admin.AddInstance(bad)) == grpc.StatusCode.INVALID_ARGUMENT
        bad = pb.AddInstanceRequest(role="decode", address="nowhere")
        assert _code(lambda: admin.AddInstance(bad)) == grpc.StatusCode.INVALID_ARGUMENT


def test_no_token_or_another_is_refused(router: tuple[str, str, Registry]) -> None:
    address, decode, registry = router
    add = pb.AddInstanceRequest(role="decode", address=decode)
    for token in (None, "another-token"):
        with make_channel(address, token) as channel:
            admin = pb_grpc.RouterAdminStub(channel)
            assert _code(lambda admin=admin: admin.AddInstance(add)) == grpc.StatusCode.UNAUTHENTICATED
            assert _code(lambda admin=admin: admin.ListInstances(pb.ListInstancesRequest())) == (
                grpc.StatusCode.UNAUTHENTICATED)
    with grpc.insecure_channel(address) as channel:  # the client API key is no admin credential
        admin = pb_grpc.RouterAdminStub(channel)
        call = lambda: admin.AddInstance(add, metadata=[("authorization", f"Bearer {API_KEY}")])  # noqa: E731
        assert _code(call) == grpc.StatusCode.UNAUTHENTICATED
        generation = pb_grpc.GenerationStub(channel)
        models = generation.ListModels(pb.ListModelsRequest(), metadata=[("authorization", f"Bearer {API_KEY}")])
        assert [m.id for m in models.models] == ["m"], "the client API still takes the key alone"
    with make_channel(address, TOKEN) as channel:  # and the cluster token is no client credential
        generation = pb_grpc.GenerationStub(channel)
        assert _code(lambda: generation.ListModels(pb.ListModelsRequest())) == grpc.StatusCode.UNAUTHENTICATED
    assert registry.instances == {}, "nothing was added"


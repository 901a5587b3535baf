"""The router's admin service: the pools change while it serves (`vllm-cluster scale`, the
autoscaler). Its calls carry the cluster token, not the client API key (make_server's
`token_services`).

Lifecycle of an instance through it:
  1. `AddInstance(role, address)` once the instance serves: the registry polls it, and
     routes to it from its first healthy answer.
  2. `RemoveInstance(address)`: no new request goes to it from now on; the answer says how
     many requests of this router are still on it. The caller asks again until 0 (the
     router then forgets it), and only then stops the instance (its SIGTERM drain).
  3. `ListInstances`: every instance, routed or draining, with its health and load (the
     autoscaler's queue depths).
"""

from __future__ import annotations

import grpc

from vllm_cluster.engine.config import EngineRole
from vllm_cluster.proto import cluster_pb2 as pb
from vllm_cluster.proto import cluster_pb2_grpc as pb_grpc
from vllm_cluster.router.registry import Instance, Registry
from vllm_cluster.worker.rpc import abort

SERVICE_NAME = "vllm_cluster.RouterAdmin"
_ROLES = (EngineRole.PREFILL, EngineRole.DECODE)


class RouterAdminServicer(pb_grpc.RouterAdminServicer):
    def __init__(self, registry: Registry) -> None:
        self._registry = registry

    def AddInstance(self, msg: pb.AddInstanceRequest, context: grpc.ServicerContext) -> pb.AddInstanceResponse:
        if msg.role not in _ROLES:
            abort(context, grpc.StatusCode.INVALID_ARGUMENT, f"role {msg.role!r}: give 'prefill' or 'decode'")
        host, _, port = msg.address.rpartition(":")
        if not host or not port.isdigit():
            abort(context, grpc.StatusCode.INVALID_ARGUMENT, f"address {msg.address!r}: give host:port")
        name, added = self._registry.add(EngineRole(msg.role), msg.address, msg.name)
        return pb.AddInstanceResponse(name=name, added=added)

    def RemoveInstance(
        self, msg: pb.RemoveInstanceRequest, context: grpc.ServicerContext
    ) -> pb.RemoveInstanceResponse:
        found, num_inflight = self._registry.remove(msg.address)
        return pb.RemoveInstanceResponse(found=found, num_inflight=num_inflight)

    def ListInstances(self, msg: pb.ListInstancesRequest, context: grpc.ServicerContext) -> pb.ListInstancesResponse:
        routed = [_info(i, draining=False) for i in self._registry.instances.values()]
        return pb.ListInstancesResponse(instances=routed + [_info(i, True) for i in self._registry.draining()])


def _info(instance: Instance, draining: bool) -> pb.InstanceInfo:
    return pb.InstanceInfo(
        name=instance.name, role=instance.role.value, address=instance.address, healthy=instance.healthy,
        draining=draining, num_inflight=instance.num_inflight, num_waiting=instance.stats.num_waiting,
        num_running=instance.stats.num_running,
    )

"""The worker side of LoadLoRAAdapter / UnloadLoRAAdapter, shared by the prefill and decode
servicers: the adapter is read and checked on the engine thread (nothing else touches the
engine core), between steps. A bad adapter fails the call, never the instance."""

from __future__ import annotations

import grpc

from vllm_cluster.engine.engine_loop import EngineLoop
from vllm_cluster.engine.errors import InvalidRequestError
from vllm_cluster.proto import cluster_pb2 as pb
from vllm_cluster.worker.rpc import abort


def load_lora_adapter(
    loop: EngineLoop, msg: pb.LoRAAdapterRequest, context: grpc.ServicerContext
) -> pb.LoRAAdapterResponse:
    if not msg.lora_name or not msg.lora_path:
        abort(context, grpc.StatusCode.INVALID_ARGUMENT, "LoadLoRAAdapter needs lora_name and lora_path")
    try:
        changed = loop.call(lambda core: core.add_lora(msg.lora_name, msg.lora_path))
    except InvalidRequestError as e:
        abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
    return pb.LoRAAdapterResponse(changed=changed)


def unload_lora_adapter(
    loop: EngineLoop, msg: pb.LoRAAdapterRequest, context: grpc.ServicerContext
) -> pb.LoRAAdapterResponse:
    try:
        changed = loop.call(lambda core: core.remove_lora(msg.lora_name))
    except InvalidRequestError as e:
        abort(context, grpc.StatusCode.FAILED_PRECONDITION, str(e))
    return pb.LoRAAdapterResponse(changed=changed)

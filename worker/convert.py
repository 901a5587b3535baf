"""Between protobuf messages and the engine's types. The only place that knows both."""

from __future__ import annotations

import json

from vllm_cluster.engine.config import EngineRole
from vllm_cluster.engine.engine_core import EngineCore, EngineStats
from vllm_cluster.engine.engine_loop import StreamDelta
from vllm_cluster.engine.request import Request, TokenLogprobs
from vllm_cluster.engine.sampling_params import SamplingParams
from vllm_cluster.engine.scheduler import SampledToken
from vllm_cluster.engine.structured_output_params import StructuredOutputsParams
from vllm_cluster.proto import cluster_pb2 as pb


def sampling_params_from_proto(msg: pb.SamplingParams) -> SamplingParams:
    """Raises InvalidRequestError (from SamplingParams) on a bad value."""
    if msg.max_tokens_unlimited:
        max_tokens = None
    else:
        max_tokens = msg.max_tokens if msg.HasField("max_tokens") else 16
    return SamplingParams(
        temperature=msg.temperature if msg.HasField("temperature") else 1.0,
        top_p=msg.top_p if msg.HasField("top_p") else 1.0,
        top_k=msg.top_k,
        min_p=msg.min_p,
        seed=msg.seed if msg.HasField("seed") else None,
        max_tokens=max_tokens,
        min_tokens=msg.min_tokens,
        stop=list(msg.stop),
        stop_token_ids=list(msg.stop_token_ids),
        include_stop_str_in_output=msg.include_stop_str_in_output,
        ignore_eos=msg.ignore_eos,
        logprobs=msg.logprobs if msg.HasField("logprobs") else None,
        prompt_logprobs=msg.prompt_logprobs if msg.HasField("prompt_logprobs") else None,
        presence_penalty=msg.presence_penalty,
        frequency_penalty=msg.frequency_penalty,
        repetition_penalty=msg.repetition_penalty if msg.HasField("repetition_penalty") else 1.0,
        skip_special_tokens=msg.skip_special_tokens if msg.HasField("skip_special_tokens") else True,
        logit_bias=dict(msg.logit_bias) or None,
        allowed_token_ids=list(msg.allowed_token_ids) or None,
        bad_words=list(msg.bad_words),
        bad_words_token_ids=[list(t.ids) for t in msg.bad_words_token_ids],
        truncate_prompt_tokens=msg.truncate_prompt_tokens if msg.HasField("truncate_prompt_tokens") else None,
        structured_outputs=structured_outputs_from_proto(msg),
    )


def sampling_params_to_proto(params: SamplingParams) -> pb.SamplingParams:
    msg = pb.SamplingParams(
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        min_p=params.min_p,
        min_tokens=params.min_tokens,
        stop=params.stop,
        stop_token_ids=params.stop_token_ids,
        include_stop_str_in_output=params.include_stop_str_in_output,
        ignore_eos=params.ignore_eos,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        repetition_penalty=params.repetition_penalty,
        skip_special_tokens=params.skip_special_tokens,
        logit_bias=params.logit_bias or {},
        allowed_token_ids=params.allowed_token_ids or [],
        bad_words=params.bad_words,
        bad_words_token_ids=[pb.TokenIds(ids=ids) for ids in params.bad_words_token_ids],
    )
    if params.truncate_prompt_tokens is not None:
        msg.truncate_prompt_tokens = params.truncate_prompt_tokens
    if params.seed is not None:
        msg.seed = params.seed
    if params.max_tokens is None:
        msg.max_tokens_unlimited = True
    else:
        msg.max_tokens = params.max_tokens
    if params.logprobs is not None:
        msg.logprobs = params.logprobs
    if params.prompt_logprobs is not None:
        msg.prompt_logprobs = params.prompt_logprobs
    if params.structured_outputs is not None:
        msg.structured_outputs.CopyFrom(structured_outputs_to_proto(params.structured_outputs))
    return msg


def structured_outputs_from_proto(msg: pb.SamplingParams) -> StructuredOutputsParams | None:
    """Raises InvalidRequestError when the spec is not exactly one valid schema, regex, ..."""
    if not msg.HasField("structured_outputs"):
        return None
    so = msg.structured_outputs
    return StructuredOutputsParams(
        json=so.json or None, regex=so.regex or None, choice=list(so.choice) or None,
        grammar=so.grammar or None, json_object=so.json_object,
    )


def structured_outputs_to_proto(params: StructuredOutputsParams) -> pb.StructuredOutputs:
    schema = params.json if params.json is None or isinstance(params.json, str) else json.dumps(params.json)
    return pb.StructuredOutputs(
        json=schema or "", regex=params.regex or "", choice=params.choice or [], grammar=params.grammar or "",
        json_object=params.json_object,
    )


def logprob_to_proto(lp: TokenLogprobs) -> pb.TokenLogprob:
    return pb.TokenLogprob(
        token_id=lp.token_id,
        logprob=lp.logprob,
        rank=lp.rank,
        top=[pb.TopLogprob(token_id=t, logprob=v) for t, v in lp.top.items()],
    )


def first_token_to_proto(token_id: int, lp: TokenLogprobs | None) -> pb.TokenLogprob:
    return logprob_to_proto(lp) if lp is not None else pb.TokenLogprob(token_id=token_id)


def sampled_token_from_proto(msg: pb.TokenLogprob, with_logprobs: bool) -> SampledToken:
    logprobs = None
    if with_logprobs:
        logprobs = TokenLogprobs(
            token_id=msg.token_id,
            logprob=msg.logprob,
            rank=msg.rank,
            top={t.token_id: t.logprob for t in msg.top},
        )
    return SampledToken(msg.token_id, logprobs)


def delta_to_proto(request_id: str, delta: StreamDelta) -> pb.GenerateResponse:
    msg = pb.GenerateResponse(
        request_id=request_id,
        token_ids=delta.token_ids,
        text=delta.text,
        logprobs=[logprob_to_proto(lp) for lp in delta.logprobs],
        finish_reason=delta.finish_reason or "",
        stop_reason="" if delta.stop_reason is None else str(delta.stop_reason),
        prompt_logprobs=[logprob_to_proto(lp) for lp in delta.prompt_logprobs or ()],
    )
    if delta.finish_reason is not None:
        msg.usage.CopyFrom(
            pb.Usage(
                prompt_tokens=delta.num_prompt_tokens,
                completion_tokens=delta.num_output_tokens,
                cached_tokens=delta.num_cached_tokens,
            )
        )
    return msg


def request_from_proto(core: EngineCore, msg: pb.WorkerRequest) -> Request:
    """Validate and build; raises InvalidRequestError with what to change."""
    params = sampling_params_from_proto(msg.sampling_params)
    return core.make_request(
        msg.request_id, list(msg.prompt_token_ids), params, tuple(msg.extra_keys), lora_name=msg.lora_name or None,
        priority=msg.priority,
        num_generated_prompt_tokens=msg.sampling_params.structured_outputs.num_generated_prompt_tokens,
    )


def worker_stats_to_proto(
    stats: EngineStats, role: EngineRole, block_size: int, model: str, kv_endpoint: str
) -> pb.WorkerStats:
    return pb.WorkerStats(
        role=role.value,
        num_running=stats.num_running,
        num_waiting=stats.num_waiting,
        num_transferring=stats.num_transferring,
        kv_cache_usage=stats.kv_cache_usage,
        num_free_blocks=stats.num_free_blocks,
        num_total_blocks=stats.num_total_blocks,
        prefix_cache_queries=stats.prefix_cache_queries,
        prefix_cache_hits=stats.prefix_cache_hits,
        block_size=block_size,
        model=model,
        kv_endpoint=kv_endpoint,
        lora_names=list(stats.lora_names),
        lora_resident_names=list(stats.lora_resident_names),
    )

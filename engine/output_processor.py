"""Turns the engine core's token updates into user-facing outputs: incremental text,
stop strings (which finish the request in the core), logprobs, and the fan-in of the n
child requests of a parent."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm_cluster.engine.detokenizer import IncrementalDetokenizer
from vllm_cluster.engine.engine_core import EngineCore
from vllm_cluster.engine.outputs import CompletionOutput, Logprob, RequestOutput
from vllm_cluster.engine.request import Request, TokenLogprobs
from vllm_cluster.engine.scheduler import RequestUpdate


@dataclass(slots=True)
class _Child:
    parent: RequestOutput
    completion: CompletionOutput
    detokenizer: IncrementalDetokenizer | None


class OutputProcessor:
    def __init__(self, core: EngineCore, tokenizer: Any | None) -> None:
        self.core = core
        self.tokenizer = tokenizer
        self._children: dict[str, _Child] = {}

    def add(self, parent: RequestOutput, index: int, request: Request) -> None:
        detok = None
        if self.tokenizer is not None:
            detok = IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids, request.sampling_params)
        completion = CompletionOutput(index=index, text="", token_ids=[])
        if request.sampling_params.logprobs is not None:
            completion.logprobs, completion.cumulative_logprob = [], 0.0
        parent.outputs.append(completion)
        self._children[request.request_id] = _Child(parent, completion, detok)

    def process(self, updates: list[RequestUpdate]) -> list[RequestOutput]:
        """Apply one step's updates; returns the parents that finished in it."""
        finished = []
        for update in updates:
            child = self._children[update.request.request_id]
            if self._apply(child, update) and all(c.finished for c in child.parent.outputs):
                child.parent.finished = True
                finished.append(child.parent)
        return finished

    def _apply(self, child: _Child, update: RequestUpdate) -> bool:
        request, completion = update.request, child.completion
        completion.token_ids.extend(update.new_token_ids)
        if completion.logprobs is not None:
            for lp in request.output_logprobs[len(completion.logprobs) :]:
                completion.logprobs.append(self._logprob_dict(lp))
                completion.cumulative_logprob = (completion.cumulative_logprob or 0.0) + lp.logprob
        child.parent.num_cached_tokens = max(child.parent.num_cached_tokens, request.num_cached_tokens)
        if child.parent.prompt_logprobs is None and request.sampling_params.prompt_logprobs is not None:
            # Complete once the request has a token: its whole prompt was computed.
            prompt = [self._logprob_dict(lp) for lp in request.prompt_logprobs]
            child.parent.prompt_logprobs = [None, *prompt]
        stop = None
        if child.detokenizer is not None:
            stop = child.detokenizer.update(update.new_token_ids)
            completion.text = child.detokenizer.text
        if stop is not None and not update.finished:
            self.core.finish_stopped(request.request_id, stop)
        if stop is not None or update.finished:
            completion.finish_reason = request.status.finish_reason if stop is None else "stop"
            completion.stop_reason = stop if stop is not None else request.stop_reason
            del self._children[request.request_id]
            return True
        return False

    def _logprob_dict(self, lp: TokenLogprobs) -> dict[int, Logprob]:
        out = {lp.token_id: Logprob(lp.logprob, lp.rank, self._decode(lp.token_id))}
        for rank, (token_id, value) in enumerate(lp.top.items(), start=1):
            if token_id not in out:
                out[token_id] = Logprob(value, rank, self._decode(token_id))
        return out

    def _decode(self, token_id: int) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode([token_id])

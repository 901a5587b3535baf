"""The offline API, as vLLM users know it:

    from vllm_cluster.engine import LLM, SamplingParams
    llm = LLM(model="smollm2-135m-instruct", max_num_seqs=16)
    outputs = llm.generate(["Hello, my name is"], SamplingParams(temperature=0, max_tokens=32))
    print(outputs[0].outputs[0].text)
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from tqdm import tqdm

from vllm_cluster.engine.config import EngineConfig
from vllm_cluster.engine.engine_core import EngineCore
from vllm_cluster.engine.errors import InvalidRequestError
from vllm_cluster.engine.lora import LoRARequest
from vllm_cluster.engine.output_processor import OutputProcessor
from vllm_cluster.engine.outputs import RequestOutput
from vllm_cluster.engine.request import Request
from vllm_cluster.engine.sampling_params import SamplingParams
from vllm_cluster.engine.tokenizer import apply_chat_template, encode_bad_words, load_tokenizer

Prompt = str | list[int]
Message = dict[str, str]


class LLM:
    def __init__(self, model: str = "smollm2-135m-instruct", **options: Any) -> None:
        config = options.pop("config", None) or EngineConfig.from_kwargs(model, **options)
        self.core = EngineCore(config)
        path = self.core.source.tokenizer_path
        self.tokenizer = load_tokenizer(path) if path is not None else None
        self._ids = itertools.count()

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLM:
        return cls(config.model.model, config=config)

    def derive(self, **options: Any) -> LLM:
        """A new engine over the same weights and tokenizer, with other cache, scheduler or
        parallel options (`llm.derive(num_blocks=64, max_num_batched_tokens=32)`,
        `llm.derive(tensor_parallel_size=2)`: the new ranks receive these weights)."""
        config = self.core.config.with_overrides(**options)
        if config.model != self.core.config.model or config.device != self.core.config.device:
            raise ValueError("derive() keeps the model: change only cache, scheduler, parallel or thread options")
        if self.core.config.lora.enable_lora or config.lora.enable_lora:
            raise ValueError("derive() shares the model, which LoRA wraps: build a new LLM(..., enable_lora=True)")
        if self.core.config.parallel.world_size > 1:
            raise ValueError("derive() needs the whole model: call it on a single-process LLM, not a parallel one")
        llm = object.__new__(LLM)
        llm.core = EngineCore(config, model=self.core.model)
        llm.core.grammars = self.core.grammars  # the same tokenizer: compiled grammars carry over
        llm.tokenizer = self.tokenizer
        llm._ids = itertools.count()
        return llm

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """`lora_request`: one adapter for every prompt, or one (or None) per prompt.
        `priority`: one per prompt, lower served first (needs scheduling_policy="priority")."""
        prompt_list = _as_prompt_list(prompts)
        params_list = _as_params_list(sampling_params, len(prompt_list))
        token_lists = [self._tokenize(p) for p in prompt_list]
        loras = self._loras(lora_request, len(prompt_list))
        priorities = _priorities(priority, len(prompt_list))
        return self._run(prompt_list, token_lists, params_list, use_tqdm, loras, priorities)

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """`chat_template_kwargs`: extra variables of the template (e.g. enable_thinking)."""
        one = bool(messages) and isinstance(messages[0], dict)
        conversations = [messages] if one else messages
        tokenizer = self._require_tokenizer()
        token_lists = [
            apply_chat_template(tokenizer, list(c), chat_template_kwargs)  # type: ignore[arg-type]
            for c in conversations
        ]
        prompts = [tokenizer.decode(ids) for ids in token_lists]
        params_list = _as_params_list(sampling_params, len(token_lists))
        return self._run(prompts, token_lists, params_list, use_tqdm, self._loras(lora_request, len(token_lists)))

    def _loras(self, lora_request: LoRARequest | Sequence[LoRARequest | None] | None, n: int) -> list[str | None]:
        """The adapter name of each prompt, loading adapters not loaded yet."""
        requests = list(lora_request) if isinstance(lora_request, Sequence) else [lora_request] * n
        if len(requests) != n:
            raise InvalidRequestError(f"got {len(requests)} LoRA requests for {n} prompts: pass one, or one per prompt")
        for request in {r for r in requests if r is not None}:
            self.core.add_lora(request.lora_name, request.lora_path)
        return [None if r is None else r.lora_name for r in requests]

    def _run(
        self,
        prompts: Sequence[Prompt],
        token_lists: list[list[int]],
        params_list: list[SamplingParams],
        use_tqdm: bool,
        lora_names: list[str | None],
        priorities: list[int] | None = None,
    ) -> list[RequestOutput]:
        # Validate everything before adding anything: a bad prompt fails the call, not the engine.
        batch: list[tuple[RequestOutput, list[Request]]] = []
        priorities = priorities or [0] * len(prompts)
        for prompt, token_ids, params, lora, priority in zip(
            prompts, token_lists, params_list, lora_names, priorities, strict=True
        ):
            parent_id = str(next(self._ids))
            if params.bad_words and not params.bad_words_token_ids:
                words = encode_bad_words(self._require_tokenizer(), params.bad_words)
                params = replace(params, bad_words_token_ids=words)
            children = [
                self.core.make_request(
                    f"{parent_id}-{i}" if params.n > 1 else parent_id,
                    token_ids,
                    _child_params(params, i),
                    lora_name=lora,
                    priority=priority,
                )
                for i in range(params.n)
            ]
            text = prompt if isinstance(prompt, str) else None
            batch.append((RequestOutput(parent_id, text, children[0].prompt_token_ids), children))  # truncated
        processor = OutputProcessor(self.core, self.tokenizer)
        for parent, children in batch:
            for index, request in enumerate(children):
                processor.add(parent, index, request)
                self.core.add_request(request)
        bar = tqdm(total=len(batch), desc="Processed prompts", disable=not use_tqdm or len(batch) < 8)
        while self.core.has_unfinished():
            finished = processor.process(self.core.step())
            bar.update(len(finished))
        bar.close()
        return [parent for parent, _ in batch]

    def _tokenize(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            return list(self._require_tokenizer().encode(prompt))
        return list(prompt)

    def _require_tokenizer(self) -> Any:
        if self.tokenizer is None:
            raise InvalidRequestError("this model has no tokenizer (dummy weights?): pass prompts as token id lists")
        return self.tokenizer

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (offload tiers too); False (and nothing done) while requests hold blocks."""
        return self.core.kv.reset_prefix_cache()

    def get_tokenizer(self) -> Any:
        return self.tokenizer


def _child_params(params: SamplingParams, index: int) -> SamplingParams:
    # Children of one parent sample independently; with a seed, reproducibly.
    if params.n == 1:
        return params
    seed = None if params.seed is None else params.seed + index
    return replace(params, n=1, seed=seed)


def _priorities(priority: Sequence[int] | None, n: int) -> list[int] | None:
    if priority is not None and len(priority) != n:
        raise InvalidRequestError(f"got {len(priority)} priorities for {n} prompts: pass one per prompt")
    return None if priority is None else list(priority)


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, list) and prompts and isinstance(prompts[0], int):
        return [prompts]
    result = list(prompts)
    if not result:
        raise InvalidRequestError("no prompts given: pass a string, a token id list, or a list of them")
    return result


def _as_params_list(params: SamplingParams | Sequence[SamplingParams] | None, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    if len(params) != n:
        raise InvalidRequestError(f"got {len(params)} SamplingParams for {n} prompts: pass one, or one per prompt")
    return list(params)

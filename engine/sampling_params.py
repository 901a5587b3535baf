"""Per-request sampling parameters, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm_cluster.engine.errors import InvalidRequestError
from vllm_cluster.engine.structured_output_params import StructuredOutputsParams

_GREEDY_EPS = 1e-5


@dataclass(slots=True)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None  # top-N logprobs per generated token (plus the sampled one)
    # top-N logprobs of every prompt token after the first (plus the token's own); such a
    # request computes its whole prompt, never reading the prefix cache
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    skip_special_tokens: bool = True
    # Logits processors (engine/logits_processors.py), as vLLM's fields of the same names.
    logit_bias: dict[int, float] | None = None  # token id -> bias added to its logit, in [-100, 100]
    allowed_token_ids: list[int] | None = None  # only these may be sampled
    bad_words: list[str] = field(default_factory=list)  # none of these words is ever completed
    # Each bad word's token sequences (with and without a leading space); filled from
    # `bad_words` by whoever holds the tokenizer (LLM, the router): engine/tokenizer.py.
    bad_words_token_ids: list[list[int]] = field(default_factory=list)
    truncate_prompt_tokens: int | None = None  # keep only the last k prompt tokens; -1: max_model_len
    # What the output must match: a JSON schema, regex, choice, grammar or any JSON object.
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        if self.top_k == -1:
            self.top_k = 0
        self._validate()
        self._validate_logits_fields()

    def _validate(self) -> None:
        def bad(message: str) -> InvalidRequestError:
            return InvalidRequestError(message)

        if not isinstance(self.n, int) or self.n < 1:
            raise bad(f"n must be an integer >= 1, got {self.n!r}")
        if not self.temperature >= 0.0:  # also refuses NaN
            raise bad(f"temperature must be >= 0 (0 means greedy), got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise bad(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise bad(f"top_k must be 0 or -1 (disabled) or a positive integer, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad(f"min_p must be in [0, 1], got {self.min_p}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise bad(f"max_tokens must be >= 1 (or None for up to max_model_len), got {self.max_tokens}")
        if self.min_tokens < 0:
            raise bad(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad(f"stop must be a list of non-empty strings, got {self.stop!r}")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise bad(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise bad(f"logprobs must be in [0, 20], got {self.logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= 20:
            raise bad(f"prompt_logprobs must be in [0, 20], got {self.prompt_logprobs}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise bad(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise bad(f"seed must be an integer, got {self.seed!r}")

    def _validate_logits_fields(self) -> None:
        """The vocabulary bounds are checked where the vocabulary is known (EngineCore.make_request)."""
        if self.logit_bias is not None:
            self.logit_bias = dict(self.logit_bias)
            for token_id, bias in self.logit_bias.items():
                if not isinstance(token_id, int) or token_id < 0:
                    raise InvalidRequestError(f"logit_bias keys must be token ids (integers >= 0), got {token_id!r}")
                if not -100.0 <= bias <= 100.0:  # also refuses NaN
                    raise InvalidRequestError(f"logit_bias values must be in [-100, 100], got {bias} for {token_id}")
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
            if not self.allowed_token_ids:
                raise InvalidRequestError("allowed_token_ids is empty: give at least one token id, or leave it unset")
            if any(not isinstance(t, int) or t < 0 for t in self.allowed_token_ids):
                raise InvalidRequestError(f"allowed_token_ids must be token ids >= 0, got {self.allowed_token_ids!r}")
        self.bad_words = list(self.bad_words)
        if any(not isinstance(w, str) or not w.strip() for w in self.bad_words):
            raise InvalidRequestError(f"bad_words must be a list of non-blank strings, got {self.bad_words!r}")
        self.bad_words_token_ids = [list(ids) for ids in self.bad_words_token_ids]
        if any(not ids or min(ids) < 0 for ids in self.bad_words_token_ids):
            raise InvalidRequestError("bad_words_token_ids must be non-empty lists of token ids >= 0")
        k = self.truncate_prompt_tokens
        if k is not None and (not isinstance(k, int) or k == 0 or k < -1):
            raise InvalidRequestError(f"truncate_prompt_tokens must be >= 1, or -1 for max_model_len; got {k!r}")

    @property
    def has_logits_processors(self) -> bool:
        """Uses logit_bias, allowed_token_ids or bad words (engine/logits_processors.py)."""
        return bool(self.logit_bias or self.allowed_token_ids is not None or self.bad_words_token_ids)

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )


def truncate_prompt(prompt_token_ids: list[int], truncate_prompt_tokens: int | None, max_model_len: int) -> list[int]:
    """The last `truncate_prompt_tokens` prompt tokens (-1: max_model_len), as vLLM keeps them."""
    k = truncate_prompt_tokens
    if k is None:
        return prompt_token_ids
    if k > max_model_len:
        raise InvalidRequestError(
            f"truncate_prompt_tokens value ({k}) is greater than max_model_len ({max_model_len}). "
            "Please, select a smaller truncation size."
        )
    return prompt_token_ids[-(max_model_len if k == -1 else k):]

"""Structured output in the engine: grammars compiled once, a matcher per request, and the
token bitmask that keeps each constrained request inside its grammar (xgrammar).

Lifecycle of a constrained request:
  1. `make_request` asks the GrammarCache for a RequestGrammar: the compiled grammar comes
     from the cache (keyed by the spec, shared by every request that names it), the
     matcher is the request's own. The tokenizer is read on the first such request.
  2. Every step that samples it, `apply_grammar_bitmask` fills its row of a host bitmask
     from the matcher and sets the logits of disallowed tokens to -inf, before sampling.
     Requests without a grammar cost one attribute test each.
  3. Every token appended to it (sampled here, or the first token a prefill instance sent
     a decode instance) goes through `accept`; once the grammar is complete the request
     finishes with "stop".

The matcher's state is a function of the output tokens, so a request arriving elsewhere
with tokens already generated (decode after prefill, a migrated request) replays them.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from vllm_cluster.engine.errors import InvalidRequestError
from vllm_cluster.engine.structured_output_params import StructuredOutputsParams

if TYPE_CHECKING:
    from vllm_cluster.engine.request import Request

logger = logging.getLogger(__name__)

MAX_CACHED_GRAMMARS = 256


class RequestGrammar:
    """One request's position in its grammar."""

    def __init__(self, compiled: Any) -> None:
        import xgrammar as xgr

        self._matcher = xgr.GrammarMatcher(compiled)

    def accept(self, token_id: int) -> bool:
        """Advance past `token_id`; False (state unchanged) if the grammar does not allow it."""
        if self._matcher.is_terminated():
            return False
        if not self._matcher.accept_token(token_id):
            logger.warning("token %d is outside the request's grammar; it is kept, the grammar stays put", token_id)
            return False
        return True

    @property
    def is_terminated(self) -> bool:
        return self._matcher.is_terminated()

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, row)


class GrammarCache:
    """Compiled grammars by spec, for one tokenizer (an LRU of MAX_CACHED_GRAMMARS)."""

    def __init__(self, load_tokenizer: Callable[[], Any] | None, vocab_size: int, eos_token_id: int | None) -> None:
        """`load_tokenizer`: the model's HF tokenizer, read on first use; None: the model has none."""
        self._load_tokenizer = load_tokenizer
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self._compiler: Any = None
        self._compiled: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._lock = threading.Lock()  # requests are made on server threads

    @property
    def num_compiled(self) -> int:
        return len(self._compiled)

    def request_grammar(self, params: StructuredOutputsParams, generated: Sequence[int] = ()) -> RequestGrammar:
        """A fresh matcher for `params`, advanced past `generated` (tokens already produced
        under it, e.g. by a prefill or a lost decode instance)."""
        grammar = RequestGrammar(self.compiled(params))
        for token_id in generated:
            if not grammar.accept(token_id):
                raise InvalidRequestError(
                    f"token {token_id} of the tokens already generated does not match structured_outputs.{params.kind}"
                )
        return grammar

    def compiled(self, params: StructuredOutputsParams) -> Any:
        key = params.key
        with self._lock:
            compiled = self._compiled.get(key)
            if compiled is not None:
                self._compiled.move_to_end(key)
                return compiled
            compiled = self._compiler_for_model().compile_grammar(params.xgrammar())
            self._compiled[key] = compiled
            if len(self._compiled) > MAX_CACHED_GRAMMARS:
                self._compiled.popitem(last=False)
            return compiled

    def _compiler_for_model(self) -> Any:
        if self._compiler is None:
            import xgrammar as xgr

            if self._load_tokenizer is None:
                raise InvalidRequestError(
                    "structured output needs the model's tokenizer, and this model has none (dummy weights?)"
                )
            stop_ids = [] if self.eos_token_id is None else [self.eos_token_id]
            info = xgr.TokenizerInfo.from_huggingface(
                self._load_tokenizer(), vocab_size=self.vocab_size, stop_token_ids=stop_ids or None
            )
            self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        return self._compiler


def apply_grammar_bitmask(logits: torch.Tensor, requests: Sequence[Request]) -> None:
    """Set the logits of tokens outside each constrained request's grammar to -inf, in place."""
    # logits: [N, V], one row per request
    rows = [i for i, r in enumerate(requests) if r.grammar is not None]
    if not rows:
        return
    import xgrammar as xgr

    # Rows of unconstrained requests stay all-allowed, and `indices` skips them.
    bitmask = xgr.allocate_token_bitmask(logits.shape[0], logits.shape[1])  # [N, ceil(V / 32)] int32, host
    for i in rows:
        grammar = requests[i].grammar
        assert grammar is not None
        if not grammar.is_terminated:  # ended a step ago (async scheduling): its row stays open, its token is dropped
            grammar.fill_bitmask(bitmask, i)
    if logits.is_cuda:
        bitmask = bitmask.pin_memory().to(logits.device, non_blocking=True)
    xgr.apply_token_bitmask_inplace(logits, bitmask, indices=None if len(rows) == len(requests) else rows)


def warm_mask_kernel(vocab_size: int, device: torch.device, dtype: torch.dtype) -> None:
    """Compile the mask kernel's variants before a constrained batch waits for them. On CUDA,
    xgrammar's Triton kernel is specialized on the row count (1, a multiple of 16, any other)
    and on whether rows are picked by index: compiled mid-serving, they stalled the first
    constrained batch of 64 by about 1.4 s on the H100. Nothing without xgrammar; a failure
    is logged, never raised (the kernels then compile on first use)."""
    try:
        import xgrammar as xgr
    except ImportError:
        return
    try:
        logits = torch.zeros((17, vocab_size), dtype=dtype, device=device)
        bitmask = torch.full((17, (vocab_size + 31) // 32), -1, dtype=torch.int32, device=device)
        for n in (1, 2, 16):
            xgr.apply_token_bitmask_inplace(logits[:n], bitmask[:n])
            xgr.apply_token_bitmask_inplace(logits, bitmask, indices=list(range(n)))
    except Exception as e:  # a warm-up must not stop the engine
        logger.warning("structured output: could not warm the mask kernel up (%s); it compiles on first use", e)

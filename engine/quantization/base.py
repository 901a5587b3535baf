"""The contract every quantization method meets (int8, fp8, gptq, awq).

A method swaps a built model's linear layers (qkv_proj, o_proj, gate_up_proj, down_proj;
lm_head too where the method says so, never the embedding) for its own modules, from outside, as tensor parallelism
does, so model files stay free of quantization code. Two kinds:

- online (int8, fp8): the checkpoint holds ordinary weights; they load into the unquantized
  model first, then `QuantLinear.quantize_from(weight)` converts each layer.
- checkpoint (gptq, awq): the checkpoint holds packed tensors in the format's own layout;
  the swap happens before loading and the loader hands each tensor to
  `QuantLinear.load_shard(param_name, tensor, shard_index)`.

Fused layers (q/k/v into qkv_proj, gate/up into gate_up_proj) are built with
`output_sizes` (e.g. [q, k, v] out features); `shard_index` says which part a checkpoint
tensor fills.

How the rest of the engine drives a module (engine/quantization/__init__.py swaps,
engine/loader loads, engine/models/llama.py delegates):

- `get_method(name, hf_config)` builds the method with `cls.from_hf_config(hf_config)`
  where the class defines it (group size, bits from `quantization_config`), else `cls()`.
- `create_linear(..., dtype, device)`: `dtype` is the model's activation dtype (inputs
  and outputs); the module picks its own storage dtypes.
- online modules also define `quantize_from(weight [out, in], bias [out] | None)`.
- checkpoint modules: `CausalLM.load_weights` maps each checkpoint name as for an
  unquantized model (`...q_proj.qweight` -> module `...qkv_proj`, param_name `qweight`,
  shard_index 0/1/2 for q/k/v, 0/1 for gate/up, 0 for unfused o_proj/down_proj) and calls
  `load_shard`, which raises KeyError for a name it does not know and ValueError for a
  misshapen tensor (the loader turns both into a ModelLoadError naming the tensor).
  After the last tensor the loader calls `finish_loading()` on every such module: it
  raises ValueError naming any part never loaded, and may repack for its kernel.
  With `load_format: dummy` the loader calls `init_dummy(generator)` instead (random
  but valid packed weights; a module without it makes dummy loading refuse the method).
- Every forward must be CUDA-graph capturable: no host syncs, no .item(), no shapes that
  depend on values. Modules keep their tensors as buffers or parameters (moved with
  the model).
- Mixture-of-experts routed experts (stacked, not nn.Linear) have an online path only: the
  online methods also define `quantize_experts(w13, w2)`, a quantized stack that replaces a
  `SparseMoeBlock`'s (engine/quantization/experts.py), and quantize DeepSeek's MLA
  projections but the absorbed kv_b_proj; the checkpoint methods refuse MoE and MLA models
  (swap.check_quantizable). Tensor and pipeline parallelism with quantization are refused by
  the config.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import nn


class QuantLinear(Protocol):
    """A drop-in for nn.Linear: x [T, in_features] -> [T, out_features]."""

    in_features: int
    out_features: int

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...


class QuantMethod(Protocol):
    name: str
    # True: the checkpoint holds this method's packed tensors (gptq, awq).
    quantizes_checkpoint: bool

    @property
    def quantizes_lm_head(self) -> bool:
        """True: lm_head is swapped as well (a GPTQ checkpoint declaring `lm_head: true`; an
        online method built with `quantize_lm_head=True`)."""
        ...

    def check_hf_config(self, hf_config: dict[str, Any]) -> None:
        """Raise ModelLoadError naming the mismatch when the checkpoint's declared format
        (its `quantization_config`) is not this method's, or has unsupported settings."""
        ...

    def create_linear(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        output_sizes: list[int],
        dtype: torch.dtype,
        device: torch.device,
    ) -> nn.Module:
        """An empty module to replace an nn.Linear of these shapes."""
        ...


def is_quantized(module: nn.Module) -> bool:
    """A module the checkpoint loader hands tensors to (`load_shard`)."""
    return callable(getattr(module, "load_shard", None))

"""The linear layer of GPTQ and AWQ checkpoints: packed INT4 tensors, named and laid out
as in the checkpoint (kernels/int4/packing.py), filled shard by shard by the loader.

Fused layers (qkv_proj, gate_up_proj) hold their parts side by side along the output
dim: each part's qweight, qzeros, scales (and bias) fill a slice of columns, in packed
units where the output dim is packed. Every tensor is checked against the shape the
declared format implies, so a checkpoint that does not match its quantization_config is
refused naming the tensor, instead of being read as garbage. Nothing dequantized is kept:
each forward unpacks on the fly (Triton on CUDA, torch on CPU).

AWQ is loaded in its own layout, then repacked once into GPTQ's (packed along the input
dim, sequential zeros, zero offset 0: GPTQ v2), which dequantizes to the same weights:
AWQ's packing along the output dim with an interleave costs its kernels a per-element
shuffle, and was 1.4x slower than GPTQ's at batch 1 on the H200 (docs/benchmarks.md).
Then, without act-order and where the shapes allow (kernels/int4/layouts.py), GPTQ's qweight
is repacked once more, into the tiles layout (the pairs layout's words in the order the
batch-1 MMA GEMV's lanes read them, a warp's block 1 KB in one piece: 1 to 128 rows of x
run on the tensor cores, kernels/int4/triton_mma.py), the pairs layout (each output's
inputs contiguous, adjacent inputs in the two halves of a word) where groups smaller than
128 inputs or parts of outputs not a multiple of 16 rule tiles out, or the rows layout
where groups of 16 inputs rule pairs out (`layouts.DECODE_LAYOUT` picks another first);
zeros and scales keep GPTQ's layout. The repacks are exact, and loading ends with them: load_shard refuses
tensors afterwards.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from vllm_cluster.engine.errors import ModelLoadError
from vllm_cluster.engine.quantization.int4_pack import PACK, pack_cols, pack_rows
from vllm_cluster.kernels.elementwise.dispatch import silu_and_mul
from vllm_cluster.kernels.int4 import layouts
from vllm_cluster.kernels.int4.dispatch import int4_gemm, int4_gemm_add_norm, int4_gemm_normed
from vllm_cluster.kernels.int4.layouts import (
    gptq_to_pairs,
    gptq_to_rows,
    pairs_layout_fits,
    pairs_to_tiles,
    rows_layout_fits,
    tiles_layout_fits,
)
from vllm_cluster.kernels.int4.packing import group_index, unpack_cols
from vllm_cluster.kernels.int4.weight import Int4Weight
from vllm_cluster.kernels.linear.add_norm import AddNorm, Normed


@dataclass(frozen=True, slots=True)
class Int4Spec:
    """What a checkpoint's quantization_config declares, as the layer needs it."""

    method: str  # "gptq" or "awq": the checkpoint layout
    group_size: int  # -1: one group over all inputs
    zero_offset: int  # GPTQ v1 stores zero - 1: 1; GPTQ v2 and AWQ: 0
    lm_head: bool = False  # the checkpoint quantizes lm_head too (GPTQModel's `lm_head: true`)

    def num_groups(self, in_features: int) -> int:
        return 1 if self.group_size == -1 else -(-in_features // self.group_size)

    def shapes(self, in_features: int, out_features: int) -> dict[str, tuple[int, ...]]:
        """The checkpoint shape of each tensor of a linear with these features."""
        groups = self.num_groups(in_features)
        if self.method == "gptq":
            qweight: tuple[int, ...] = (in_features // PACK, out_features)
        else:
            qweight = (in_features, out_features // PACK)
        shapes = {
            "qweight": qweight,
            "qzeros": (groups, out_features // PACK),
            "scales": (groups, out_features),
            "bias": (out_features,),
        }
        if self.method == "gptq":
            shapes["g_idx"] = (in_features,)
        return shapes

    def check_features(self, in_features: int, output_sizes: list[int]) -> None:
        """Raise ModelLoadError when a layer of these features cannot be held in this format."""
        bad_out = [size for size in output_sizes if size % PACK]
        if bad_out:
            raise ModelLoadError(
                f"{self.method}: output features {bad_out} are not multiples of {PACK}, which the "
                "packed qzeros need; this model cannot be loaded as an INT4 checkpoint"
            )
        if self.method == "gptq" and in_features % PACK:
            raise ModelLoadError(f"gptq: in_features {in_features} is not a multiple of {PACK} (packed qweight rows)")
        if self.method == "awq" and self.group_size != -1 and in_features % self.group_size:
            raise ModelLoadError(
                f"awq: in_features {in_features} is not a multiple of group_size {self.group_size}"
            )


class Int4Linear(nn.Module):
    """x [T, in_features] -> [T, out_features] through INT4 weights of one format."""

    qweight: torch.Tensor  # int32, GPTQ [K/8, N], AWQ [K, N/8], pairs or rows [N, K/8], tiles [N/16, K/128, 256]
    qzeros: torch.Tensor  # int32 [G, N/8]
    scales: torch.Tensor  # fp16 [G, N]
    g_idx: torch.Tensor  # int32 [K] (GPTQ only)

    def __init__(
        self,
        spec: Int4Spec,
        in_features: int,
        output_sizes: list[int],
        bias: bool,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        spec.check_features(in_features, output_sizes)
        self.spec = spec
        self.in_features = in_features
        self.out_features = sum(output_sizes)
        self.output_sizes = list(output_sizes)
        # Output offsets of the parts: [0, q, q + k, ...].
        self.offsets = [sum(output_sizes[:i]) for i in range(len(output_sizes) + 1)]
        # act_order: g_idx is not groups of consecutive inputs, so the kernel gathers by it.
        self.act_order = False
        # The layout the tensors are in now: the checkpoint's, until finish_loading repacks
        # AWQ as GPTQ and GPTQ as tiles, pairs or rows (see the module docstring).
        self.layout = spec.method
        self._loaded: set[tuple[str, int]] = set()  # (tensor, part) pairs seen by load_shard
        shapes = spec.shapes(in_features, self.out_features)
        self.register_buffer("qweight", torch.zeros(shapes["qweight"], dtype=torch.int32, device=device))
        self.register_buffer("qzeros", torch.zeros(shapes["qzeros"], dtype=torch.int32, device=device))
        self.register_buffer("scales", torch.zeros(shapes["scales"], dtype=torch.float16, device=device))
        if spec.method == "gptq":
            self.register_buffer("g_idx", group_index(in_features, spec.group_size, device))
        self.bias = (
            nn.Parameter(torch.zeros(self.out_features, dtype=dtype, device=device), requires_grad=False)
            if bias
            else None
        )

    def extra_repr(self) -> str:
        s = self.spec
        return f"{s.method}, in={self.in_features}, out={self.output_sizes}, group_size={s.group_size}"

    def checkpoint_names(self) -> list[str]:
        """The tensors one checkpoint part of this layer holds."""
        names = list(self.spec.shapes(self.in_features, self.out_features))
        return [n for n in names if n != "bias" or self.bias is not None]

    def load_shard(self, param_name: str, tensor: torch.Tensor, shard_index: int | None = None) -> None:
        """Copy one checkpoint tensor into part `shard_index` (None: the whole layer)."""
        part = 0 if shard_index is None else shard_index
        assert 0 <= part < len(self.output_sizes), f"part {part} of a layer of {len(self.output_sizes)} parts"
        assert self.layout == self.spec.method, "this layer finished loading and was repacked"
        size = self.out_features if shard_index is None else self.output_sizes[part]
        expected = self.spec.shapes(self.in_features, size).get(param_name)
        if expected is None or (param_name == "bias" and self.bias is None):
            hint = "; an unquantized checkpoint? unset quantization" if param_name == "weight" else ""
            raise ModelLoadError(
                f"{self.spec.method} checkpoint tensor {param_name!r} has no place in this layer "
                f"(expected {self.checkpoint_names()}){hint}"
            )
        if tuple(tensor.shape) != expected:
            raise ModelLoadError(
                f"{param_name} of {self.spec.method} part {part} (in={self.in_features}, out={size}, "
                f"group_size={self.spec.group_size}): expected shape {expected}, found "
                f"{tuple(tensor.shape)}; the checkpoint does not match its quantization_config"
            )
        integer = param_name in ("qweight", "qzeros", "g_idx")
        if integer != (tensor.dtype == torch.int32) or (not integer and not tensor.is_floating_point()):
            raise ModelLoadError(
                f"{param_name} of {self.spec.method} part {part}: dtype {tensor.dtype} does not match the "
                f"format ({'int32' if integer else 'a float type'} expected)"
            )
        self._loaded.add((param_name, part))
        if param_name == "g_idx":
            self._load_g_idx(tensor, part)
            return
        offset = self.offsets[part]
        dest = self._dest(param_name).data
        if (param_name == "qweight" and self.spec.method == "gptq") or param_name == "scales":
            dest = dest.narrow(1, offset, size)
        elif param_name in ("qweight", "qzeros"):
            dest = dest.narrow(1, offset // PACK, size // PACK)
        else:  # bias
            dest = dest.narrow(0, offset, size)
        dest.copy_(tensor)

    def _dest(self, param_name: str) -> torch.Tensor:
        dest = getattr(self, param_name)
        assert isinstance(dest, torch.Tensor)
        return dest

    def _load_g_idx(self, tensor: torch.Tensor, part: int) -> None:
        """Fused parts share their input, so their g_idx must agree: keep one."""
        g_idx = tensor.to(torch.int32).cpu()
        if any(name == "g_idx" and p != part for name, p in self._loaded) and not torch.equal(g_idx, self.g_idx.cpu()):
            raise ModelLoadError(
                f"g_idx of part {part} differs from an earlier part's of the same fused layer; "
                "parts that share an input (q/k/v, gate/up) must be quantized with the same act-order"
            )
        num_groups = self.spec.num_groups(self.in_features)
        if g_idx.numel() and not (int(g_idx.min()) >= 0 and int(g_idx.max()) < num_groups):
            raise ModelLoadError(f"g_idx values must lie in [0, {num_groups}), found {int(g_idx.max())}")
        self.g_idx.copy_(g_idx)
        trivial = group_index(self.in_features, self.spec.group_size, g_idx.device)
        self.act_order = not torch.equal(g_idx, trivial)

    def finish_loading(self) -> None:
        """Every part's tensors arrived (g_idx may be absent without act-order)."""
        names = [n for n in self.checkpoint_names() if n != "g_idx"]
        missing = [
            f"{n} of part {p}" for p in range(len(self.output_sizes)) for n in names if (n, p) not in self._loaded
        ]
        if missing:
            raise ModelLoadError(
                f"{self.spec.method} layer (in={self.in_features}, out={self.output_sizes}): the checkpoint "
                f"lacks {', '.join(missing)}"
            )
        self._repack()

    def _repack(self) -> None:
        self._repack_awq_as_gptq()
        self._repack_gptq_for_decode()

    @torch.no_grad()
    def _repack_gptq_for_decode(self) -> None:
        """GPTQ qweight [K/8, N] -> tiles [N/16, K/128, 256], pairs or rows [N, K/8]
        (kernels/int4/layouts.py): the same 4-bit values; zeros, scales and zero offset
        unchanged. layouts.DECODE_LAYOUT where it fits, else the next of tiles, pairs,
        rows that fits."""
        if self.layout != "gptq" or self.act_order:
            return
        group_size = self.spec.group_size
        wanted = layouts.DECODE_LAYOUT
        if wanted == "tiles" and tiles_layout_fits(self.in_features, self.output_sizes, group_size):
            self.qweight = pairs_to_tiles(gptq_to_pairs(self.qweight))
            self.layout = "tiles"
        elif wanted in ("tiles", "pairs") and pairs_layout_fits(self.in_features, group_size):
            self.qweight = gptq_to_pairs(self.qweight)
            self.layout = "pairs"
        elif rows_layout_fits(self.in_features, group_size):
            self.qweight = gptq_to_rows(self.qweight)
            self.layout = "rows"

    @torch.no_grad()
    def _repack_awq_as_gptq(self) -> None:
        """AWQ qweight [K, N/8] and qzeros (interleaved along N) -> GPTQ v2 qweight [K/8, N]
        and sequential qzeros; scales keep their layout. Same dequantized weights."""
        if self.layout != "awq" or self.in_features % PACK:
            return
        self.qweight = pack_rows(unpack_cols(self.qweight, "awq"))
        self.qzeros = pack_cols(unpack_cols(self.qzeros, "awq"), "gptq")
        self.layout = "gptq"

    takes_normed = True  # a Normed x (engine/layers/linear.py)

    def forward(self, x: torch.Tensor | Normed) -> torch.Tensor:
        # x: [..., in] -> [..., out]
        if isinstance(x, Normed):
            y = self._product_normed(x)
            return y if self.bias is None else y + self.bias
        y = self._product(x.reshape(-1, self.in_features))
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)

    def forward_silu_mul(self, x: torch.Tensor | Normed) -> torch.Tensor:
        """silu_and_mul(self(x)) for a [gate | up] layer: one launch for a decode row on the
        pairs layout (int4_gemm's silu_mul), two elsewhere."""
        if self.bias is not None:
            return silu_and_mul(self(x))
        if isinstance(x, Normed):
            return self._product_normed(x, silu_mul=True)
        y = self._product(x.reshape(-1, self.in_features), silu_mul=True)
        return y.reshape(*x.shape[:-1], self.out_features // 2)

    def forward_add_norm(
        self, x: torch.Tensor, add_norm: AddNorm
    ) -> tuple[torch.Tensor | Normed, torch.Tensor]:
        """add_norm.after(self(x)) for o_proj and down_proj: (normed, h) of the norm after; at a
        decode row on the pairs and tiles layouts the MMA GEMV does its first half and the
        normed half is a Normed (engine/layers/linear.py)."""
        if self.bias is not None or x.dim() != 2:
            return add_norm.after(self(x))
        return int4_gemm_add_norm(x, self.int4_weight(), add_norm)

    def _product_normed(self, x: Normed, silu_mul: bool = False) -> torch.Tensor:
        return int4_gemm_normed(x, self.int4_weight(), silu_mul)

    def _product(self, flat: torch.Tensor, silu_mul: bool = False) -> torch.Tensor:
        return int4_gemm(flat, self.int4_weight(), silu_mul)

    def int4_weight(self) -> Int4Weight:
        """The weight as the INT4 kernels take it, in its current layout (g_idx only with act-order)."""
        s = self.spec
        g_idx = self.g_idx if self.act_order else None
        return Int4Weight(self.qweight, self.qzeros, self.scales, g_idx, s.group_size, self.layout, s.zero_offset)

    @torch.no_grad()
    def init_dummy(self, generator: torch.Generator) -> None:
        """Random valid tensors (load_format: dummy): any bits are valid nibbles; zeros near
        the middle and scales chosen so weights have about the 0.02 spread of dummy weights."""
        device = self.qweight.device
        words = torch.randint(-(2**31), 2**31, self.qweight.shape, generator=generator, device=device)
        self.qweight.copy_(words.to(torch.int32))
        # Every zero 8, so weights are symmetric around 0 (GPTQ v1 stores zero - 1 = 7).
        self.qzeros.fill_(0x77777777 if self.spec.zero_offset else 0x88888888 - 2**32)
        self.scales.fill_(0.02 / 4.6)  # uniform 0..15 has std 4.6
        if self.bias is not None:
            self.bias.zero_()
        if self.spec.method == "gptq":
            self.g_idx.copy_(group_index(self.in_features, self.spec.group_size, device))
        self.act_order = False
        self._repack()


class Int4Method:
    """What GPTQ and AWQ share as quantization methods (engine/quantization/base.py): the
    checkpoint holds packed INT4 tensors, and an Int4Linear of the declared spec takes
    them. A format names itself, its default spec and how it reads config.json."""

    name: ClassVar[str]
    default_spec: ClassVar[Int4Spec]
    quantizes_checkpoint = True

    @staticmethod
    def read_spec(hf_config: dict[str, Any]) -> Int4Spec:
        """The spec config.json declares; ModelLoadError naming an unsupported setting."""
        raise NotImplementedError

    def __init__(self, spec: Int4Spec | None = None) -> None:
        self.spec = spec or self.default_spec

    @property
    def quantizes_lm_head(self) -> bool:
        return self.spec.lm_head

    @classmethod
    def from_hf_config(cls, hf_config: dict[str, Any]) -> Int4Method:
        return cls(cls.read_spec(hf_config))

    def check_hf_config(self, hf_config: dict[str, Any]) -> None:
        spec = self.read_spec(hf_config)
        if spec != self.spec:
            raise ModelLoadError(f"{self.name} was configured for {self.spec}, but the checkpoint declares {spec}")

    def create_linear(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        output_sizes: list[int],
        dtype: torch.dtype,
        device: torch.device,
    ) -> nn.Module:
        assert sum(output_sizes) == out_features, (output_sizes, out_features)
        return Int4Linear(self.spec, in_features, output_sizes, bias, dtype, device)

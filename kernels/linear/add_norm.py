"""The residual add and RMS norm between two batch-1 GEMVs, as values the GEMVs pass along
(kernels/linear/triton_add_norm.py has the kernels' side): `AddNorm` asks the GEMV before to
do the first half of the norm, `Normed` is what it leaves for the GEMV after."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_cluster.kernels.elementwise.dispatch import fused_add_rms_norm

# Whether the residual add and RMS norm between two batch-1 GEMVs (o_proj -> gate_up, down ->
# the next layer's qkv) are done by the two GEMVs (kernels/linear/triton_add_norm.py); False:
# the norm's own launch.
ADD_NORM_EPILOGUE = True


@dataclass(frozen=True)
class Normed:
    """weight * rms_norm(h) as the GEMV before left it (kernels/linear/triton_add_norm.py): hg =
    h * weight [1, D] and, in `slot`, the sum of h^2. A batch-1 GEMV takes it as its x and
    scales its sums; anything else calls `materialize`."""

    hg: torch.Tensor  # [1, D]
    slot: torch.Tensor  # [1] fp64: sum of h^2
    eps: float

    def materialize(self) -> torch.Tensor:
        """The normed x itself, [1, D] in hg's dtype."""
        rstd = torch.rsqrt(self.slot.float() / self.hg.shape[-1] + self.eps)
        return (self.hg.float() * rstd).to(self.hg.dtype)


@dataclass(frozen=True)
class AddNorm:
    """`fused_add_rms_norm(y, residual, weight, eps)` of a linear's output y. A batch-1 GEMV
    with a `slot` (a zeroed [1] fp64 tensor) returns the normed half as a `Normed` for the
    GEMV after to finish (kernels/linear/triton_add_norm.py); other paths return it computed."""

    residual: torch.Tensor  # [T, N]
    weight: torch.Tensor  # [N]
    eps: float
    slot: torch.Tensor | None = None

    def in_epilogue(self, x: torch.Tensor) -> bool:
        """Whether a GEMV of x ([T, K]) may take it: one row on CUDA, one dtype throughout."""
        return (
            ADD_NORM_EPILOGUE and self.slot is not None and x.is_cuda and x.dim() == 2 and x.shape[0] == 1
            and self.residual.dim() == 2 and self.residual.is_contiguous() and self.weight.is_contiguous()
            and self.residual.dtype == self.weight.dtype == x.dtype
        )  # fmt: skip

    def after(self, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(normed, h) of the linear's output y, in launches of their own."""
        return fused_add_rms_norm(y, self.residual, self.weight, self.eps)

    def deferred(self, hg: torch.Tensor) -> Normed:
        """The normed half, as the GEMV before left it: its hg and this slot."""
        assert self.slot is not None
        return Normed(hg, self.slot, self.eps)

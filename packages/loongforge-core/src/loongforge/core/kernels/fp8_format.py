"""What every FP8 linear of LoongForge shares, whatever its scaling recipe (tensor-wise here in
``fp8_tensorwise.py``, blockwise in loongforge-llm): e4m3's range, the floor of a scale's amax,
the inputs an FP8 linear takes, the tensor-wise scale of a whole tensor and the row padding of a
transposed FP8 copy (``_scaled_mm``'s multiples of 16), and ``Fp8Gemms``, which of a linear's three GEMMs run in FP8 (the
choice its caller hands an FP8 linear op; the op never makes it)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # e4m3's largest finite value
# scale = amax * (1 / 448): a product, which every device rounds alike (CUDA torch turns a division
# by a Python scalar into this product anyway, so a quotient would differ between devices)
INV_FP8_MAX = 1.0 / FP8_MAX
# Blocks whose amax is below this get the scale this amax would give: all-zero blocks stay zero
# and the scale never underflows.
AMAX_FLOOR = 1e-12

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
ALIGN = 16  # _scaled_mm: K and N multiples of 16


def fp8_dtype(e5m2: bool) -> torch.dtype:
    return E5M2 if e5m2 else E4M3


def padded_rows(rows: int) -> int:
    """``rows`` rounded up to a multiple of 16: the row count of a transposed copy's rows dim."""
    return rows + (-rows % ALIGN)


def scale_from_amax(amax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp32 scalar ``amax / fmax(dtype)`` (``amax`` floored away from zero)."""
    return amax.float().clamp_min(AMAX_FLOOR) / torch.finfo(dtype).max


def tensor_scale(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp32 scalar ``amax(|t|) / fmax(dtype)``: ``t / scale`` spans the format's range."""
    return scale_from_amax(t.detach().abs().amax(), dtype)


def check_linear(op: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """Clear errors for inputs an FP8 linear cannot take."""
    if weight.dim() != 2 or x.dim() < 1 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"{op}: expected x [..., K] and weight [N, K]; got {tuple(x.shape)} and {tuple(weight.shape)}")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"{op}: bias must be [{weight.shape[0]}], got {tuple(bias.shape)}")
    for name, t in (("x", x), ("weight", weight)):
        if not t.is_floating_point() or t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            raise ValueError(f"{op}: {name} must be a bf16/fp16/fp32 tensor (it is quantised inside), got {t.dtype}")


GEMMS = ("fprop", "dgrad", "wgrad")  # y = x w^T, dx = dy w, dw = dy^T x


@dataclass(frozen=True)
class Fp8Gemms:
    """Which of a linear's three GEMMs run in FP8; the others run in the input's dtype (the weight
    cast to it, a plain matmul; the weight gradient cast back to the weight's dtype)."""

    fprop: bool = True
    dgrad: bool = True
    wgrad: bool = True

    def names(self) -> tuple[str, ...]:
        """The GEMMs in FP8, in ``GEMMS`` order."""
        return tuple(g for g in GEMMS if getattr(self, g))

    @classmethod
    def from_names(cls, names) -> Fp8Gemms:
        """The choice that runs exactly ``names`` (a subset of ``GEMMS``) in FP8."""
        names = list(names)
        unknown = [n for n in names if n not in GEMMS]
        if unknown:
            raise ValueError(f"FP8 GEMMs {unknown}: each one of {', '.join(GEMMS)}")
        return cls(*(g in names for g in GEMMS))


ALL_FP8 = Fp8Gemms()


def check_gemms(op: str, gemms) -> None:
    """A clear error for a ``gemms`` argument that is not an ``Fp8Gemms``."""
    if not isinstance(gemms, Fp8Gemms):
        raise TypeError(f"{op}: gemms must be a loongforge.core.kernels.fp8_format.Fp8Gemms, got {gemms!r}")

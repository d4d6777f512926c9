"""RMSNorm for megatron-core layer specs on the registry's fused ops (``rms_norm``, ``add_rms_norm``)."""

from __future__ import annotations

import torch

from loongforge.core.kernels import KernelPolicy


class FusedRMSNorm(torch.nn.Module):
    """RMSNorm over the last dim, built like megatron's norms (``config, hidden_size, eps``).

    ``norm(x)`` is ``rms_norm(x)``; ``norm(x, residual=r)`` returns ``(rms_norm(x + r), x + r)``
    from one fused pass (the pre-MLP norm of a decoder layer, whose sum is the residual stream);
    ``norm.with_residual(x)`` returns ``(rms_norm(x), x)``, ``x`` passed on as the residual stream
    (a decoder layer's input norm): both outputs' gradients are summed inside the norm's backward.
    The ops come from ``loongforge.core.kernels``, resolved by ``kernels``: Triton where the
    accelerator runs it, else the torch references. Its one parameter is ``weight``, as in
    megatron's local spec.
    """

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, kernels: KernelPolicy = KernelPolicy()):
        super().__init__()
        if getattr(config, "normalization", "RMSNorm") != "RMSNorm":
            raise ValueError(f"FusedRMSNorm: config.normalization={config.normalization!r}; expected 'RMSNorm'")
        if getattr(config, "layernorm_zero_centered_gamma", False):
            raise ValueError("FusedRMSNorm: layernorm_zero_centered_gamma is not supported")
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        setattr(self.weight, "sequence_parallel", bool(getattr(config, "sequence_parallel", False)))
        self._rms_norm = kernels.get("rms_norm")
        self._add_rms_norm = kernels.get("add_rms_norm")
        self._rms_norm_with_residual = kernels.get("rms_norm_with_residual")

    def scale(self) -> torch.Tensor:
        """What the normalised rows are multiplied by."""
        return self.weight

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return self._rms_norm(x, self.scale(), self.eps)
        return self._add_rms_norm(x, residual, self.scale(), self.eps)

    def with_residual(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(x), x)``: ``x`` passed on as the residual stream, its two gradients summed in the
        norm's backward pass."""
        return self._rms_norm_with_residual(x, self.scale(), self.eps)


class ZeroCenteredRMSNorm(FusedRMSNorm):
    """``FusedRMSNorm`` whose ``weight`` is stored zero-centred: it scales by ``1 + weight``
    (Qwen3.5's norms; its checkpoints store them so). Starts at zero, i.e. at unit scale."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, kernels: KernelPolicy = KernelPolicy()):
        super().__init__(config, hidden_size, eps=eps, kernels=kernels)
        with torch.no_grad():
            self.weight.zero_()

    def scale(self) -> torch.Tensor:
        # in fp32, as Qwen3.5's own norm computes it: near 1, bf16 steps of 2**-7 would round small
        # weights away (the kernels take an fp32 scale beside bf16 rows; the gradient returns in bf16)
        return 1.0 + self.weight.float()

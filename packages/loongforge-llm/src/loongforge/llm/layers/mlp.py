"""megatron's dense MLP with the registry's fused SwiGLU between ``linear_fc1`` and ``linear_fc2``."""

from __future__ import annotations

import torch.nn.functional as F
from megatron.core.transformer.mlp import MLP

from loongforge.core.kernels import KernelPolicy
from loongforge.llm.layers.discarded_output import DiscardedOutput


class FusedMLP(MLP):
    """``linear_fc2(swiglu(linear_fc1(x)))`` with the fused ``swiglu`` op (megatron's fc1 layout
    ``[gate, up]`` per tensor-parallel rank, so TP works unchanged).

    With ``recompute_activation`` the SwiGLU output (``ffn`` wide) is not kept for the backward:
    ``linear_fc2`` saves it, ``DiscardedOutput`` frees it after the forward and
    recomputes it from ``linear_fc1``'s output (kept anyway) when the backward reaches fc2 -- one
    elementwise pass for ``tokens x ffn`` activations; where fc2 takes the output over (the fast
    spec's linears), SwiGLU's backward recomputes it in its own pass (``swiglu_backward``), so the
    recomputation costs a write and no read. Other activations fall back to ``MLP``.
    ``kernels``: the policy its ``swiglu`` and ``swiglu_backward`` are resolved by.
    """

    def __init__(self, *args, kernels: KernelPolicy = KernelPolicy(), **kwargs):
        super().__init__(*args, **kwargs)
        self._swiglu, self._swiglu_backward = kernels.get("swiglu"), kernels.get("swiglu_backward")
        self._fused = self.config.gated_linear_unit and self.config.activation_func is F.silu
        self.recompute_activation = False

    @classmethod
    def as_mlp_submodule(cls, *args, kernels: KernelPolicy = KernelPolicy(), **kwargs) -> FusedMLP:
        """megatron's builder of a decoder layer's MLP (the layer spec's ``mlp``), its ``swiglu``
        resolved by ``kernels`` (megatron's builder constructs the module without it)."""
        mlp = super().as_mlp_submodule(*args, **kwargs)
        mlp._swiglu, mlp._swiglu_backward = kernels.get("swiglu"), kernels.get("swiglu_backward")
        return mlp

    def forward(self, hidden_states, per_token_scale=None, **kwargs):
        if not self._fused or per_token_scale is not None:
            return super().forward(hidden_states, per_token_scale, **kwargs)
        gate_up, bias = self.linear_fc1(hidden_states)
        if bias is not None:
            gate_up = gate_up + bias
        if self.recompute_activation and self.training and gate_up.requires_grad:
            activation = DiscardedOutput()
            out, out_bias = self.linear_fc2(activation.run(self._swiglu, gate_up, consumer=self.linear_fc2,
                                                           backward=self._swiglu_with_output))
            activation.discard(out)
        else:
            out, out_bias = self.linear_fc2(self._swiglu(gate_up))
        return out, out_bias

    def _swiglu_with_output(self, dy, gate_up):
        return self._swiglu_backward(dy, gate_up, True)

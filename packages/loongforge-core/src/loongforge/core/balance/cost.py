"""Per-sample compute cost: ``a * sum(l_i**2) + b * sum(l_i) + c``.

A sample is one sequence (an ``int`` length) or a packed sequence of several segments that
attend only within themselves (a sequence of segment lengths). Attention is quadratic in each
segment's length; projections, MLP and the LM head are linear in the sample's total tokens; ``c``
is a fixed cost per sample (launches, per-sequence bookkeeping).

The coefficients come from a model's FLOP formula (``transformer_cost_model``, or
``CostModel.from_flops_per_token`` for any model family that reports FLOPs per token) or from
measured step times (``loongforge.core.balance.fit``). Only ratios matter to the balancer, so the
unit is free: FLOPs for the formula, seconds for a fit.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

SampleLength = int | Sequence[int]


@dataclass(frozen=True)
class SampleSizes:
    """Sizes of many samples as arrays: total ``tokens`` and ``squares`` (sum of segment length²)."""

    tokens: np.ndarray  # int64, shape (n,)
    squares: np.ndarray  # int64, shape (n,)

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    def take(self, positions: np.ndarray) -> SampleSizes:
        return SampleSizes(self.tokens[positions], self.squares[positions])

    @classmethod
    def from_lengths(cls, lengths: Sequence[SampleLength] | np.ndarray) -> SampleSizes:
        """``lengths[i]`` is sample i's length, or the list of its segment lengths."""
        if isinstance(lengths, np.ndarray) and lengths.ndim == 1 and lengths.dtype.kind in "iu":
            tokens = lengths.astype(np.int64)
            _check_lengths(tokens)
            return cls(tokens, tokens * tokens)
        tokens = np.empty(len(lengths), dtype=np.int64)
        squares = np.empty(len(lengths), dtype=np.int64)
        for i, sample in enumerate(lengths):
            if isinstance(sample, (int, np.integer)):
                segments = [sample]
            elif isinstance(sample, (Sequence, np.ndarray)):
                segments = list(sample)
            else:
                raise ValueError(f"sample {i}: {sample!r} is neither a length nor a list of segment lengths")
            if not segments:
                raise ValueError(f"sample {i} has no segments")
            for seg in segments:
                if not isinstance(seg, (int, np.integer)) or seg <= 0:
                    raise ValueError(f"sample {i}: segment length {seg!r} must be a positive integer")
            tokens[i] = sum(int(s) for s in segments)
            squares[i] = sum(int(s) * int(s) for s in segments)
        return cls(tokens, squares)


def _check_lengths(tokens: np.ndarray) -> None:
    bad = np.flatnonzero(tokens <= 0)
    if bad.size:
        raise ValueError(f"sample {int(bad[0])}: length {int(tokens[bad[0]])} must be a positive integer")


@dataclass(frozen=True)
class CostModel:
    """``cost = a * sum(segment_length**2) + b * tokens + c`` for one sample."""

    a: float
    b: float
    c: float = 0.0

    def __post_init__(self):
        for key in ("a", "b", "c"):
            value = getattr(self, key)
            if not np.isfinite(value) or value < 0:
                raise ValueError(f"cost model coefficient {key}={value!r} must be finite and >= 0")
        if self.a == 0 and self.b == 0 and self.c == 0:
            raise ValueError("cost model coefficients a, b, c are all 0")

    def cost(self, sample: SampleLength) -> float:
        sizes = SampleSizes.from_lengths([sample])
        return float(self.costs(sizes)[0])

    def costs(self, sizes: SampleSizes) -> np.ndarray:
        """Cost of each sample, float64, shape (n,)."""
        return self.a * sizes.squares.astype(np.float64) + self.b * sizes.tokens.astype(np.float64) + self.c

    def as_tuple(self) -> tuple[float, float, float]:
        return (self.a, self.b, self.c)

    @classmethod
    def from_flops_per_token(
        cls, flops_per_token: Callable[[int], float], seq_lengths: tuple[int, int, int] = (1024, 4096, 16384)
    ) -> CostModel:
        """From a family's ``flops_per_token(seq_length)`` (training FLOPs per token at that length).

        Dense attention makes FLOPs per token affine in the length, ``b + a*L``, so a sample of L
        tokens costs ``a*L**2 + b*L``. Two lengths give a and b; the third checks the formula is
        affine (a formula with sliding windows or sparse attention is not, and is refused).
        """
        l1, l2, l3 = seq_lengths
        f1, f2, f3 = (float(flops_per_token(n)) for n in seq_lengths)
        a = (f2 - f1) / (l2 - l1)
        b = f1 - a * l1
        predicted = b + a * l3
        if not np.isclose(predicted, f3, rtol=1e-6):
            raise ValueError(
                f"flops_per_token is not affine in the sequence length: f({l1})={f1:.6g}, f({l2})={f2:.6g} "
                f"predict f({l3})={predicted:.6g} but it returned {f3:.6g}; fit the cost model from step times instead"
            )
        return cls(a=max(a, 0.0), b=max(b, 0.0), c=0.0)


def transformer_cost_model(
    *,
    hidden_size: int,
    num_layers: int,
    ffn_hidden_size: int,
    num_attention_heads: int,
    vocab_size: int,
    num_query_groups: int | None = None,
    head_dim: int | None = None,
    gated_mlp: bool = True,
    causal: bool = True,
    recompute: bool = False,
) -> CostModel:
    """Training FLOPs of a decoder transformer as ``a*L**2 + b*L`` (matmuls only, 2 FLOPs per MAC).

    With h = hidden size, n = layers, f = FFN size, q = attention heads, g = key/value heads,
    d = head dim (h / q unless given), V = vocab, m = 3 for a gated (SwiGLU) MLP else 2, and
    k = 3 (forward + backward, which costs twice the forward) or 4 with full recompute:

    - per token and layer: QKV projection 2*h*d*(q + 2g), output projection 2*q*d*h, MLP 2*m*h*f;
      per token once: LM head 2*h*V.  So ``b = k * (n * (2hd(q+2g) + 2qdh + 2mhf) + 2hV)``.
    - per segment of length l and layer: scores Q·Kᵀ and the weighted sum of V, 2*q*d*l² each,
      halved by a causal mask.  So ``a = k * n * 4qd * (1/2 if causal else 1)``.

    For a mixture-of-experts model pass the FFN size times the experts each token is routed to.
    """
    values = dict(hidden_size=hidden_size, num_layers=num_layers, ffn_hidden_size=ffn_hidden_size,
                  num_attention_heads=num_attention_heads, vocab_size=vocab_size)
    for key, value in values.items():
        if not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"{key}={value!r} must be a positive integer")
    q = num_attention_heads
    g = q if num_query_groups is None else num_query_groups
    if g < 1 or q % g:
        raise ValueError(f"num_query_groups={num_query_groups!r} must be >= 1 and divide num_attention_heads={q}")
    if head_dim is None:
        if hidden_size % q:
            raise ValueError(f"hidden_size={hidden_size} is not divisible by num_attention_heads={q}; pass head_dim")
        head_dim = hidden_size // q
    h, n, f, d, v = hidden_size, num_layers, ffn_hidden_size, head_dim, vocab_size
    m = 3 if gated_mlp else 2
    k = 4 if recompute else 3
    per_token_layer = 2 * h * d * (q + 2 * g) + 2 * q * d * h + 2 * m * h * f
    b = k * (n * per_token_layer + 2 * h * v)
    a = k * n * 4 * q * d * (0.5 if causal else 1.0)
    return CostModel(a=float(a), b=float(b), c=0.0)

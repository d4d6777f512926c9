"""The gated delta rule (Gated DeltaNet's token mixer) over packed sequences.

``gated_delta_rule(q, k, v, g, beta, cu_seqlens=None, initial_state=None)`` returns
``(out, final_state)`` for

    q, k   [B, T, Hk, Dk]   queries and keys (L2-normalised here; queries also scaled by Dk^-1/2)
    v      [B, T, Hv, Dv]   values; Hv is a multiple of Hk, each q/k head serving Hv / Hk
                            consecutive value heads
    g      [B, T, Hv]       the log decay of the state at each token (<= 0)
    beta   [B, T, Hv]       the write strength of each token (0..1)

where each head's state ``S`` (``[Dk, Dv]``, zero at the start of every sequence unless
``initial_state`` gives it) evolves, token by token, as

    S <- exp(g_t) S;  S <- S + beta_t k_t (v_t - k_t^T S);  out_t = q_t^T S

With ``cu_seqlens`` (int ``[N + 1]``, B = 1) the row holds N packed sequences: the state starts
afresh at each boundary, so no sequence sees another. ``initial_state`` is ``[N, Hv, Dk, Dv]``
(N = B without ``cu_seqlens``) and ``final_state`` each sequence's last state, in fp32, as
flash-linear-attention's ``chunk_gated_delta_rule`` takes and returns them (its
``use_qk_l2norm_in_kernel=True`` form).

This module is the op's contract (a ``loongforge.ops`` entry point of loongforge-llm) and its
torch reference: fp32, in chunks of ``CHUNK`` tokens (the closed form of ``_chunk``), every
sequence of a packed row stepped together. On CUDA,
loongforge-kernels gives the registry flash-linear-attention's chunked Triton kernel (``fla-core``,
in loongforge-llm's ``gpu`` extra).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _check(q, k, v, g, beta, cu_seqlens, initial_state) -> int:
    """The number of sequences; raises ``ValueError`` naming what does not fit."""
    b, t, hk, dk = q.shape
    hv, dv = v.shape[-2:]
    if k.shape != q.shape or v.shape[:2] != (b, t) or g.shape != (b, t, hv) or beta.shape != (b, t, hv):
        raise ValueError(f"gated_delta_rule: shapes q {list(q.shape)}, k {list(k.shape)}, v {list(v.shape)}, "
                         f"g {list(g.shape)}, beta {list(beta.shape)} do not fit [B, T, H, D]")
    if hv % hk:
        raise ValueError(f"gated_delta_rule: {hv} value heads are not a multiple of {hk} key heads")
    n = b
    if cu_seqlens is not None:
        if b != 1:
            raise ValueError(f"gated_delta_rule: cu_seqlens needs one packed row (B = 1), got B = {b}")
        bounds = cu_seqlens.tolist()
        if len(bounds) < 2 or bounds[0] != 0 or bounds[-1] != t or any(e < s for s, e in zip(bounds, bounds[1:])):
            raise ValueError(f"gated_delta_rule: cu_seqlens={bounds} must rise from 0 to the row's {t} tokens")
        n = len(bounds) - 1
    if initial_state is not None and initial_state.shape != (n, hv, dk, dv):
        raise ValueError(f"gated_delta_rule: initial_state {list(initial_state.shape)}, expected {[n, hv, dk, dv]}")
    return n


CHUNK = 64  # tokens per step of the reference's chunked form


def _chunk(q, k, v, g, beta, state):
    """One chunk of the rule in closed form: ``(out [N, C, H, Dv], state after it)``.

    With ``c_t`` the decay's running sum over the chunk and ``u_t = beta_t (v_t - k_t^T S_{t-1}')``
    (``S'`` decayed to step t) the value each token writes, the state after token ``t`` is
    ``exp(c_t) S_0 + sum_{i<=t} exp(c_t - c_i) k_i u_i^T``, so ``(I + A) U = beta V - beta exp(c) K S_0``
    with ``A[t, i] = beta_t exp(c_t - c_i) k_t . k_i`` (i < t): one triangular solve per chunk."""
    q, k, v, g, beta = (x.transpose(1, 2) for x in (q, k, v, g, beta))  # [N, H, C, ...]
    c = g.cumsum(-1)
    size = c.shape[-1]
    lower = torch.ones(size, size, dtype=torch.bool, device=q.device).tril()
    decay = torch.where(lower, c[..., :, None] - c[..., None, :], float("-inf")).exp()  # exp(c_t - c_i), i <= t
    strict = decay.masked_fill(torch.eye(size, dtype=torch.bool, device=q.device), 0.0)
    a = beta[..., None] * strict * (k @ k.transpose(-1, -2))
    rhs = beta[..., None] * (v - c.exp()[..., None] * (k @ state))
    eye = torch.eye(size, dtype=q.dtype, device=q.device)
    u = torch.linalg.solve_triangular(eye + a, rhs, upper=False, unitriangular=True)
    out = c.exp()[..., None] * (q @ state) + (decay * (q @ k.transpose(-1, -2))) @ u
    last = c[..., -1:]
    state = last.exp()[..., None] * state + (k * (last - c).exp()[..., None]).transpose(-1, -2) @ u
    return out.transpose(1, 2), state


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     cu_seqlens: torch.Tensor | None = None, initial_state: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [B, T, Hv, Dv], final_state [N, Hv, Dk, Dv])`` (see the module docstring)."""
    n = _check(q, k, v, g, beta, cu_seqlens, initial_state)
    dtype = v.dtype
    b, t, hk, dk = q.shape
    hv, dv = v.shape[-2:]
    rep = hv // hk
    q = _l2norm(q.float()).repeat_interleave(rep, dim=2) * dk**-0.5
    k = _l2norm(k.float()).repeat_interleave(rep, dim=2)
    v, g, beta = v.float(), g.float(), beta.float()
    if cu_seqlens is not None:  # one row of N sequences -> N rows, padded to the longest
        bounds = cu_seqlens.tolist()
        lengths = [e - s for s, e in zip(bounds, bounds[1:])]
        longest = max(lengths) if lengths else 0
        rows = torch.tensor([i for i, n_i in enumerate(lengths) for _ in range(n_i)], device=q.device)
        cols = torch.cat([torch.arange(n_i, device=q.device) for n_i in lengths]) if lengths else rows

        def unpack(x):
            out = x.new_zeros(n, longest, *x.shape[2:])
            return out.index_put((rows, cols), x[0])

        q, k, v, g, beta = (unpack(x) for x in (q, k, v, g, beta))
        steps = longest
    else:
        steps = t
    state = initial_state.float() if initial_state is not None else q.new_zeros(n, hv, dk, dv)
    outs = []
    for start in range(0, steps, CHUNK):  # padding past a sequence's end has g = beta = 0: it leaves the state be
        part = slice(start, min(start + CHUNK, steps))
        out_c, state = _chunk(q[:, part], k[:, part], v[:, part], g[:, part], beta[:, part], state)
        outs.append(out_c)
    out = torch.cat(outs, dim=1) if outs else v.new_zeros(n, 0, hv, dv)
    if cu_seqlens is not None:
        out = out[rows, cols][None]
    return out.to(dtype), state


def short_causal_conv(x: torch.Tensor, weight: torch.Tensor, positions: torch.Tensor,
                      history: torch.Tensor | None = None) -> torch.Tensor:
    """Gated DeltaNet's short depthwise causal convolution, then SiLU, over packed sequences.

    ``x`` ``[B, T, C]``; ``weight`` ``[C, K]`` (tap ``K - 1`` on the current token);
    ``positions`` ``[B, T]``, each token's index in its own sequence: a tap reaching ``j`` tokens
    back reads only where ``j <= position`` (never the sequence before it in a packed row);
    ``history`` ``[B, K - 1, C]``, the tokens before the row (another rank's under context
    parallelism), read only where a sequence started there."""
    b, t, c = x.shape
    taps = weight.shape[1]
    before = history if history is not None else x.new_zeros(b, taps - 1, c)
    padded = torch.cat([before, x], dim=1)  # [B, K - 1 + T, C]
    out = x * weight[:, taps - 1]
    for j in range(1, taps):
        shifted = padded[:, taps - 1 - j : taps - 1 - j + t]  # the token j back
        out = out + torch.where((positions >= j)[..., None], shifted, 0.0) * weight[:, taps - 1 - j]
    return F.silu(out)


"""DSA kernels on a GPU vs the torch references at long sequences (8K and 32K tokens), in bf16.

DeepSeek-V3.2's per-head sizes: latent 512 + rope 64, 16 or 128 query heads (one or several head
blocks per program), an indexer of 16 heads of 128, top-2048. The kernels run on the whole
sequence; the references (slow, chunked) check a subset of queries, the first 256 (whose rows
are -1 padded) and the last 512: sparse attention is separable over queries, and the output grad
is zero elsewhere, so the key/value grad of the fused run must equal the reference's over that
subset alone.
"""

from __future__ import annotations

import os

import pytest
import torch

from loongforge.llm.ops import dsa

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="run with TRITON_INTERPRET=0 on a GPU"),
]

D_V, D_ROPE, HI, DI, TOPK = 512, 64, 16, 128, 2048


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-30)).item()


def _problem(seq: int, heads: int, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    bf = dict(device="cuda", dtype=torch.bfloat16)
    q = torch.randn(1, seq, heads, D_V + D_ROPE, device="cuda", generator=g).to(torch.bfloat16)
    kv = torch.randn(1, seq, D_V + D_ROPE, device="cuda", generator=g).to(torch.bfloat16)
    q_idx = torch.randn(1, seq, HI, DI, device="cuda", generator=g).to(**bf)
    k_idx = torch.randn(1, seq, DI, device="cuda", generator=g).to(**bf)
    w_idx = torch.randn(1, seq, HI, device="cuda", generator=g) * HI**-0.5
    sel = torch.cat([torch.arange(256, device="cuda"), torch.arange(seq - 512, seq, device="cuda")])
    return q, kv, q_idx, k_idx, w_idx, sel


@pytest.mark.parametrize("seq, heads", [(8192, 16), (32768, 16), (8192, 128)])
def test_dsa_kernels_match_the_references(seq, heads):
    from loongforge.kernels.dsa_indexer import dsa_indexer_loss, dsa_indexer_topk
    from loongforge.kernels.sparse_mla import sparse_mla_attention

    q, kv, q_idx, k_idx, w_idx, sel = _problem(seq, heads)
    scale = (128 + D_ROPE) ** -0.5

    # top-k: every pick causal, rows as full as causality allows, and the picks are the reference's best
    idx = dsa_indexer_topk(q_idx, k_idx, w_idx, TOPK)
    assert idx.shape == (1, seq, TOPK) and idx.dtype == torch.int32
    t = sel[:, None]
    picked = idx[0, sel].long()
    assert ((picked == -1) | ((picked >= 0) & (picked <= t))).all()
    assert ((picked >= 0).sum(-1) == torch.clamp(sel + 1, max=TOPK)).all()
    ref_scores = dsa.indexer_scores(q_idx[:, sel], k_idx, w_idx[:, sel])[0]
    ref_scores = ref_scores.masked_fill(torch.arange(seq, device="cuda")[None, :] > t, float("-inf"))
    kth = ref_scores.topk(TOPK, dim=-1).values[:, -1:]
    got_scores = ref_scores.gather(1, picked.clamp_min(0)).masked_fill(picked < 0, float("inf"))
    tol = 1e-4 * ref_scores[ref_scores > float("-inf")].abs().max()
    assert (got_scores >= kth - tol).all()  # a pick may differ from the reference's only at a (near) tie
    ref_idx = dsa.dsa_indexer_topk(q_idx[:, -512:], k_idx, w_idx[:, -512:], TOPK)[0]
    chosen = torch.zeros(2, 512, seq, dtype=torch.bool, device="cuda")
    chosen[0].scatter_(1, idx[0, -512:].long(), True)
    chosen[1].scatter_(1, ref_idx.long(), True)
    same = ((chosen[0] & chosen[1]).sum() / chosen[1].sum()).item()
    print(f"seq {seq}, {heads} heads: {same:.4%} of the reference's top-k picks (last 512 queries) are the kernel's")
    assert same > 0.99

    # sparse MLA attention, forward and backward
    qf, kvf = q.clone().requires_grad_(), kv.clone().requires_grad_()
    out = sparse_mla_attention(qf, kvf, idx, scale, D_V)
    dout = torch.zeros_like(out)
    dout[:, sel] = torch.randn(1, sel.numel(), heads, D_V, device="cuda").to(torch.bfloat16)
    out.backward(dout)
    qr, kvr = q.clone().requires_grad_(), kv.clone().requires_grad_()
    ref = dsa.sparse_mla_attention(qr[:, sel], kvr, idx[:, sel], scale, D_V)
    ref.backward(dout[:, sel])
    errs = dict(out=_rel(out[:, sel], ref), dq=_rel(qf.grad[:, sel], qr.grad[:, sel]), dkv=_rel(kvf.grad, kvr.grad))
    print(f"seq {seq}, {heads} heads: sparse MLA relative errors vs reference {errs}")
    assert all(e < 2e-2 for e in errs.values()), errs

    # the sparse-stage indexer loss, forward and backward
    leaves = [t.clone().requires_grad_() for t in (q_idx, k_idx, w_idx)]
    loss = dsa_indexer_loss(*leaves, q, kv, scale, idx)
    dl = torch.zeros(1, seq, device="cuda")
    dl[:, sel] = 1.0 / sel.numel()
    loss.backward(dl)
    refs = [t.clone().requires_grad_() for t in (q_idx, k_idx, w_idx)]
    want = dsa.dsa_indexer_loss(refs[0][:, sel], refs[1], refs[2][:, sel], q[:, sel], kv, scale, indices=idx[:, sel])
    want.backward(dl[:, sel])
    errs = dict(
        loss=_rel(loss[:, sel], want), dq_idx=_rel(leaves[0].grad[:, sel], refs[0].grad[:, sel]),
        dk_idx=_rel(leaves[1].grad, refs[1].grad), dw_idx=_rel(leaves[2].grad[:, sel], refs[2].grad[:, sel]),
    )
    print(f"seq {seq}, {heads} heads: indexer loss relative errors vs reference {errs}")
    assert all(e < 3e-2 for e in errs.values()), errs


@pytest.mark.parametrize("seq, heads", [(8192, 128)])
def test_absorbed_sparse_mla_matches_the_reference(seq, heads):
    """The op DSAttention's sparse stage runs (queries absorbed per chunk inside it), bf16 at
    DeepSeek-V3.2's sizes: output, log-sum-exp (the indexer loss's one-pass target takes it) and
    the grads of the per-head queries, the latent rows and both up-projections against the fp32
    reference on the selected queries."""
    from loongforge.kernels.dsa_indexer import dsa_indexer_topk
    from loongforge.kernels.sparse_mla_absorbed import sparse_mla_absorbed_attention

    q, kv, q_idx, k_idx, w_idx, sel = _problem(seq, heads, seed=1)
    g = torch.Generator(device="cuda").manual_seed(2)
    d_nope, d_vh = 128, 128
    q_nope = torch.randn(1, seq, heads, d_nope, device="cuda", generator=g).to(torch.bfloat16)
    w_uk = (torch.randn(heads, d_nope, D_V, device="cuda", generator=g) * d_nope**-0.5).to(torch.bfloat16)
    w_uv = (torch.randn(heads, d_vh, D_V, device="cuda", generator=g) * D_V**-0.5).to(torch.bfloat16)
    tensors = [q_nope, q[..., D_V:].contiguous(), kv, w_uk, w_uv]
    scale = (d_nope + D_ROPE) ** -0.5
    idx = dsa_indexer_topk(q_idx, k_idx, w_idx, TOPK)

    leaves = [t.clone().requires_grad_() for t in tensors]
    out, lse = sparse_mla_absorbed_attention(*leaves[:3], idx, *leaves[3:], scale, return_lse=True)
    dout = torch.zeros_like(out)
    dout[:, sel] = torch.randn(1, sel.numel(), heads, d_vh, device="cuda").to(torch.bfloat16)
    out.backward(dout)
    refs = [t.float().clone().requires_grad_() for t in tensors]
    sub = [refs[0][:, sel], refs[1][:, sel], refs[2]]
    want, want_lse = dsa.sparse_mla_absorbed_attention(*sub, idx[:, sel], *refs[3:], scale, return_lse=True)
    want.backward(dout[:, sel].float())
    errs = dict(out=_rel(out[:, sel], want), dq_nope=_rel(leaves[0].grad[:, sel], refs[0].grad[:, sel]),
                dq_rope=_rel(leaves[1].grad[:, sel], refs[1].grad[:, sel]), dkv=_rel(leaves[2].grad, refs[2].grad),
                dw_uk=_rel(leaves[3].grad, refs[3].grad), dw_uv=_rel(leaves[4].grad, refs[4].grad),
                lse=_rel(lse[:, sel], want_lse))
    print(f"seq {seq}, {heads} heads: absorbed sparse MLA relative errors vs the fp32 reference {errs}")
    assert all(e < 2e-2 for e in errs.values()), errs


@pytest.mark.parametrize("seq, heads", [(8192, 128)])
def test_one_pass_target_matches_the_two_pass_one_and_the_reference(seq, heads):
    """The indexer loss's target from the attention forward's log-sum-exp (one pass over the
    logits) at DeepSeek-V3.2's sizes in bf16: against the target that recomputes the log-sum-exp
    (two passes: the same logits, so nearly bit for bit) and the fp32 reference on the selected
    queries; then the sparse-stage loss and its grads with that log-sum-exp against the reference."""
    from loongforge.kernels.dsa_indexer import dsa_indexer_loss, dsa_indexer_topk
    from loongforge.kernels.sparse_mla import head_mean_probs, sparse_mla_attention

    q, kv, q_idx, k_idx, w_idx, sel = _problem(seq, heads, seed=3)
    scale = (128 + D_ROPE) ** -0.5
    idx = dsa_indexer_topk(q_idx, k_idx, w_idx, TOPK)
    with torch.no_grad():
        _, lse = sparse_mla_attention(q, kv, idx, scale, D_V, return_lse=True)
    _, ref_lse = dsa.sparse_mla_attention(q[:, sel].float(), kv.float(), idx[:, sel], scale, D_V, return_lse=True)
    lse_err = (lse[:, sel] - ref_lse).abs().max().item()
    one_pass = head_mean_probs(q, kv, idx, scale, lse)
    two_pass = head_mean_probs(q, kv, idx, scale)
    sub = dsa._gather_rows(kv.float(), idx[:, sel])
    logits = torch.einsum("bthd,btkd->bthk", q[:, sel].float(), sub) * scale
    valid = (idx[:, sel] >= 0)[:, :, None, :]
    want = torch.softmax(logits.masked_fill(~valid, float("-inf")), -1).nan_to_num(0.0).mean(2)
    errs = dict(lse_abs=lse_err, vs_two_pass=_rel(one_pass, two_pass), vs_reference=_rel(one_pass[:, sel], want))
    print(f"seq {seq}, {heads} heads: one-pass target errors {errs}")
    assert lse_err < 2e-2 and errs["vs_two_pass"] < 1e-4 and errs["vs_reference"] < 2e-2, errs
    assert (one_pass[idx < 0] == 0).all()

    leaves = [t.clone().requires_grad_() for t in (q_idx, k_idx, w_idx)]
    loss = dsa_indexer_loss(*leaves, q, kv, scale, idx, lse)
    dl = torch.zeros(1, seq, device="cuda")
    dl[:, sel] = 1.0 / sel.numel()
    loss.backward(dl)
    refs = [t.clone().requires_grad_() for t in (q_idx, k_idx, w_idx)]
    want_loss = dsa.dsa_indexer_loss(refs[0][:, sel], refs[1], refs[2][:, sel], q[:, sel], kv, scale,
                                     indices=idx[:, sel])
    want_loss.backward(dl[:, sel])
    errs = dict(
        loss=_rel(loss[:, sel], want_loss), dq_idx=_rel(leaves[0].grad[:, sel], refs[0].grad[:, sel]),
        dk_idx=_rel(leaves[1].grad, refs[1].grad), dw_idx=_rel(leaves[2].grad[:, sel], refs[2].grad[:, sel]),
    )
    print(f"seq {seq}, {heads} heads: indexer loss with the one-pass target, relative errors vs reference {errs}")
    assert all(e < 3e-2 for e in errs.values()), errs

"""The MLA + DSA attention module: sparse with k = S equals dense MLA; the indexer loss trains only the indexer."""

from __future__ import annotations

import pytest
import torch

from loongforge.core.accelerators.cpu import CpuAccelerator
from loongforge.core.kernels import KernelPolicy
from loongforge.llm.families.dsa_attention import DSAConfig, DSAttention

TIGHT = dict(rtol=1e-5, atol=1e-5)


def _tiny(topk: int) -> DSAConfig:
    return DSAConfig(
        hidden_size=64, num_heads=2, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=16, index_n_heads=2, index_head_dim=16, index_topk=topk,
    )


def _module(topk: int, seed: int = 0) -> DSAttention:
    torch.manual_seed(seed)
    m = DSAttention(_tiny(topk), kernels=KernelPolicy(force_reference=True))
    with torch.no_grad():  # non-trivial norms, so a mix-up of weights shows
        m.q_norm.uniform_(0.5, 1.5)
        m.kv_norm.uniform_(0.5, 1.5)
    return m


def _grads(m: DSAttention) -> dict[str, torch.Tensor | None]:
    return {n: None if p.grad is None else p.grad.clone() for n, p in m.named_parameters()}


def test_sparse_attention_over_every_key_equals_dense_mla():
    x = torch.randn(2, 10, 64)
    dense_m, sparse_m = _module(topk=10), _module(topk=10)
    dy = torch.randn(2, 10, 64)
    out_dense, no_loss = dense_m(x, mode="dense")
    out_sparse, _ = sparse_m(x, mode="sparse")
    assert no_loss is None
    torch.testing.assert_close(out_sparse, out_dense, **TIGHT)
    out_dense.backward(dy)
    out_sparse.backward(dy)
    g_dense, g_sparse = _grads(dense_m), _grads(sparse_m)
    indexer = {n for n, _ in sparse_m.named_parameters() if "index" in n}
    for name, g in g_dense.items():
        if name in indexer:
            assert g is None and g_sparse[name] is None  # the LM loss never reaches the indexer
        else:
            torch.testing.assert_close(g_sparse[name], g, **TIGHT)


def test_indexer_loss_trains_only_the_indexer_and_matches_between_stages():
    x = torch.randn(1, 9, 64)
    warm_m, sparse_m = _module(topk=9, seed=1), _module(topk=9, seed=1)
    _, warm_loss = warm_m(x, mode="warmup")
    _, sparse_loss = sparse_m(x, mode="sparse")
    assert warm_loss.dim() == 0 and warm_loss > 0
    torch.testing.assert_close(sparse_loss, warm_loss, **TIGHT)  # k = S: the selected keys are all keys
    warm_loss.backward()
    sparse_loss.backward()
    indexer = {id(p) for p in warm_m.indexer_parameters()}
    for (name, p), q in zip(warm_m.named_parameters(), sparse_m.parameters()):
        if id(p) in indexer:
            assert p.grad is not None and p.grad.abs().sum() > 0, name
            torch.testing.assert_close(q.grad, p.grad, **TIGHT)
        else:
            assert p.grad is None, name


def test_a_small_topk_changes_the_output():
    x = torch.randn(1, 12, 64)
    full, _ = _module(topk=12)(x, mode="sparse")
    few, loss = _module(topk=3)(x, mode="sparse")
    assert torch.isfinite(loss)
    torch.testing.assert_close(few[:, :3], full[:, :3], **TIGHT)  # the first 3 queries see at most 3 keys
    assert (few[:, 3:] - full[:, 3:]).abs().max() > 1e-3


def test_config_and_mode_errors_name_the_value():
    with pytest.raises(ValueError, match="index_head_dim=4"):
        DSAConfig(hidden_size=8, num_heads=1, index_head_dim=4, qk_rope_head_dim=8)
    with pytest.raises(ValueError, match="mode must be"):
        _module(topk=2)(torch.randn(1, 2, 64), mode="full")


class _TritonCapableCpu(CpuAccelerator):
    """Stands in for a GPU accelerator: the registry hands out the fused ops (run interpreted here)."""

    def supports_triton(self) -> bool:
        return True


def test_sparse_mode_with_the_fused_kernels_equals_the_references():
    """The module's sparse stage through the fused ops (top-k, absorbed sparse attention, the
    chunked indexer loss) against the same weights through the torch references: output, indexer
    loss and every parameter's grad. k = S, so that both select the same keys (the fused top-k may
    break the ReLU's ties differently); the ops' own tests cover k < S."""
    x = torch.randn(2, 12, 64)
    dy = torch.randn(2, 12, 64)
    ref_m = _module(topk=12, seed=2)
    fused_m = DSAttention(_tiny(12), kernels=KernelPolicy(accelerator=_TritonCapableCpu()))
    fused_m.load_state_dict(ref_m.state_dict())
    assert "kernels" in fused_m._sparse_attention.__module__
    results = []
    for m in (ref_m, fused_m):
        out, loss = m(x, mode="sparse")
        (out * dy).sum().add(loss).backward()
        results.append((out, loss, _grads(m)))
    (out, loss, grads), (out_f, loss_f, grads_f) = results
    torch.testing.assert_close(out_f, out, **TIGHT)
    torch.testing.assert_close(loss_f, loss, **TIGHT)
    for name, g in grads.items():
        torch.testing.assert_close(grads_f[name], g, **TIGHT, msg=name)

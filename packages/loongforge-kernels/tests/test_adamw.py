"""Fused adamw_step vs its torch reference, and the reference vs torch.optim.AdamW (Triton
interpreter on CPU; the GPU with TRITON_INTERPRET=0): bf16 and fp32 params, bf16 gradients into fp32
main weights, tensors that end mid-block, several steps."""

from __future__ import annotations

import pytest
import torch

from loongforge.core.kernels.adamw import adamw_step as reference
from loongforge.kernels import adamw as fused_module
from loongforge.kernels.adamw import adamw_step

HP = dict(lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)


def _state(shapes, p_dtype, g_dtype, seed=0):
    """``(params, grads, exp_avgs, exp_avg_sqs, steps)`` of fresh AdamW state."""
    g = torch.Generator(torch.get_default_device()).manual_seed(seed)
    params = [torch.randn(s, generator=g).to(p_dtype) for s in shapes]
    grads = [torch.randn(s, generator=g).to(g_dtype) for s in shapes]
    steps = [torch.zeros((), dtype=torch.float32) for _ in shapes]
    return params, grads, [torch.zeros_like(p) for p in params], [torch.zeros_like(p) for p in params], steps


def _advance(steps):
    for n in steps:
        n += 1


@pytest.mark.parametrize(("p_dtype", "g_dtype"), [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                                  (torch.float32, torch.bfloat16)])
def test_matches_the_reference_over_steps(monkeypatch, p_dtype, g_dtype):
    monkeypatch.setattr(fused_module, "BLOCK", 64)  # several blocks per tensor, tensors ending mid-block
    shapes = [(3, 50), (7,), (130,)] if p_dtype == g_dtype else [(130,)]  # (a list of one tensor too)
    ours, ref = _state(shapes, p_dtype, g_dtype), _state(shapes, p_dtype, g_dtype)
    scale = torch.tensor(0.5)
    for _ in range(3):
        _advance(ours[4])
        _advance(ref[4])
        adamw_step(*ours, **HP, grad_scale=scale)
        reference(*ref, **HP, grad_scale=scale)
    # bf16: the bias corrections (exp of n ln beta here, powf there) differ in their last fp32 bits, which
    # moves an occasional bf16 rounding by one unit (~2^-8 relative) per step
    tol = dict(rtol=1e-5, atol=1e-6) if p_dtype == torch.float32 else dict(rtol=3e-2, atol=6e-2)
    for a, b in zip(ours[0] + ours[2] + ours[3], ref[0] + ref[2] + ref[3]):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a.float(), b.float(), **tol)


@pytest.mark.parametrize(("p_dtype", "g_dtype"), [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16)])
def test_aligned_and_unaligned_tensors_in_one_call(monkeypatch, p_dtype, g_dtype):
    """Tensors on 16 bytes with a multiple of 16 elements (the launch with 16-byte accesses) beside
    ones that are not (odd sizes, and views one element into a larger buffer), in one call."""
    monkeypatch.setattr(fused_module, "BLOCK", 64)
    shapes = [(4, 32), (130,), (8, 16), (7,)]
    ours, ref = _state(shapes, p_dtype, g_dtype, seed=2), _state(shapes, p_dtype, g_dtype, seed=2)
    for lists in (ours, ref):  # a view one element in: its address is off 16 bytes in every list
        for i in range(4):  # the param and gradient: the first tensor's first 48 values; fresh moments
            buffer = torch.zeros(49, dtype=lists[i][0].dtype)
            if i < 2:
                buffer[1:].copy_(lists[i][0].flatten()[:48])
            lists[i].append(buffer[1:])
        lists[4].append(torch.zeros((), dtype=torch.float32))
    assert [fused_module._aligned(*(lst[i] for lst in ours[:4])) for i in range(5)] == [True, False, True, False,
                                                                                       False]
    for _ in range(2):
        _advance(ours[4])
        _advance(ref[4])
        adamw_step(*ours, **HP, grad_scale=torch.tensor(2.0))
        reference(*ref, **HP, grad_scale=torch.tensor(2.0))
    tol = dict(rtol=1e-5, atol=1e-6) if p_dtype == torch.float32 else dict(rtol=3e-2, atol=6e-2)
    for a, b in zip(ours[0] + ours[2] + ours[3], ref[0] + ref[2] + ref[3]):
        torch.testing.assert_close(a.float(), b.float(), **tol)


def test_reference_is_torch_adamw():
    params, grads, ms, vs, steps = _state([(5, 6), (11,)], torch.float32, torch.float32, seed=1)
    torch_params = [p.clone().requires_grad_(True) for p in params]
    opt = torch.optim.AdamW(torch_params, lr=HP["lr"], betas=(HP["beta1"], HP["beta2"]), eps=HP["eps"],
                            weight_decay=HP["weight_decay"], foreach=False)
    for _ in range(3):
        for tp, g in zip(torch_params, grads):
            tp.grad = g * 0.25
        opt.step()
        _advance(steps)
        reference(params, grads, ms, vs, steps, **HP, grad_scale=torch.tensor(0.25))
    for p, m, tp in zip(params, ms, torch_params):
        torch.testing.assert_close(p, tp.detach(), rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(m, opt.state[tp]["exp_avg"], rtol=1e-6, atol=1e-7)


def test_lists_of_different_lengths_are_refused():
    params, grads, ms, vs, steps = _state([(4,)], torch.float32, torch.float32)
    with pytest.raises(ValueError, match="adamw_step: 1 params, 0 grads"):
        adamw_step(params, [], ms, vs, steps, **HP, grad_scale=torch.tensor(1.0))


@pytest.mark.parametrize("flag", [0.0, 1.0])
def test_found_inf_skips_the_update(monkeypatch, flag):
    """``found_inf`` of 1 leaves every tensor as it was (fused and reference alike); 0 updates as without it."""
    monkeypatch.setattr(fused_module, "BLOCK", 64)
    ours, ref = _state([(4, 32), (7,)], torch.bfloat16, torch.bfloat16), _state([(4, 32), (7,)], torch.bfloat16,
                                                                                torch.bfloat16)
    before = [t.clone() for t in ours[0] + ours[2] + ours[3]]
    _advance(ours[4])
    _advance(ref[4])
    adamw_step(*ours, **HP, grad_scale=torch.tensor(1.0), found_inf=torch.tensor(flag))
    reference(*ref, **HP, grad_scale=torch.tensor(1.0), found_inf=torch.tensor(flag))
    for a, b, c in zip(ours[0] + ours[2] + ours[3], ref[0] + ref[2] + ref[3], before):
        torch.testing.assert_close(a.float(), b.float(), rtol=3e-2, atol=6e-2)
        assert torch.equal(a, c) == (flag == 1.0)


def test_plans_are_kept_and_reused_for_the_same_tensors(monkeypatch):
    """With the caller's ``plans`` dict the launch tables of a list are built once and reused while its
    tensors stay; other tensors get their own; the updates equal the reference's throughout."""
    monkeypatch.setattr(fused_module, "BLOCK", 64)
    plans: dict = {}
    ours, ref = _state([(4, 32), (130,)], torch.bfloat16, torch.bfloat16), _state([(4, 32), (130,)], torch.bfloat16,
                                                                                  torch.bfloat16)
    for _ in range(3):
        _advance(ours[4])
        _advance(ref[4])
        adamw_step(*ours, **HP, grad_scale=torch.tensor(0.5), plans=plans)
        reference(*ref, **HP, grad_scale=torch.tensor(0.5))
    assert len(plans) == 1
    (launches,) = plans.values()
    assert [launch.n_tensors for launch in launches] == [1, 1]  # the aligned tensor and the other, apart
    other = _state([(16,)], torch.bfloat16, torch.bfloat16, seed=3)
    other_ref = _state([(16,)], torch.bfloat16, torch.bfloat16, seed=3)
    _advance(other[4])
    _advance(other_ref[4])
    adamw_step(*other, **HP, grad_scale=torch.tensor(1.0), plans=plans)
    reference(*other_ref, **HP, grad_scale=torch.tensor(1.0))
    assert len(plans) == 2 and plans[next(iter(plans))] is launches
    for a, b in zip(ours[0] + ours[2] + ours[3] + other[0], ref[0] + ref[2] + ref[3] + other_ref[0]):
        torch.testing.assert_close(a.float(), b.float(), rtol=3e-2, atol=6e-2)

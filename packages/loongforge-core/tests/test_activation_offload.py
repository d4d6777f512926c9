"""Activation offloading: what an attached block saves for its backward leaves through ``pack`` (and
comes back through ``unpack``) with the step's gradients unchanged; parameters and small tensors
stay; the engines' ``train.offload_layers`` key checks its value."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from loongforge.core.training.activation_offload import ActivationOffload, offload_first
from loongforge.core.training.schema import TrainConfig


def blocks(width: int = 64, depth: int = 3) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.LayerNorm(width))
                           for _ in range(depth)])


def step(model: nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    model(x).square().mean().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def saved_bytes(model: nn.Module, x: torch.Tensor, which: list[nn.Module], min_bytes: int) -> int:
    """Bytes the blocks in ``which`` save for backward that are not parameters, counted by a hook
    of our own (the reference for what the offloader should move)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    total = 0
    active = [False]

    def pack(t):
        nonlocal total
        size = t.numel() * t.element_size()
        if active[0] and not isinstance(t, nn.Parameter) and size >= min_bytes and \
                t.untyped_storage().data_ptr() not in params:
            total += size
        return t

    handles = [b.register_forward_pre_hook(lambda m, a: active.__setitem__(0, True)) for b in which]
    handles += [b.register_forward_hook(lambda m, a, o: active.__setitem__(0, False)) for b in which]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x).square().mean().backward()
    for h in handles:
        h.remove()
    model.zero_grad(set_to_none=True)
    return total


def test_offloaded_step_equals_the_plain_step_and_moves_every_saved_activation():
    model = blocks()
    x = torch.randn(32, 64, requires_grad=True)
    expected = step(model, x)
    reference_bytes = saved_bytes(model, x, list(model[:2]), min_bytes=1024)
    assert reference_bytes > 0
    offload = ActivationOffload(torch.device("cpu"), min_bytes=1024)
    offload.attach(list(model[:2]))
    got = step(model, x)
    assert got.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=0, atol=0, msg=name)
    assert offload.reset_step() == reference_bytes
    offload.detach()
    step(model, x)
    assert offload.reset_step() == 0


def test_pack_keeps_parameters_and_small_tensors_and_moves_activations():
    model = blocks(width=64, depth=1)
    offload = ActivationOffload(torch.device("cpu"), min_bytes=1024)
    offload.attach([model[0]])
    from loongforge.core.training.activation_offload import _Group

    group = _Group(None)
    weight = model[0][0].weight
    assert offload._pack(group, weight) is weight
    small = torch.randn(4)
    assert offload._pack(group, small) is small
    big = torch.randn(64, 64)
    handle = offload._pack(group, big)
    assert handle is not big and group.saved == [handle]
    back = offload._unpack(handle)
    assert torch.equal(back, big) and back.data_ptr() != big.data_ptr()


def test_prefetch_reloads_the_block_before_while_this_one_runs_backward():
    """When block 1's backward starts, its own activations and block 0's are reloaded (block 0's
    ahead of its backward); block 2 is not offloaded."""
    model = blocks()
    offload = ActivationOffload(torch.device("cpu"), min_bytes=1024)
    offload.attach(list(model[:2]))
    reloaded_at_block1 = []
    x = torch.randn(32, 64, requires_grad=True)
    out = model[0](x)
    out = model[1](out)
    group1 = offload._last[1]
    group0 = group1.previous
    assert group0 is not None and group0.saved and group1.saved
    out.register_hook(lambda g: reloaded_at_block1.append(
        all(s.reloaded is not None for s in group0.saved)))  # runs after the offloader's hook
    model[2](out).sum().backward()
    assert reloaded_at_block1 == [True]


def test_a_tensor_saved_by_two_ops_is_reloaded_once():
    """A block input saved by two ops (each multiplies it) is moved once and brought back once for
    both backwards; the gradients are the plain step's."""
    from loongforge.core.training.activation_offload import ActivationOffload

    class TwoSaves(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Parameter(torch.randn(64)), nn.Parameter(torch.randn(64))

        def forward(self, x):
            return x * self.a + (x * self.b).sin()

    class Counting(ActivationOffload):
        reloads = 0

        def _reload(self, saved):
            if saved.reloaded is None:
                Counting.reloads += 1
            super()._reload(saved)

    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(64, 64), TwoSaves(), TwoSaves())
    x = torch.randn(32, 64, requires_grad=True)
    expected = step(model, x)
    offload = Counting(torch.device("cpu"), min_bytes=1024)
    offload.attach(list(model[1:]))
    got = step(model, x)
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=0, atol=0, msg=name)
    moved = offload.reset_step() // (32 * 64 * 4)  # each block moves x and x * b ([32, 64] fp32)
    assert moved == 4 and Counting.reloads == moved


def test_offload_layers_is_checked():
    with pytest.raises(ValueError, match="train.offload_layers=-1"):
        TrainConfig(offload_layers=-1)
    with pytest.raises(ValueError, match="train.recompute=full"):
        TrainConfig(offload_layers=2, recompute="full")
    with pytest.raises(ValueError, match="train.offload_layers=4: the model has 3 repeated blocks"):
        offload_first(list(blocks()), 4, torch.device("cpu"))
    assert offload_first(list(blocks()), 0, torch.device("cpu")) is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_offloading_lowers_peak_memory_and_keeps_gradients():
    """Four blocks of [8192, 2048] activations: offloading the first three keeps the gradients
    bitwise and lowers the step's peak device memory."""
    device = torch.device("cuda")
    model = blocks(width=2048, depth=4).to(device)
    x = torch.randn(8192, 2048, device=device, requires_grad=True)

    def peak_step():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        grads = step(model, x)
        torch.cuda.synchronize()
        return grads, torch.cuda.max_memory_allocated() - base

    step(model, x)  # warm-up: the allocator's blocks, cuBLAS workspaces
    expected, plain_peak = peak_step()
    offload = ActivationOffload(device)
    offload.attach(list(model[:3]))
    step(model, x)
    offload.reset_step()
    got, offload_peak = peak_step()
    moved = offload.reset_step()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=0, atol=0, msg=name)
    # the copies to the host lag the forward (a block's are freed once they are done), so less than
    # all that moved is off the device at the peak, but some of it is
    print(f"peak {plain_peak / 2**20:.0f} MiB plain, {offload_peak / 2**20:.0f} MiB offloaded, moved {moved / 2**20:.0f} MiB")
    assert moved > 0 and offload_peak < plain_peak, (plain_peak, offload_peak, moved)

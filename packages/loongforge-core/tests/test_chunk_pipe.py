"""ChunkPipe's autograd function: a toy causal model run in chunks gives the per-token losses and
the parameter gradients of the same model run on the whole sequence (fp64), and a data-parallel
style gradient hook fires once per parameter, not once per chunk."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from loongforge.core.training.chunk_pipe import chunked_loss


class ToyCausal(nn.Module):
    """One causal attention layer plus an MLP, losses per token: enough to carry keys and values."""

    def __init__(self, width: int = 8):
        super().__init__()
        torch.manual_seed(0)
        self.qkv = nn.Linear(width, 3 * width).double()
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.Tanh(), nn.Linear(2 * width, width)).double()

    def attend(self, x: torch.Tensor, past_k: list[torch.Tensor], past_v: list[torch.Tensor]):
        q, k, v = self.qkv(x).chunk(3, dim=-1)  # [b, c, w]
        keys, values = torch.cat([*past_k, k], dim=1), torch.cat([*past_v, v], dim=1)
        c, s = x.shape[1], keys.shape[1]
        mask = torch.ones(c, s, dtype=torch.bool).tril(s - c)
        scores = (q @ keys.transpose(1, 2)).masked_fill(~mask, float("-inf")).softmax(-1)
        h = x + scores @ values
        return (h + self.mlp(h)).square().mean(-1), k, v  # per-token "loss" [b, c]


class Chunks:
    def __init__(self, model: ToyCausal, x: torch.Tensor, chunks: int):
        self.model, self.x, self.chunks = model, x, chunks
        self.size = x.shape[1] // chunks

    def run_chunk(self, index, carried):
        rows = slice(index * self.size, (index + 1) * self.size)
        loss, k, v = self.model.attend(self.x[:, rows], [c[0] for c in carried], [c[1] for c in carried])
        return loss, [k, v]


@pytest.mark.parametrize("chunks", [1, 2, 4])
def test_chunked_loss_equals_the_whole_sequence(chunks):
    model = ToyCausal()
    x = torch.randn(2, 16, 8, dtype=torch.float64)
    weights = torch.rand(2, 16, dtype=torch.float64)  # what the loss function hands the backward
    want_loss, _, _ = model.attend(x, [], [])
    want = torch.autograd.grad((want_loss * weights).sum(), list(model.parameters()))

    fired = {}
    hooks = [p.register_post_accumulate_grad_hook(lambda p: fired.__setitem__(id(p), fired.get(id(p), 0) + 1))
             for p in model.parameters()]
    loss = chunked_loss(Chunks(model, x, chunks), list(model.parameters()))
    torch.testing.assert_close(loss, want_loss.detach(), rtol=1e-12, atol=1e-12)
    (loss * weights).sum().backward()
    for h in hooks:
        h.remove()
    for p, g in zip(model.parameters(), want):
        torch.testing.assert_close(p.grad, g, rtol=1e-10, atol=1e-12)
    assert sorted(fired.values()) == [1] * len(want)  # one accumulation per parameter, whatever the chunks


def test_chunked_loss_refuses_a_model_without_trainable_parameters():
    model = ToyCausal().requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameter"):
        chunked_loss(Chunks(model, torch.randn(1, 4, 8, dtype=torch.float64), 2), list(model.parameters()))

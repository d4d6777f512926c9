"""ChunkPipe's autograd function: a toy causal model run in chunks gives the per-token losses and
the parameter gradients of the same model run on the whole sequence (fp64), and a data-parallel
style gradient hook fires once per parameter, not once per chunk; split in two pipeline stages
over two gloo processes (forked), each stage's gradients are the whole sequence's too."""

from __future__ import annotations

import multiprocessing

import pytest
import torch
from torch import nn

from loongforge.core.training.chunk_pipe import Stage, chunked_loss


class ToyCausal(nn.Module):
    """One causal attention layer plus an MLP: enough to carry keys and values."""

    def __init__(self, width: int = 8, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.qkv = nn.Linear(width, 3 * width).double()
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.Tanh(), nn.Linear(2 * width, width)).double()

    def attend(self, x: torch.Tensor, past_k: list[torch.Tensor], past_v: list[torch.Tensor]):
        q, k, v = self.qkv(x).chunk(3, dim=-1)  # [b, c, w]
        keys, values = torch.cat([*past_k, k], dim=1), torch.cat([*past_v, v], dim=1)
        c, s = x.shape[1], keys.shape[1]
        mask = torch.ones(c, s, dtype=torch.bool).tril(s - c)
        scores = (q @ keys.transpose(1, 2)).masked_fill(~mask, float("-inf")).softmax(-1)
        h = x + scores @ values
        return h + self.mlp(h), k, v  # hidden states [b, c, w]


def token_loss(hidden: torch.Tensor) -> torch.Tensor:
    return hidden.square().mean(-1)  # per-token "loss" [b, c]


class Chunks:
    """``model``'s chunks of ``x`` (``[b, s, w]``): the first stage reads ``x``, a later one its
    input; the last stage returns per-token losses, an earlier one hidden states."""

    def __init__(self, model: ToyCausal, x: torch.Tensor, chunks: int, stage: Stage | None = None):
        self.model, self.x, self.chunks, self.stage = model, x, chunks, stage or Stage()
        self.size = x.shape[1] // chunks
        self.loss_shape = tuple(x.shape[:2])

    def input_buffer(self, index):
        return torch.empty(self.x.shape[0], self.size, self.x.shape[2], dtype=self.x.dtype)

    def run_chunk(self, index, carried, stage_input):
        rows = slice(index * self.size, (index + 1) * self.size)
        x = self.x[:, rows] if stage_input is None else stage_input
        out, k, v = self.model.attend(x, [c[0] for c in carried], [c[1] for c in carried])
        return (token_loss(out) if self.stage.last else out), [k, v]


@pytest.mark.parametrize("chunks", [1, 2, 4])
def test_chunked_loss_equals_the_whole_sequence(chunks):
    model = ToyCausal()
    x = torch.randn(2, 16, 8, dtype=torch.float64)
    weights = torch.rand(2, 16, dtype=torch.float64)  # what the loss function hands the backward
    want_loss = token_loss(model.attend(x, [], [])[0])
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


def pipeline_stage(rank: int, store: str) -> None:
    """Rank ``rank`` of two pipeline stages (one toy layer each) runs 4 chunks and checks its
    layer's gradients (and, on the last stage, the losses) against the whole sequence in one process."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    torch.manual_seed(7)
    x, weights = torch.randn(2, 16, 8, dtype=torch.float64), torch.rand(2, 16, dtype=torch.float64)
    layers = [ToyCausal(seed=0), ToyCausal(seed=1)]
    want_loss = token_loss(layers[1].attend(layers[0].attend(x, [], [])[0], [], [])[0])
    mine = layers[rank]
    want = torch.autograd.grad((want_loss * weights).sum(), list(mine.parameters()))
    stage = Stage(dist.group.WORLD)
    loss = chunked_loss(Chunks(mine, x, 4, stage), list(mine.parameters()), stage)
    if stage.last:
        torch.testing.assert_close(loss, want_loss.detach(), rtol=1e-12, atol=1e-12)
    else:
        assert not loss.any()  # the losses are the last stage's
    (loss * weights).sum().backward()
    for p, g in zip(mine.parameters(), want):
        torch.testing.assert_close(p.grad, g, rtol=1e-10, atol=1e-12)
    dist.destroy_process_group()


# forked, as DataLoader workers are, so that the stages start without importing torch again (seconds
# each on CI's two cores); each sets one intra-op thread and opens its own gloo group
@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded, use of fork:DeprecationWarning")
def test_two_pipeline_stages_give_the_gradients_of_the_whole_sequence(tmp_path):
    fork = multiprocessing.get_context("fork")
    procs = [fork.Process(target=pipeline_stage, args=(rank, str(tmp_path / "store"))) for rank in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
        if p.is_alive():  # its peer failed mid-exchange
            p.kill()
            p.join()
    assert [p.exitcode for p in procs] == [0, 0]  # a failed check prints its traceback and exits 1

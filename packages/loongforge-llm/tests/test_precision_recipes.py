"""``train.precision`` on the megatron-core engine, in one process (CPU, gloo): ``bf16-pure`` keeps
the weights, the gradient buffer and AdamW's moments in bf16, ``bf16`` (mixed) keeps fp32 main
weights and gradients beside the bf16 model; the pure run trains like the mixed one, a run killed
after a checkpoint resumes to the uninterrupted run's losses and state bitwise, and a resume with the
other recipe is refused naming the checkpoint. The engine's own gradient arithmetic (multi-tensor
norm, per-token scaling and clipping folded into the update) gives megatron's numbers."""

from __future__ import annotations

import math

import pytest
import torch

from loongforge.core.checkpoint import Checkpoint, CheckpointReadError
from loongforge.core.config import to_dict
from loongforge.llm.recipe import LLMTask, load_llm_config

STEPS = 4
TRAIN = [f"train.steps={STEPS}", "train.global_batch_size=4", "train.micro_batch_size=2", "train.seq_length=32",
         "train.warmup_steps=1", "train.lr=3e-3", "train.clip_grad=0.5", "log.interval=1", "log.progress=false",
         "log.tensorboard=false", "checkpoint.interval=2", "checkpoint.keep_last=4"]


def _trainer(ctx, run_dir, data_cache, overrides):
    """The trainer of the debug model in this process, seeded as ``lf-llm train`` seeds it."""
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from loongforge.core.training.loop import Trainer

    cfg = load_llm_config("train_debug", [*TRAIN, f"log.run_dir={run_dir}", f"data.cache_dir={data_cache}",
                                          *overrides])
    ctx.accelerator.manual_seed(cfg.train.seed)
    model_parallel_cuda_manual_seed(cfg.train.seed)
    return Trainer(LLMTask(cfg), ctx, cfg, config_record=to_dict(cfg))


@pytest.fixture(scope="module")
def data_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("llm-data")


@pytest.fixture(scope="module")
def runs(megatron_world, data_cache, tmp_path_factory):
    """An uninterrupted run of each recipe: its trainer (after the last step) and its results."""
    out = {}
    for precision in ("bf16-pure", "bf16"):
        trainer = _trainer(megatron_world, tmp_path_factory.mktemp(precision), data_cache,
                           [f"train.precision={precision}"])
        out[precision] = trainer, trainer.fit()
    return out


def test_pure_bf16_keeps_weights_grads_and_moments_in_bf16(runs):
    pure, _ = runs["bf16-pure"]
    mixed, _ = runs["bf16"]
    assert (pure.engine.precision, mixed.engine.precision) == ("pure", "mixed")
    params = list(pure.inner_model.parameters())
    assert params and all(p.dtype == torch.bfloat16 and p.main_grad.dtype == torch.bfloat16 for p in params)
    state = pure.engine.optimizer.optimizer.state
    assert all(state[p]["exp_avg"].dtype == state[p]["exp_avg_sq"].dtype == torch.bfloat16 for p in params)
    # mixed: the optimizer steps fp32 main copies, with fp32 gradients
    main = mixed.engine.optimizer.get_parameters()
    assert main and all(p.dtype == torch.float32 for p in main)
    assert all(p.main_grad.dtype == torch.float32 for p in mixed.inner_model.parameters())


def test_pure_bf16_trains_like_mixed(runs):
    (_, pure), (_, mixed) = runs["bf16-pure"], runs["bf16"]
    assert len(pure) == len(mixed) == STEPS
    assert pure[0].loss == pytest.approx(mixed[0].loss, rel=1e-3)  # the same weights and data
    assert pure[-1].loss < pure[0].loss - 0.2  # it trains
    assert pure[-1].loss == pytest.approx(mixed[-1].loss, rel=2e-2)
    assert pure[-1].loss != mixed[-1].loss


def test_grad_norm_and_clipped_update_are_megatrons(megatron_world, data_cache, tmp_path):
    """The engine's norm (one multi-tensor pass over the per-token gradient sums, over their
    count) equals megatron's own ``get_grad_norm`` of the per-token-normalised gradients, and its
    update (the normalisation and the clipping factor applied inside the optimizer step) equals
    megatron's normalise-clip-step on those gradients."""
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

    trainer = _trainer(megatron_world, tmp_path, data_cache, ["train.precision=fp32", "checkpoint.save=false"])
    engine = trainer.engine
    step = next(iter(trainer.task.steps(megatron_world, 0)))
    out = engine.forward_backward(step)
    params = engine.optimizer.get_parameters()
    before = [p.detach().clone() for p in params]
    grads = [p.grad.detach().clone() for p in params]
    # megatron's own path: finalize's per-token normalisation (the step's loss tokens: every position of the
    # pretraining batch counts), its norm, its clipping, its step
    for p in params:
        p.grad.div_(trainer.train.global_batch_size * trainer.train.seq_length)
    norm = float(engine.optimizer.get_grad_norm())
    assert out.grad_norm == pytest.approx(norm, rel=1e-6)
    assert norm > trainer.train.clip_grad  # clipping acts
    clip_grad_by_total_norm_fp32(params, trainer.train.clip_grad, norm)
    expected_grads = [p.grad.clone() for p in params]
    for p, b in zip(params, before):
        p.data.copy_(b)
    trained = engine.train_step(step, lr=1e-2)  # the same step from the same weights, then the engine's update
    assert (trained.loss, trained.grad_norm) == (out.loss, out.grad_norm)
    after = [p.detach().clone() for p in params]
    for p, b, g in zip(params, before, expected_grads):
        p.data.copy_(b)
        p.grad = g
    for group in engine.optimizer.param_groups:
        group["lr"] = 1e-2 * group.get("lr_mult", 1.0)
    state = engine.optimizer.optimizer.state
    assert all(state[p] for p in params)  # the engine's step made the moments: start them again from zero
    for p in params:
        state[p].clear()
    engine.optimizer.step_with_ready_grads()
    for p, a in zip(params, after):
        torch.testing.assert_close(p.detach(), a, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("fused", [False, True], ids=["host-check", "found-inf-on-device"])
def test_a_non_finite_step_leaves_weights_and_adamw_state(megatron_world, data_cache, tmp_path, fused):
    """A step whose loss is not finite changes nothing: with the check on the host (the optimizer
    not fused) and with torch's fused AdamW skipping it on the device (``found_inf``, as on CUDA;
    fused AdamW runs on CPU too), after a finite step has made the AdamW state."""
    trainer = _trainer(megatron_world, tmp_path, data_cache, ["train.precision=fp32", "checkpoint.save=false"])
    engine = trainer.engine
    if fused:
        for group in engine.optimizer.param_groups:
            group["foreach"], group["fused"] = False, True
    steps = iter(trainer.task.steps(megatron_world, 0))
    assert math.isfinite(engine.train_step(next(steps), lr=1e-2).loss)
    params = engine.optimizer.get_parameters()
    state = engine.optimizer.optimizer.state
    saved = [(p.detach().clone(), {k: v.clone() for k, v in state[p].items()}) for p in params]
    with torch.no_grad():
        params[0].view(-1)[0] = float("nan")  # a NaN weight: the loss and every gradient norm turn NaN
    saved[0][0].view(-1)[0] = float("nan")
    out = engine.train_step(next(steps), lr=1e-2)
    assert not math.isfinite(out.loss) and not math.isfinite(out.grad_norm)
    for p, (weight, moments) in zip(params, saved):
        torch.testing.assert_close(p.detach(), weight, equal_nan=True, rtol=0, atol=0)
        for key, value in moments.items():
            torch.testing.assert_close(state[p][key], value, rtol=0, atol=0)


def test_pure_bf16_resumes_exactly_and_refuses_the_other_recipe(runs, megatron_world, data_cache, tmp_path):
    _, uninterrupted = runs["bf16-pure"]
    first = _trainer(megatron_world, tmp_path, data_cache, ["train.precision=bf16-pure", "train.exit_interval=2"])
    first.fit()
    resumed = _trainer(megatron_world, tmp_path, data_cache, ["train.precision=bf16-pure"])
    assert resumed.resuming
    got = resumed.fit()
    assert [r.step for r in got] == [3, 4]
    assert [(r.loss, r.grad_norm) for r in got] == [(r.loss, r.grad_norm) for r in uninterrupted[2:]]
    want = Checkpoint(runs["bf16-pure"][0].last_checkpoint)
    have = Checkpoint(resumed.last_checkpoint)
    assert have.manifest["precision"] == "pure"
    assert set(have.reader.keys()) == set(want.reader.keys())
    for key in want.reader.keys():
        assert torch.equal(have.tensor(key), want.tensor(key)), key

    mixed = _trainer(megatron_world, tmp_path, data_cache, ["train.precision=bf16", "train.steps=6"])
    with pytest.raises(CheckpointReadError, match=r"manifest.json: saved by a run with the pure precision recipe; "
                                                  r"this run trains with the mixed one"):
        mixed.fit()


@pytest.mark.parametrize("main_dtype", [torch.float32, torch.bfloat16])
def test_main_grad_linear_adds_its_weight_gradient_into_main_grad(main_dtype):
    from loongforge.llm.layers.main_grad_linear import MainGradLinear

    torch.manual_seed(0)
    dtype = torch.bfloat16 if main_dtype == torch.bfloat16 else torch.float32
    x = torch.randn(3, 5, 8, dtype=dtype, requires_grad=True)
    weight = torch.randn(6, 8, dtype=dtype, requires_grad=True)
    bias = torch.randn(6, dtype=dtype, requires_grad=True)
    weight.main_grad = torch.randn(6, 8, dtype=main_dtype)
    weight.grad_added_to_main_grad = False
    before = weight.main_grad.clone()
    dy = torch.randn(3, 5, 6, dtype=dtype)
    MainGradLinear.apply(x, weight, bias).backward(dy)
    xr, wr, br = (t.detach().clone().requires_grad_(True) for t in (x, weight, bias))
    torch.nn.functional.linear(xr, wr, br).backward(dy)
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(x.grad, xr.grad, **tol)
    torch.testing.assert_close(bias.grad, br.grad, **tol)
    torch.testing.assert_close(weight.main_grad.float(), (before.float() + wr.grad.float()), **tol)
    assert weight.grad_added_to_main_grad


@pytest.mark.parametrize("main_dtype", [torch.float32, torch.bfloat16])
def test_main_grad_embedding_adds_the_rows_gradients_into_main_grad(main_dtype):
    """Repeated tokens' rows summed, untouched rows left as they were, equal to autograd's dense
    embedding gradient added to ``main_grad``."""
    from loongforge.core.kernels import reference
    from loongforge.llm.layers.main_grad_embedding import MainGradEmbeddingLookup

    torch.manual_seed(0)
    dtype = main_dtype
    ids = torch.tensor([[3, 1, 3, 7], [0, 3, 1, 9]])
    weight = torch.randn(12, 8, dtype=dtype, requires_grad=True)
    weight.main_grad = torch.randn(12, 8, dtype=main_dtype)
    weight.grad_added_to_main_grad = False
    before = weight.main_grad.clone()
    dy = torch.randn(2, 4, 8, dtype=dtype)
    out = MainGradEmbeddingLookup.apply(ids, weight, reference.embedding_grad_add)
    wr = weight.detach().clone().requires_grad_(True)
    ref = torch.nn.functional.embedding(ids, wr)
    assert torch.equal(out, ref)
    out.backward(dy)
    ref.backward(dy)
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(weight.main_grad.float(), before.float() + wr.grad.float(), **tol)
    untouched = [i for i in range(12) if i not in ids]
    assert torch.equal(weight.main_grad[untouched], before[untouched])
    assert weight.grad_added_to_main_grad


def test_engine_step_embedding_gradient_equals_autograds(megatron_world, data_cache, tmp_path):
    """The embedding's gradient the engine's schedule adds into ``main_grad`` (the rows alone) equals
    autograd's dense gradient of the same micro-batches' loss, taken outside the schedule."""
    trainer = _trainer(megatron_world, tmp_path, data_cache, ["train.precision=fp32", "checkpoint.save=false"])
    engine = trainer.engine
    step = next(iter(trainer.task.steps(megatron_world, 0)))
    engine.forward_backward(step)
    table = engine.inner_model.embedding.word_embeddings
    assert table.weight.grad_added_to_main_grad
    fused = table.weight.main_grad.clone()
    total = torch.zeros(())
    for batch in step.micro_batches:
        out, loss_fn = trainer.task.forward(engine.model, batch)
        total = total + loss_fn(out)[0]
    (dense,) = torch.autograd.grad(total, [table.weight])
    torch.testing.assert_close(fused, dense, rtol=1e-5, atol=1e-6)  # (fp32 sums of repeated rows, in another order)


def test_fast_layers_accumulate_into_main_grad(runs):
    from loongforge.llm.layers.main_grad_embedding import MainGradVocabParallelEmbedding
    from loongforge.llm.layers.main_grad_linear import MainGradColumnParallelLinear, MainGradRowParallelLinear

    trainer, _ = runs["bf16-pure"]
    linears = [m for m in trainer.inner_model.modules()
               if isinstance(m, MainGradColumnParallelLinear | MainGradRowParallelLinear)]
    assert len(linears) == 4 * trainer.cfg.model.num_layers  # qkv, proj, fc1, fc2
    assert all(m.weight.grad_added_to_main_grad for m in linears)  # the last step's GEMMs added into main_grad
    table = trainer.inner_model.embedding.word_embeddings
    assert not trainer.inner_model.share_embeddings_and_output_weights
    assert isinstance(table, MainGradVocabParallelEmbedding) and table.weight.grad_added_to_main_grad


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_fused_adamw_update_is_megatrons_step(megatron_world, data_cache, tmp_path, precision, monkeypatch):
    """The engine's CUDA update (loongforge-kernels' adamw_step, interpreted here; in mixed precision
    the model weights then refreshed from the main weights) gives what megatron's step gives on the
    same gradients: torch's AdamW on the main weights, then megatron's copy into the model."""
    from loongforge.core.training import grad_update
    from loongforge.kernels import adamw as fused
    from loongforge.kernels.adamw import adamw_step

    monkeypatch.setattr(fused, "BLOCK", 2**16)  # few, large programs: what the interpreter runs fastest
    trainer = _trainer(megatron_world, tmp_path, data_cache, [f"train.precision={precision}", "checkpoint.save=false"])
    engine = trainer.engine
    assert grad_update.adamw_applies(engine.optimizer)
    engine.forward_backward(next(iter(trainer.task.steps(megatron_world, 0))))
    main, model = engine.optimizer.get_parameters(), list(trainer.inner_model.parameters())
    saved = [p.detach().clone() for p in main], [p.grad.clone() for p in main], [p.detach().clone() for p in model]
    multiplier = torch.tensor(0.3)

    def restore():
        for p, value, grad in zip(main, saved[0], saved[1]):
            p.data.copy_(value)
            p.grad = grad.clone()
        for p, value in zip(model, saved[2]):
            p.data.copy_(value)
        engine.optimizer.optimizer.state.clear()

    grad_update.adamw_update(engine.optimizer, multiplier, adamw_step)
    ours = [p.detach().clone() for p in main], [p.detach().clone() for p in model]
    assert not all(torch.equal(a, b) for a, b in zip(ours[1], saved[2]))  # the model weights moved
    restore()
    grad_update.scale_into_step(engine.optimizer, multiplier, engine.optimizer.step_with_ready_grads)
    for got, want in zip(ours[0], main):
        torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-6)
    for got, want in zip(ours[1], model):  # bf16 model weights: the same values rounded
        torch.testing.assert_close(got.float(), want.detach().float(), rtol=1e-2, atol=1e-5)

"""Blockwise FP8 training (the ``fp8`` key): the FP8 linears compute the reference ``fp8_linear``
numbers through megatron's parallel-linear forwards (with the GEMMs their plan puts in FP8); the
fast spec puts them in QKV, attention output and MLP fc1/fc2 only; the debug model trains to
within 1% of the loss of its fp32 run (and not to the same numbers); TP=2 gives what one process
gives; bad modes are refused. fp8=adaptive: the task measures its plan once (a fake timer here:
CPUs have no FP8 GEMM to time, and the real timer refuses them), every rank of a TP=2 world ends
with the same plan, the plan is saved in the checkpoint manifest and a resumed run reuses it
without measuring, while ``checkpoint.load`` (weights only) measures again."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from loongforge.core.config import ConfigError, to_dict
from loongforge.core.kernels.fp8_format import ALL_FP8, Fp8Gemms
from loongforge.llm.layers.fp8_linear import (
    Fp8ColumnParallelLinear, Fp8RowParallelLinear, adaptive_fp8_linears, apply_fp8_plan, fp8_linears,
)
from loongforge.llm.layers.fp8_plan import FP8Plan, ShapePlan
from loongforge.llm.ops.fp8_blockwise import fp8_linear
from loongforge.llm.recipe import LLMTask, load_llm_config

STEPS = 20
TRAIN = [f"train.steps={STEPS}", "train.global_batch_size=8", "train.micro_batch_size=8", "train.seq_length=64",
         "train.warmup_steps=2", "train.precision=fp32", "log.interval=1", "log.progress=false",
         "log.tensorboard=false", "checkpoint.save=false", "checkpoint.resume=false"]


@pytest.fixture
def reference_kernels(monkeypatch):
    """The registry's torch reference for every op, wherever the test runs."""
    monkeypatch.setenv("LOONGFORGE_KERNELS", "reference")


def _transformer_config(**overrides):
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(**{"num_layers": 1, "hidden_size": 64, "num_attention_heads": 4, **overrides},
                             params_dtype=torch.float32, use_cpu_initialization=True)


def _check_against_reference(layer, x, bias):
    """``layer``'s output and gradients (input, weight, bias) vs ``fp8_linear`` called directly
    with the layer's GEMM choice."""
    x = x.clone().requires_grad_()
    out, out_bias = layer(x)
    assert out_bias is None
    dy = torch.randn_like(out)
    out.backward(dy)

    ref_x = x.detach().clone().requires_grad_()
    ref_w = layer.weight.detach().clone().requires_grad_()
    ref_b = layer.bias.detach().clone().requires_grad_() if bias else None
    ref = fp8_linear(ref_x, ref_w, ref_b, gemms=layer.fp8_gemms)
    ref.backward(dy)

    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    torch.testing.assert_close(x.grad, ref_x.grad, rtol=0, atol=0)
    torch.testing.assert_close(layer.weight.grad, ref_w.grad, rtol=0, atol=0)
    if bias:
        torch.testing.assert_close(layer.bias.grad, ref_b.grad, rtol=0, atol=0)
    exact = F.linear(x.detach(), layer.weight.detach(), layer.bias.detach() if bias else None)
    if layer.fp8_gemms.fprop:  # FP8 rounding really happened: far from the exact fp32 product
        assert (out.detach() - exact).abs().max() > 1e-3 * exact.abs().max()
    else:  # the input dtype's product
        torch.testing.assert_close(out.detach(), exact)


def _linears(adaptive: bool):
    config = _transformer_config(add_bias_linear=True)
    torch.manual_seed(0)
    column = Fp8ColumnParallelLinear(160, 200, config=config, init_method=config.init_method, bias=True,
                                     gather_output=False, adaptive=adaptive)
    row = Fp8RowParallelLinear(200, 96, config=config, init_method=config.init_method, bias=False,
                               input_is_parallel=True, skip_bias_add=False, adaptive=adaptive)
    with torch.no_grad():
        column.bias.normal_()
    return column, row


@pytest.mark.parametrize("adaptive", [False, True], ids=["blockwise", "adaptive"])
def test_fp8_linears_compute_the_reference(adaptive, megatron_world, reference_kernels):
    """Column- (with bias) and row-parallel FP8 linears: K and N not multiples of the 128 block;
    adaptive ones run the GEMMs the run's plan gives their weight shape in FP8."""
    column, row = _linears(adaptive)
    assert column.fp8_adaptive is adaptive and row.fp8_adaptive is adaptive
    if adaptive:
        plan = FP8Plan((ShapePlan(200, 160, Fp8Gemms(fprop=True, dgrad=False, wgrad=True)),
                        ShapePlan(96, 200, Fp8Gemms(fprop=False, dgrad=True, wgrad=False))))
        assert apply_fp8_plan(torch.nn.ModuleList([column, row]), plan) == 2
        assert column.fp8_shape() == (200, 160) and column.fp8_gemms == plan.gemms(200, 160)
        assert "fp8=adaptive (dgrad in FP8)" in repr(row)
    else:
        assert column.fp8_gemms == row.fp8_gemms == ALL_FP8
    _check_against_reference(column, torch.randn(12, 2, 160), bias=True)
    _check_against_reference(row, torch.randn(12, 2, 200), bias=False)


def test_adaptive_fp8_linear_without_a_plan_refuses_to_run(megatron_world, reference_kernels):
    column, _ = _linears(adaptive=True)
    assert "fp8=adaptive (no plan in FP8)" in repr(column)
    with pytest.raises(RuntimeError, match=r"fp8=adaptive, weight 200x160\) has no FP8 plan"):
        column(torch.randn(4, 1, 160))
    with pytest.raises(LookupError, match="no entry for a linear of weight 200x160"):
        apply_fp8_plan(column, FP8Plan((ShapePlan(96, 200, ALL_FP8),)))



def test_fp8_linear_refuses_deferred_weight_gradients(megatron_world):
    """megatron's deferred weight-gradient GEMMs have no FP8 path: building the layer says so."""
    config = _transformer_config(add_bias_linear=False)
    config.defer_embedding_wgrad_compute = True  # megatron validates it only together with PP > 1
    with pytest.raises(ValueError, match=r"Fp8ColumnParallelLinear: deferred weight-gradient GEMMs"):
        Fp8ColumnParallelLinear(160, 200, config=config, init_method=config.init_method, bias=False,
                                gather_output=False)

def _gpt(fp8: str):
    from loongforge.llm.families.gpt import layer_spec
    from loongforge.llm.layers.gpt_model import FusedLossGPTModel
    from loongforge.llm.model_config import GPTConfig

    config = _transformer_config(num_layers=2, num_query_groups=2, ffn_hidden_size=128, normalization="RMSNorm",
                                 gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False)
    with fp8_linears(fp8):
        spec = layer_spec(GPTConfig())
    model = FusedLossGPTModel(config=config, transformer_layer_spec=spec, vocab_size=256, max_sequence_length=64,
                              position_embedding_type="rope")
    if fp8 == "adaptive":  # a plan given explicitly: fprop and wgrad in FP8, dgrad not
        gemms = Fp8Gemms(fprop=True, dgrad=False, wgrad=True)
        shapes = {m.fp8_shape() for m in adaptive_fp8_linears(model)}
        apply_fp8_plan(model, FP8Plan(tuple(ShapePlan(o, i, gemms) for o, i in shapes)))
    return model


@pytest.mark.parametrize("mode", ["blockwise", "adaptive"])
def test_fast_spec_puts_fp8_in_the_dense_gemms_only(mode, megatron_world, reference_kernels):
    torch.manual_seed(0)
    ours, plain = _gpt(mode), _gpt("none")
    fp8 = {n: m for n, m in ours.named_modules() if isinstance(m, (Fp8ColumnParallelLinear, Fp8RowParallelLinear))}
    expected = {f"decoder.layers.{i}.{name}" for i in range(2)
                for name in ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")}
    assert set(fp8) == expected  # not the embedding, not the output layer
    assert all(m.fp8_adaptive is (mode == "adaptive") for m in fp8.values())
    assert all(m.fp8_gemms == (ALL_FP8 if mode == "blockwise" else Fp8Gemms(True, False, True)) for m in fp8.values())
    assert not any(isinstance(m, (Fp8ColumnParallelLinear, Fp8RowParallelLinear)) for m in plain.modules())
    # the same parameters: the weights of either load into the other
    ours.load_state_dict(plain.state_dict(), strict=True)

    g = torch.Generator().manual_seed(1)
    tokens, labels = torch.randint(0, 256, (2, 32), generator=g), torch.randint(0, 256, (2, 32), generator=g)
    positions = torch.arange(32).expand(2, 32)
    loss_fp8 = ours(tokens, positions, None, labels=labels).mean()
    loss = plain(tokens, positions, None, labels=labels).mean()
    assert loss_fp8.item() == pytest.approx(loss.item(), rel=1e-2)
    assert loss_fp8.item() != loss.item()


def _trainer(ctx, run_dir, data_cache, overrides, make_task=LLMTask):
    """The trainer of the debug model in this process (``STEPS`` steps unless overridden),
    initialised as ``lf-llm train`` does."""
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from loongforge.core.training.loop import Trainer

    cfg = load_llm_config("train_debug", [*TRAIN, f"log.run_dir={run_dir}", f"data.cache_dir={data_cache}", *overrides])
    ctx.accelerator.manual_seed(cfg.train.seed)  # the seeding of init_parallel, so every run starts alike
    model_parallel_cuda_manual_seed(cfg.train.seed)
    return Trainer(make_task(cfg), ctx, cfg, config_record=to_dict(cfg))


def _train(ctx, run_dir, data_cache, overrides) -> list:
    return _trainer(ctx, run_dir, data_cache, overrides).fit()


@pytest.fixture(scope="module")
def data_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("llm-data")


@pytest.fixture(scope="module")
def runs(megatron_world, data_cache, tmp_path_factory):
    """The fp32 run and the fp8=blockwise run of the debug model, one process."""
    root = tmp_path_factory.mktemp("runs")
    return {mode: _train(megatron_world, root / mode, data_cache, [f"fp8={mode}"]) for mode in ("none", "blockwise")}


def test_blockwise_fp8_trains_like_fp32(runs):
    fp32, fp8 = runs["none"], runs["blockwise"]
    assert len(fp32) == len(fp8) == STEPS
    assert fp8[-1].loss < fp8[0].loss - 1.0  # it trains
    assert fp8[-1].loss == pytest.approx(fp32[-1].loss, rel=1e-2)
    assert fp8[-1].loss != fp32[-1].loss  # and FP8 really ran
    assert fp8[0].grad_norm != fp32[0].grad_norm


@pytest.mark.slow
def test_tp2_fp8_matches_one_process(runs, data_cache, tmp_path):
    """TP=2 splits the weights, so FP8 blocks (and roundings) differ from one process: the first
    step's gradient norm (which a missing TP reduction would change) and the final loss agree to
    FP8 accuracy, not bit for bit."""
    from cli_runner import run_cli

    proc = run_cli(["lf-llm", "train", *TRAIN, f"log.run_dir={tmp_path}", f"data.cache_dir={data_cache}",
                    "fp8=blockwise", "parallel.tp=2"], nproc=2)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    tp2 = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    one = runs["blockwise"]
    assert len(tp2) == STEPS
    assert tp2[0]["grad_norm"] == pytest.approx(one[0].grad_norm, rel=1e-2)
    assert tp2[-1]["loss"] == pytest.approx(one[-1].loss, rel=1e-2)


def test_bad_fp8_modes_are_refused(megatron_world, tmp_path):
    with pytest.raises(ConfigError, match=r"fp8='fp16': one of none, blockwise, adaptive"):
        load_llm_config("train_debug", ["fp8=fp16"])
    with pytest.raises(ValueError, match=r"fp8='e4m3': one of none, blockwise, adaptive"):
        with fp8_linears("e4m3"):
            pass
    # a model whose layers have no FP8 path (DeepSeek-V3.2's DSA layers) says so instead of training in bf16
    cfg = load_llm_config("train_deepseek_v3_2_debug", ["fp8=blockwise", f"data.cache_dir={tmp_path}"])
    task = LLMTask(cfg)
    from megatron.core.transformer import TransformerConfig

    config = TransformerConfig(**task.transformer_config_kwargs(), params_dtype=torch.float32,
                               use_cpu_initialization=True)
    with pytest.raises(ValueError, match=r"fp8='blockwise': model.family='deepseek_v3' builds no FP8 linear"):
        task.build_model(megatron_world, config, True, True)


@pytest.mark.parametrize("config", ["train_qwen3_moe_debug", "train_deepseek_v3_debug"])
def test_moe_layers_train_in_fp8_like_fp32(config, megatron_world, data_cache, tmp_path, reference_kernels):
    """fp8=blockwise on the MoE families: every routed expert's fc1/fc2, the shared experts, the dense
    MLPs and the attention projections (MLA's up ones) are FP8 linears, the router is not;
    a few steps train to fp32's loss within FP8 accuracy."""
    from megatron.core.transformer.moe.router import TopKRouter

    from loongforge.core.training.loop import Trainer
    from loongforge.llm.layers.fp8_linear import count_fp8_linears

    def run(mode):
        cfg = load_llm_config(config, [*TRAIN, f"log.run_dir={tmp_path / mode}", f"data.cache_dir={data_cache}",
                                       f"fp8={mode}"])
        megatron_world.accelerator.manual_seed(cfg.train.seed)
        trainer = Trainer(LLMTask(cfg), megatron_world, cfg)
        return trainer, trainer.fit()

    fp8_trainer, fp8 = run("blockwise")
    model = fp8_trainer.engine.inner_model
    cfg = fp8_trainer.task.cfg.model
    experts = sum(1 for name, _ in model.named_modules() if ".experts.local_experts." in name and name.endswith("linear_fc1"))
    assert experts == cfg.num_experts * (cfg.num_layers - cfg.first_k_dense)
    assert count_fp8_linears(model) > 2 * experts  # the experts and the attention/dense/shared linears
    assert not any(type(m).__name__.startswith("Fp8") for r in model.modules() if isinstance(r, TopKRouter)
                   for m in r.modules())
    _, fp32 = run("none")
    assert fp8[-1].loss < fp8[0].loss and fp8[-1].loss == pytest.approx(fp32[-1].loss, rel=2e-2)
    assert fp8[0].grad_norm != fp32[0].grad_norm  # FP8 really ran


# -- fp8=adaptive: the run's plan ---------------------------------------------------------------
DEBUG_SHAPES = [(64, 64), (64, 128), (128, 64), (256, 64)]  # proj, fc2, qkv, fc1 of the debug Llama at TP=1


def fake_ms(tokens, out_features, in_features, gemms) -> float:
    """A fake timing: each GEMM in FP8 saves 1 ms, except dgrad at outputs of 64 (5 ms more)."""
    return 10.0 - len(gemms.names()) + (5.0 if gemms.dgrad and out_features == 64 else 0.0)


class FakeTimedTask(LLMTask):
    """``LLMTask`` timing fp8=adaptive's shapes with ``timer`` (default :func:`fake_ms`), each call recorded."""

    def __init__(self, cfg, timer=fake_ms):
        super().__init__(cfg)
        self.timings, self._timer = [], timer

    def fp8_timer(self, ctx, dtype):
        def timer(*call):
            self.timings.append(call)
            return self._timer(*call)

        return timer


def _linear_gemms(trainer) -> dict:
    return {name: m.fp8_gemms for name, m in trainer.model.named_modules()
            if isinstance(m, (Fp8ColumnParallelLinear, Fp8RowParallelLinear))}


def test_adaptive_plan_is_measured_once_saved_and_reused_on_resume(megatron_world, data_cache, tmp_path):
    from loongforge.core.checkpoint import latest_checkpoint, read_manifest

    ckpts = tmp_path / "run" / "checkpoints"
    saving = ["fp8=adaptive", "checkpoint.save=true", "checkpoint.interval=2", "checkpoint.resume=true"]
    first = _trainer(megatron_world, tmp_path / "run", data_cache, [*saving, "train.steps=4"], FakeTimedTask)
    # measured when the model was built, before any step: every shape in all 8 choices at 8 x 64 tokens
    assert len(first.task.timings) == 4 * 8 and {call[:3] for call in first.task.timings} == {
        (512, o, i) for o, i in DEBUG_SHAPES}
    plan = first.task.fp8_plan
    assert [s.key for s in plan.shapes] == DEBUG_SHAPES
    assert plan.gemms(64, 64) == plan.gemms(64, 128) == Fp8Gemms(True, False, True)  # dgrad slow there
    assert plan.gemms(128, 64) == plan.gemms(256, 64) == ALL_FP8
    gemms = _linear_gemms(first)
    assert len(gemms) == 8 and gemms["module.decoder.layers.0.mlp.linear_fc2"] == Fp8Gemms(True, False, True)
    first.fit()
    assert len(first.task.timings) == 32  # never again during training
    assert FP8Plan.from_dict(read_manifest(latest_checkpoint(ckpts))["fp8_plan"]) == plan

    def never(*call):
        raise AssertionError(f"a resumed run measured {call}")

    resumed = _trainer(megatron_world, tmp_path / "run", data_cache, [*saving, "train.steps=6"],
                       lambda cfg: FakeTimedTask(cfg, timer=never))
    assert resumed.task.fp8_plan == plan and not resumed.task.timings
    assert _linear_gemms(resumed) == gemms
    assert [r.step for r in resumed.fit()] == [5, 6]
    assert FP8Plan.from_dict(read_manifest(latest_checkpoint(ckpts))["fp8_plan"]) == plan

    # checkpoint.load (initial weights only) is a new run: it measures again (here nothing is faster in FP8)
    loaded = _trainer(megatron_world, tmp_path / "load", data_cache,
                      ["fp8=adaptive", f"checkpoint.load={latest_checkpoint(ckpts)}", "train.steps=1"],
                      lambda cfg: FakeTimedTask(cfg, timer=lambda t, o, i, g: 1.0 + len(g.names())))
    assert len(loaded.task.timings) == 32
    assert set(_linear_gemms(loaded).values()) == {Fp8Gemms(False, False, False)}


def test_adaptive_without_fp8_gemms_is_refused_unless_the_plan_is_given(megatron_world, data_cache):
    """On CPU there is no FP8 GEMM to time: measuring is refused; a plan from the checkpoint a run
    resumes needs no timing, and the reference op honours it."""
    from megatron.core.transformer import TransformerConfig

    from loongforge.core.checkpoint import CheckpointReadError

    cfg = load_llm_config("train_debug", ["fp8=adaptive", f"data.cache_dir={data_cache}"])

    def build(task):
        config = TransformerConfig(**task.transformer_config_kwargs(), params_dtype=torch.float32,
                                   use_cpu_initialization=True)
        return task.build_model(megatron_world, config, True, True)

    with pytest.raises(ConfigError, match="fp8=adaptive: fp8_linear runs its torch reference here"):
        build(LLMTask(cfg))
    plan = FP8Plan(tuple(ShapePlan(o, i, Fp8Gemms(fprop=True, dgrad=False, wgrad=False)) for o, i in DEBUG_SHAPES))
    task = LLMTask(cfg)
    task.restore({"family": "llama", "fp8_plan": plan.to_dict()})
    model = build(task)
    assert task.fp8_plan == plan and task.manifest_fields() == {"fp8_plan": plan.to_dict()}
    assert {m.fp8_gemms for m in adaptive_fp8_linears(model)} == {Fp8Gemms(True, False, False)}
    # a run of another mode ignores a saved plan and saves none; a malformed one names the manifest
    blockwise = LLMTask(load_llm_config("train_debug", ["fp8=blockwise", f"data.cache_dir={data_cache}"]))
    blockwise.restore({"fp8_plan": plan.to_dict()})
    assert blockwise.fp8_plan is None and blockwise.manifest_fields() == {}
    with pytest.raises(CheckpointReadError, match="the checkpoint's manifest: fp8_plan: expected"):
        LLMTask(cfg).restore({"fp8_plan": {"version": 9}})


TP2_WORKER = """
import json, sys
import torch
from megatron.core.transformer import TransformerConfig
from loongforge.core.parallel import destroy_parallel, init_parallel
from loongforge.llm.layers.fp8_linear import adaptive_fp8_linears
from loongforge.llm.recipe import LLMTask, load_llm_config

def fake_ms(rank, tokens, out_features, in_features, gemms):
    # each FP8 GEMM saves 1 ms; on rank 1 dgrad in FP8 costs 5 ms more everywhere, on rank 0 wgrad
    # in FP8 costs 5 ms more at the 64x32 shape
    t = 10.0 - len(gemms.names())
    t += 5.0 if rank == 1 and gemms.dgrad else 0.0
    return t + (5.0 if rank == 0 and gemms.wgrad and (out_features, in_features) == (64, 32) else 0.0)

class RankTimedTask(LLMTask):
    def fp8_timer(self, ctx, dtype):
        return lambda *call: fake_ms(ctx.rank, *call)

ctx = init_parallel(tp=2, seed=1234)
cfg = load_llm_config("train_debug", ["fp8=adaptive", "train.global_batch_size=8", "train.micro_batch_size=4",
                                      "train.seq_length=64"])
task = RankTimedTask(cfg)
config = TransformerConfig(**task.transformer_config_kwargs(), tensor_model_parallel_size=2,
                           params_dtype=torch.float32, use_cpu_initialization=True)
model = task.build_model(ctx, config, True, True)
linears = sorted([list(m.fp8_shape()), list(m.fp8_gemms.names())] for m in adaptive_fp8_linears(model))
with open(f"{sys.argv[1]}/rank{ctx.rank}.json", "w") as f:
    json.dump({"plan": task.fp8_plan.to_dict(), "linears": linears}, f)
destroy_parallel()
"""


@pytest.mark.slow
@pytest.mark.long  # (the default tier's budget: test_tp2_fp8_matches_one_process runs FP8 at TP2)
def test_tp2_ranks_agree_on_one_plan(tmp_path):
    """Two TP ranks whose timings disagree end with one plan: each time is the slower rank's, and
    the choice is made from those (rank 0 alone would keep dgrad in FP8, rank 1 wgrad at 64x32)."""
    import subprocess

    from cli_runner import BINDIR, cli_env

    script = tmp_path / "worker.py"
    script.write_text(TP2_WORKER)
    proc = subprocess.run([str(BINDIR / "torchrun"), "--standalone", "--nproc-per-node=2", str(script), str(tmp_path)],
                          env=cli_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0]["plan"] == ranks[1]["plan"]
    plan = FP8Plan.from_dict(ranks[0]["plan"])
    # the TP=2 local weights: proj 64x32, qkv and fc2 64x64, fc1 128x64; timed at 4 x 64 tokens
    assert [(s.key, s.tokens) for s in plan.shapes] == [((64, 32), 256), ((64, 64), 256), ((128, 64), 256)]
    assert plan.gemms(64, 32) == Fp8Gemms(True, False, False)
    assert plan.gemms(64, 64) == plan.gemms(128, 64) == Fp8Gemms(True, False, True)
    assert plan.shapes[1].ms[-1] == 12.0  # all three in FP8: 7 ms on rank 0, 12 on rank 1
    per_layer = [(64, 32), (64, 64), (64, 64), (128, 64)]  # proj, qkv, fc2, fc1
    expected = sorted([list(key), list(plan.gemms(*key).names())] for key in per_layer * 2)
    assert ranks[0]["linears"] == ranks[1]["linears"] == expected

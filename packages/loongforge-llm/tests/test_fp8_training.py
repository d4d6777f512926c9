"""Blockwise FP8 training (the ``fp8`` key): the FP8 linears compute the reference ``fp8_linear``
numbers through megatron's parallel-linear forwards; the fast spec puts them in QKV, attention
output and MLP fc1/fc2 only; the debug model trains to within 1% of the loss of its fp32 run (and
not to the same numbers); TP=2 gives what one process gives; bad modes are refused."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from loongforge.core.config import ConfigError, to_dict
from loongforge.llm.layers.fp8_linear import Fp8ColumnParallelLinear, Fp8RowParallelLinear, fp8_linears
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
    """``layer``'s output and gradients (input, weight, bias) vs ``fp8_linear`` called directly."""
    x = x.clone().requires_grad_()
    out, out_bias = layer(x)
    assert out_bias is None
    dy = torch.randn_like(out)
    out.backward(dy)

    ref_x = x.detach().clone().requires_grad_()
    ref_w = layer.weight.detach().clone().requires_grad_()
    ref_b = layer.bias.detach().clone().requires_grad_() if bias else None
    ref = fp8_linear(ref_x, ref_w, ref_b)
    ref.backward(dy)

    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    torch.testing.assert_close(x.grad, ref_x.grad, rtol=0, atol=0)
    torch.testing.assert_close(layer.weight.grad, ref_w.grad, rtol=0, atol=0)
    if bias:
        torch.testing.assert_close(layer.bias.grad, ref_b.grad, rtol=0, atol=0)
    # FP8 rounding really happened: far from the exact fp32 product
    exact = F.linear(x.detach(), layer.weight.detach(), layer.bias.detach() if bias else None)
    assert (out.detach() - exact).abs().max() > 1e-3 * exact.abs().max()


@pytest.mark.parametrize("adaptive", [False, True], ids=["blockwise", "adaptive"])
def test_fp8_linears_compute_the_reference(adaptive, megatron_world, reference_kernels):
    """Column- (with bias) and row-parallel FP8 linears: K and N not multiples of the 128 block."""
    config = _transformer_config(add_bias_linear=True)
    torch.manual_seed(0)
    column = Fp8ColumnParallelLinear(160, 200, config=config, init_method=config.init_method, bias=True,
                                     gather_output=False, adaptive=adaptive)
    row = Fp8RowParallelLinear(200, 96, config=config, init_method=config.init_method, bias=False,
                               input_is_parallel=True, skip_bias_add=False, adaptive=adaptive)
    with torch.no_grad():
        column.bias.normal_()
    assert column.fp8_adaptive is adaptive and row.fp8_adaptive is adaptive
    _check_against_reference(column, torch.randn(12, 2, 160), bias=True)
    _check_against_reference(row, torch.randn(12, 2, 200), bias=False)



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
    return FusedLossGPTModel(config=config, transformer_layer_spec=spec, vocab_size=256, max_sequence_length=64,
                             position_embedding_type="rope")


@pytest.mark.parametrize("mode", ["blockwise", "adaptive"])
def test_fast_spec_puts_fp8_in_the_dense_gemms_only(mode, megatron_world, reference_kernels):
    torch.manual_seed(0)
    ours, plain = _gpt(mode), _gpt("none")
    fp8 = {n: m for n, m in ours.named_modules() if isinstance(m, (Fp8ColumnParallelLinear, Fp8RowParallelLinear))}
    expected = {f"decoder.layers.{i}.{name}" for i in range(2)
                for name in ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")}
    assert set(fp8) == expected  # not the embedding, not the output layer
    assert all(m.fp8_adaptive is (mode == "adaptive") for m in fp8.values())
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


def _train(ctx, run_dir, data_cache, overrides) -> list:
    """``STEPS`` steps of the debug model in this process, initialised as ``lf-llm train`` does."""
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from loongforge.core.training.loop import Trainer

    cfg = load_llm_config("train_debug", [*TRAIN, f"log.run_dir={run_dir}", f"data.cache_dir={data_cache}", *overrides])
    ctx.accelerator.manual_seed(cfg.train.seed)  # the seeding of init_parallel, so every run starts alike
    model_parallel_cuda_manual_seed(cfg.train.seed)
    trainer = Trainer(LLMTask(cfg), ctx, cfg, config_record=to_dict(cfg))
    return trainer.fit()


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
    # a family whose layers have no FP8 path says so instead of training in bf16
    cfg = load_llm_config("train_qwen3_moe_debug", ["fp8=blockwise", f"data.cache_dir={tmp_path}"])
    task = LLMTask(cfg)
    from megatron.core.transformer import TransformerConfig

    config = TransformerConfig(**task.transformer_config_kwargs(), params_dtype=torch.float32,
                               use_cpu_initialization=True)
    with pytest.raises(ValueError, match=r"fp8='blockwise': model.family='qwen3_moe' builds no FP8 linear"):
        task.build_model(megatron_world, config, True, True)

"""Qwen3.5 end to end: `lf-llm train --config qwen3_5_debug` (the hybrid debug model on the
bundled corpus, on CPU: the DeltaNet's torch reference) learns and checkpoints; a Gated DeltaNet
layer under context parallelism, and under tensor parallelism (with sequence parallelism, with
context parallelism) (processes on gloo), equals the same layer in one process; a transformers
Qwen3.5 imported at TP=2 (each rank reading its shards of the HF tensors) trains from
transformers' loss and exports back bit for bit; a TP=2 checkpoint loads at TP=1 and at PP=2."""

import json

import pytest
from cli_runner import run_cli


@pytest.mark.slow  # one CLI run, ~15 s alone (the DeltaNet reference runs in chunks)
def test_qwen3_5_debug_trains(tmp_path, llm_data_cache):
    proc = run_cli(["lf-llm", "train", "--config", "qwen3_5_debug", "train.steps=8", "train.global_batch_size=4",
                    "train.micro_batch_size=4", "train.warmup_steps=2", f"log.run_dir={tmp_path}",
                    f"data.cache_dir={llm_data_cache}", "log.interval=1", "log.tensorboard=false"])
    assert proc.returncode == 0, proc.stderr[-5000:]
    assert "qwen3_5 on cpu" in proc.stdout + proc.stderr
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 9))
    assert records[-1]["loss"] < records[0]["loss"] - 0.5
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step_00000008"


@pytest.mark.slow
@pytest.mark.parametrize("cp", [2, pytest.param(3, marks=pytest.mark.long)])
def test_delta_net_context_parallel_equals_one_process(cp):
    """A Gated DeltaNet layer under CP (gloo, sequential state passing) gives each rank the output
    rows, input gradients and (summed) parameter gradients of the whole sequences run in one
    process, for dense rows and for a packed row (one sequence's chunks shorter than the
    convolution's reach)."""
    from pathlib import Path

    from cli_runner import run_script

    proc = run_script(Path(__file__).parent / "gdn_tp_probe.py", ["1", str(cp), "0"], nproc=cp,
                      env={"LOONGFORGE_ACCELERATOR": "cpu"})
    assert proc.returncode == 0, proc.stderr[-5000:]
    assert proc.stdout.count("ok") == cp


@pytest.mark.slow
@pytest.mark.parametrize("tp, cp, sp", [(2, 1, 0), pytest.param(2, 1, 1, marks=pytest.mark.long),
                                        pytest.param(2, 2, 0, marks=pytest.mark.long)],
                         ids=["tp2", "tp2-sequence-parallel", "tp2-cp2"])
def test_delta_net_tensor_parallel_equals_one_process(tp, cp, sp):
    """A Gated DeltaNet layer split over TP ranks (whole key heads and their value heads each) starts
    from its shards of the one-process layer's weights, saves them whole in its sharded state
    dict, and gives each rank the output rows, input gradient rows and its shard of every
    parameter gradient of the whole layer, for dense rows and a packed row."""
    from pathlib import Path

    from cli_runner import run_script

    proc = run_script(Path(__file__).parent / "gdn_tp_probe.py", [str(tp), str(cp), str(sp)], nproc=tp * cp,
                      env={"LOONGFORGE_ACCELERATOR": "cpu"})
    assert proc.returncode == 0, proc.stderr[-5000:]
    assert proc.stdout.count("ok") == tp * cp


def test_delta_net_heads_that_do_not_split_are_refused_by_key():
    """Before any process starts: one error line naming the key, exit code 2."""
    from cli_runner import assert_one_error_line

    from loongforge.core.config import ConfigError
    from loongforge.llm.layers.gated_delta_net_tp import HeadShards

    proc = run_cli(["lf-llm", "train", "--config", "qwen3_5_debug", "parallel.tp=2", "model.linear_num_key_heads=1"])
    assert proc.returncode == 2
    assert_one_error_line(proc.stderr, "model.linear_num_key_heads=1", "parallel.tp=2")
    with pytest.raises(ConfigError, match=r"model.linear_num_value_heads=6 must be divisible by parallel.tp=4"):
        HeadShards(num_key_heads=4, num_value_heads=6, key_head_dim=8, value_head_dim=8, tp=4)


@pytest.mark.slow
@pytest.mark.long  # a two-process CLI run
def test_hf_import_at_tp2_trains_from_its_loss_and_exports_back(tmp_path, llm_data_cache):
    """lr=0: step 1's loss is transformers' on the same batch, and the export (from the checkpoint the
    TP=2 run saved: every DeltaNet tensor put together from its per-rank sections) is the HF state
    dict bit for bit."""
    import torch
    from hf_models import first_batch_loss, tiny_qwen3_5
    from safetensors.torch import load_file

    from loongforge.llm.data.shipped import bundled_tokenizer_path

    hf_dir, run, out = tmp_path / "hf", tmp_path / "run", tmp_path / "exported"
    model = tiny_qwen3_5(bundled_tokenizer_path(), hf_dir)
    seq, batch, steps = 32, 4, 2
    proc = run_cli(["lf-llm", "train", f"model.init_from_hf={hf_dir}", f"train.steps={steps}",
                    f"train.global_batch_size={batch}", "train.micro_batch_size=2", f"train.seq_length={seq}",
                    "train.warmup_steps=0", "train.lr=0", "train.min_lr_ratio=0", f"log.run_dir={run}",
                    f"data.cache_dir={llm_data_cache}", "log.interval=1", "log.progress=false",
                    "log.tensorboard=false", "parallel.tp=2", "--save-hf", str(out)], nproc=2)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    losses = [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert losses[0] == pytest.approx(first_batch_loss(model, llm_data_cache, seq, batch, steps), rel=1e-5)
    before, after = load_file(hf_dir / "model.safetensors"), load_file(out / "model.safetensors")
    assert sorted(before) == sorted(after)
    assert any(".linear_attn.in_proj_qkv." in name for name in before)
    for name in before:
        assert torch.equal(before[name], after[name]), name


@pytest.mark.slow
@pytest.mark.long  # a two-process training run, then four layouts built and loaded in a two-process job
def test_tp2_checkpoint_loads_at_tp1_and_pp2(tmp_path, llm_data_cache):
    """The DeltaNet's TP-split tensors are saved whole: a TP=2 run's checkpoint (model and optimizer)
    gives the same logits loaded at TP=1 and at PP=2, and what PP=2 saves again is it bitwise
    (``tests/reshard_logits.py``)."""
    import torch
    from cli_runner import REPO

    from loongforge.core.checkpoint import Checkpoint, latest_checkpoint

    common = ["model=qwen3_5_debug", "train.steps=2", "train.global_batch_size=4", "train.micro_batch_size=2",
              "train.seq_length=64", "train.warmup_steps=1", "train.precision=fp32", "checkpoint.interval=2",
              "log.progress=false", "log.tensorboard=false"]
    run = tmp_path / "run"
    proc = run_cli(["lf-llm", "train", *common, f"log.run_dir={run}", f"data.cache_dir={llm_data_cache}",
                    "parallel.tp=2"], nproc=2)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    step_dir = latest_checkpoint(run / "checkpoints")
    out = tmp_path / "reshard"
    out.mkdir()
    proc = run_cli([str(REPO / "tests" / "reshard_logits.py"), str(step_dir), str(out), *common], nproc=2)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    got = {name: torch.load(out / f"logits-{name}.pt") for name in ("tp2", "tp1", "pp2", "back", "tp1-init")}
    assert (got["tp1-init"] - got["tp1"]).abs().max() > 1e-2  # the comparisons below are of trained weights
    torch.testing.assert_close(got["tp1"], got["tp2"], rtol=0, atol=2e-6)
    torch.testing.assert_close(got["pp2"], got["tp2"], rtol=0, atol=2e-6)
    assert torch.equal(got["back"], got["tp2"])
    resaved, original = Checkpoint(out / "from-pp2"), Checkpoint(step_dir)
    assert any(".self_attention.in_proj_qkv.weight" in key for key in original.reader.keys())
    assert set(resaved.reader.keys()) == set(original.reader.keys())
    for key in original.reader.keys():
        assert torch.equal(resaved.tensor(key), original.tensor(key)), key

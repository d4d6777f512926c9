"""Activation memory of ``lf-llm info``: the proxy's per-layer bytes agree with what the activation
offloader moves in a real training step (two independent counts of the same tensors), and the
layout arithmetic (CP, TP, PP in flight, offloaded layers) is applied to them as documented."""

from __future__ import annotations

import json

import pytest

from loongforge.core.parallel import ParallelLayout
from loongforge.llm import activation_memory
from loongforge.llm.activation_memory import ActivationProfile, LayerCost
from loongforge.llm.cli import main as lf_llm
from loongforge.llm.recipe import load_llm_config


def test_proxy_bytes_match_what_the_offloader_moves_in_a_training_step(tmp_path):
    """train_debug at 1024 tokens with both layers offloaded: the bytes the offloader moved (read from
    metrics.jsonl) against the proxy's two layers. The proxy counts each storage once; the
    offloader moves a tensor that two operations save once only while the tensor object it copied
    is alive (memory of a dead one may hold a new tensor at the same address), so it moves somewhat
    more, never less."""
    seq = 1024
    overrides = [f"train.seq_length={seq}", "train.global_batch_size=1", "train.micro_batch_size=1",
                 "train.precision=bf16"]
    profile = activation_memory.measure(load_llm_config("train_debug", overrides))
    predicted = 2 * profile.dense.bytes(seq)
    assert lf_llm(["train", *overrides, "train.steps=1", "train.offload_layers=2", "checkpoint.save=false",
                   "log.progress=false", f"log.run_dir={tmp_path}"]) == 0
    moved = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])["offload_gib"] * 2**30
    assert predicted <= moved <= 1.25 * predicted, (moved, predicted)


def test_full_recompute_keeps_only_each_layers_input():
    cfg = load_llm_config("train_debug", ["train.recompute=full"])
    profile = activation_memory.measure(cfg)
    assert profile.dense.hidden == cfg.model.hidden_size * 2  # the bf16 layer input
    plain = activation_memory.measure(load_llm_config("train_debug"))
    assert profile.dense.bytes(4096) < plain.dense.bytes(4096) / 5


def test_layout_arithmetic():
    cost = LayerCost(hidden=100.0, fixed=0.0, per_token=1000.0, per_token_sq=0.0)
    profile = ActivationProfile(dense=cost, moe=None, outside_per_token=10.0)
    cfg = load_llm_config("train_debug", ["model.num_layers=8", "train.seq_length=4096"])
    base = activation_memory.per_gpu(profile, cfg, ParallelLayout(), 1, 4)
    assert base["tokens_per_microbatch"] == 4096 and base["microbatches_in_flight"] == 1
    assert base["layers_gib"] == pytest.approx(round(8 * 1100 * 4096 / 2**30, 3))
    cp = activation_memory.per_gpu(profile, cfg, ParallelLayout(cp=2), 1, 4)
    assert cp["tokens_per_microbatch"] == 2048
    tp = activation_memory.per_gpu(profile, cfg, ParallelLayout(tp=2), 1, 4)
    assert tp["layers_gib"] == pytest.approx(round(8 * (100 + 500) * 4096 / 2**30, 3))  # hidden-size tensors stay
    pp = activation_memory.per_gpu(profile, cfg, ParallelLayout(pp=2), 1, 4)
    assert pp["layers_on_stage"] == 4 and pp["microbatches_in_flight"] == 2  # 1F1B: pp micro-batches in flight
    assert pp["layers_gib"] == base["layers_gib"]
    chunked_cfg = load_llm_config("train_debug", ["model.num_layers=8", "train.seq_length=4096", "train.seq_chunks=4"])
    chunked = activation_memory.per_gpu(profile, chunked_cfg, ParallelLayout(pp=2), 1, 4)
    assert chunked["microbatches_in_flight"] == 1  # ChunkPipe: one micro-batch at a time, its chunks in the pipeline
    assert chunked["stage_inputs_gib"] == pytest.approx(round(2 * chunked_cfg.model.hidden_size * 4096 / 2**30, 3))
    assert "stage_inputs_gib" not in activation_memory.per_gpu(profile, chunked_cfg, ParallelLayout(), 1, 4)
    off_cfg = load_llm_config("train_debug", ["model.num_layers=8", "train.seq_length=4096", "train.offload_layers=6"])
    off = activation_memory.per_gpu(profile, off_cfg, ParallelLayout(), 1, 4)
    assert off["offloaded_layers"] == 6 and off["layers_gib"] == pytest.approx(round(2 * 1100 * 4096 / 2**30, 3))


def test_info_prints_activations_for_the_layout(capsys):
    capsys.readouterr()
    assert lf_llm(["info", "parallel.cp=2", "train.seq_length=2048", "train.micro_batch_size=2",
                   "train.offload_layers=1"]) == 0
    act = json.loads(capsys.readouterr().out)["activations"]
    assert act["tokens_per_microbatch"] == 2 * 2048 // 2
    assert act["offloaded_layers"] == 1 and act["layers_gib"] > 0 and act["offloaded_to_host_gib"] > 0
    assert lf_llm(["info", "--no-activations"]) == 0
    assert "activations" not in json.loads(capsys.readouterr().out)


def test_an_moe_proxy_leaves_the_next_moe_run_in_the_process_alone(tmp_path, capsys):
    """megatron keeps one MoE metrics tracker per process, sized by the first model recording into
    it; info's one-layer proxy before a two-layer run must not break that run (each engine starts
    a tracker of its own)."""
    assert lf_llm(["info", "--config", "train_qwen3_moe_debug"]) == 0
    assert lf_llm(["train", "--config", "train_qwen3_moe_debug", "train.steps=1", "checkpoint.save=false",
                   "log.progress=false", f"log.run_dir={tmp_path}"]) == 0

"""ChunkPipe (``train.seq_chunks``): a pre-training run whose sequences go through the model in 4
chunks trains like the run without chunks (fp32, gloo): the same losses, grad norms and every
parameter's gradient after the first step (``tests/llm_grad_probe.py``), on one process, with activation
offloading, and with tensor parallelism over two processes (losses and grad norms: each rank
holds shards of the gradients); with pipeline parallelism over two processes (the chunks of each
micro-batch fill the pipeline) it trains like one process without chunks, every gradient
included; what it does not run with is refused before any process group, naming the keys."""

import pytest
from llm_grad_probe import PRETRAIN, assert_same_training, probe

from loongforge.core.config import ConfigError
from loongforge.llm.recipe import load_llm_config


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """The tokenized corpus, shared by the runs of this file."""
    return tmp_path_factory.mktemp("chunk-pipe-data") / "llm-data"


@pytest.fixture(scope="module")
def baseline(tmp_path_factory, cache):
    """The unchunked run: cache and probe result shared by the tests of this file."""
    return cache, probe(tmp_path_factory.mktemp("chunk-pipe") / "whole" / "grads.pt", "train_debug", PRETRAIN, cache)


@pytest.mark.slow
@pytest.mark.parametrize("extra, nproc", [([], 1), (["train.offload_layers=1"], 1), (["parallel.tp=2"], 2)],
                         ids=["chunks", "chunks+offload", "chunks+tp2"])
def test_chunk_pipe_trains_like_the_whole_sequence(extra, nproc, tmp_path, baseline):
    cache, want = baseline
    got = probe(tmp_path / "grads.pt", "train_debug", [*PRETRAIN, "train.seq_chunks=4", *extra], cache, nproc=nproc)
    assert_same_training(got, want, grads="parallel.tp=2" not in extra)  # TP ranks hold gradient shards


@pytest.mark.slow
@pytest.mark.long  # three runs, about two minutes on 2 CPU cores
def test_chunk_pipe_pp2_trains_like_one_process(tmp_path, cache):
    """parallel.pp=2 with train.seq_chunks=4: each stage runs chunks 0..3 forward, handing each
    chunk's hidden states on, then 3..0 backward from each chunk's saved stage input. Pipeline
    stages draw their layers' initial weights differently from one process, so this run and one
    process without chunks both start from the step-1 checkpoint of a one-process run: the losses
    of steps 2..3, the grad norms and every gradient of step 2 (gathered over the stages) are the
    same."""
    probe(tmp_path / "first" / "grads.pt", "train_debug", [*PRETRAIN, "train.steps=1", "checkpoint.save=true"], cache)
    step1 = tmp_path / "first" / "run" / "checkpoints" / "step_00000001"
    runs = {}
    for name, extra, nproc in (("one", [], 1), ("pp2", ["parallel.pp=2", "train.seq_chunks=4"], 2)):
        checkpoints = tmp_path / name / "run" / "checkpoints"
        checkpoints.mkdir(parents=True)
        (checkpoints / step1.name).symlink_to(step1)
        (checkpoints / "latest").write_text(f"{step1.name}\n")
        runs[name] = probe(tmp_path / name / "grads.pt", "train_debug", [*PRETRAIN, "train.steps=3", *extra], cache,
                           nproc=nproc)
    assert len(runs["one"]["losses"]) == 2
    assert_same_training(runs["pp2"], runs["one"])


@pytest.mark.parametrize("overrides, message", [
    (["parallel.cp=2"], "parallel.cp=2"),
    (["train.recompute=selective"], "train.recompute=selective"),
    (["train.seq_length=102"], "train.seq_length=102"),
    (["model.family=qwen3_moe"], "model.family=qwen3_moe"),
])
def test_chunk_pipe_refuses_what_it_does_not_run_with(overrides, message):
    config = "train_qwen3_moe_debug" if "model.family=qwen3_moe" in overrides else "train_debug"
    overrides = [o for o in overrides if not o.startswith("model.family")]
    with pytest.raises((ConfigError, ValueError), match=message.replace(".", r"\.") if "family" not in message
                       else "not model.family=qwen3_moe"):
        load_llm_config(config, ["train.seq_chunks=4", *overrides])


def test_sft_refuses_chunk_pipe():
    with pytest.raises((ConfigError, ValueError), match="packed SFT"):
        load_llm_config("sft_debug", ["train.seq_chunks=2", "train.seq_length=256"])

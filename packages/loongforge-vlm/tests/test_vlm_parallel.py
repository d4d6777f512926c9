"""Heterogeneous parallelism: the foundation at TP=2 with the vision tower at TP=1 (its images
shared out across the foundation's TP group) or at TP=2 gives the losses and the gradients of
one process on the same weights and data (2 gloo processes; Qwen2.5-VL, Qwen3-VL, Qwen3.5), and a
checkpoint it saves resumes in one process; LoRA adapters in all three parts get one process's gradients there too. The
foundation at PP=2 (the tower on the first stage) gives one process's losses and gradients, and
its checkpoint loads in one process; so does PP=2 x CP=2 (4 gloo processes)."""

from pathlib import Path

import pytest
import torch
from cli_runner import run_script

PROBE = Path(__file__).with_name("grads_probe.py")
COMMON = ["train.steps=2", "train.warmup_steps=1", "train.global_batch_size=6", "train.seq_length=384",
          "log.progress=false", "log.tensorboard=false", "checkpoint.save=false"]
DECOUPLED = "parallel.encoder.decoupled=true"  # the tower once per step, outside the schedule (encoder_stage)


def probe(out: Path, overrides: list[str], cache: Path, nproc: int = 1) -> dict:
    args = [str(out), *COMMON, f"data.cache_dir={cache}", f"log.run_dir={out.parent / 'run'}", *overrides]
    proc = run_script(PROBE, args, nproc=nproc, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return torch.load(out)


def assert_same_training(got: dict, reference: dict, learned: tuple[str, ...], loss_rel: float = 1e-5) -> None:
    """One process's losses, grad norms and every gradient; the parameters under ``learned``
    did learn (non-zero gradients in the reference)."""
    assert got["losses"] == pytest.approx(reference["losses"], rel=loss_rel)
    assert got["grad_norms"] == pytest.approx(reference["grad_norms"], rel=1e-4)
    assert sorted(got["grads"]) == sorted(reference["grads"])
    parts = [n for n in reference["grads"] if n.startswith(learned)]
    assert parts and all(reference["grads"][n].abs().sum() > 0 for n in parts)
    for name, ref in reference["grads"].items():
        torch.testing.assert_close(got["grads"][name], ref, rtol=1e-4, atol=1e-7, msg=name)


def resume_dir(at: Path, checkpoint: Path) -> Path:
    """A run directory ``at`` whose ``latest`` checkpoint is ``checkpoint`` (linked)."""
    (at / "run" / "checkpoints").mkdir(parents=True)
    (at / "run" / "checkpoints" / checkpoint.name).symlink_to(checkpoint)
    (at / "run" / "checkpoints" / "latest").write_text(f"{checkpoint.name}\n")
    return at


@pytest.fixture(scope="module")
def reference(tmp_path_factory, vlm_cache):
    return probe(tmp_path_factory.mktemp("ref") / "grads.pt", [], vlm_cache)


@pytest.mark.slow
# the split-encoder case under -m long (the default tier's budget): encoder-tp2 runs the same foundation at TP=2
@pytest.mark.parametrize("encoder_tp", [pytest.param(1, marks=pytest.mark.long), 2],
                         ids=["encoder-tp1-split", "encoder-tp2"])
def test_foundation_tp2_matches_one_process(encoder_tp, reference, tmp_path, vlm_cache):
    layout = ["parallel.tp=2", f"parallel.encoder.tp={encoder_tp}"]
    save = ["checkpoint.save=true", "checkpoint.interval=1", "checkpoint.keep_last=2"]
    got = probe(tmp_path / "grads.pt", [*layout, *save], vlm_cache, nproc=2)
    assert_same_training(got, reference, learned=("encoder.", "projector."))  # the tower did learn

    # the step-1 checkpoint of the TP=2 run resumes in one process: step 2 as in the reference
    resumed = resume_dir(tmp_path / "resumed", tmp_path / "run" / "checkpoints" / "step_00000001")
    again = probe(resumed / "grads.pt", [], vlm_cache)
    assert again["losses"] == pytest.approx(reference["losses"][1:], rel=1e-5)
    assert again["grad_norms"] == pytest.approx(reference["grad_norms"][1:], rel=1e-4)


LORA = ["lora.rank=4", "lora.alpha=8", "lora.target_modules=[foundation.linear_qkv,foundation.linear_proj,"
        "foundation.linear_fc1,foundation.linear_fc2,encoder.linear_qkv,encoder.linear_fc1,encoder.linear_fc2,"
        "projector.linear_fc1,projector.linear_fc2]"]


@pytest.fixture(scope="module")
def lora_reference(tmp_path_factory, vlm_cache):
    return probe(tmp_path_factory.mktemp("lora-ref") / "grads.pt", LORA, vlm_cache)


@pytest.mark.slow
# encoder-tp2 under -m long (CI's 20 minutes): test_foundation_tp2_matches_one_process covers the encoder at TP=2
@pytest.mark.parametrize("encoder_tp", [1, pytest.param(2, marks=pytest.mark.long)], ids=["encoder-tp1-split", "encoder-tp2"])
def test_lora_at_foundation_tp2_matches_one_process(encoder_tp, lora_reference, tmp_path, vlm_cache):
    """Adapters on every linear layer of the three parts (loongforge-llm's tensor-parallel LoRA)
    under the foundation at TP=2: the losses and adapter gradients of one process."""
    got = probe(tmp_path / "grads.pt", [*LORA, "parallel.tp=2", f"parallel.encoder.tp={encoder_tp}"], vlm_cache,
                nproc=2)
    ref = lora_reference["grads"]
    assert {n.split(".")[0] for n in ref} == {"encoder", "projector", "language_model"}
    assert all(n.endswith(("lora_A", "lora_B")) for n in ref) and sorted(got["grads"]) == sorted(ref)
    assert got["losses"] == pytest.approx(lora_reference["losses"], rel=1e-5)
    assert got["grad_norms"] == pytest.approx(lora_reference["grad_norms"], rel=1e-4)
    for name, grad in ref.items():
        torch.testing.assert_close(got["grads"][name], grad, rtol=1e-4, atol=1e-7, msg=name)


QWEN3_VL = ["encoder=qwen3_vit_debug", "projector=qwen3_vl_merger", "foundation=qwen3_debug", "vision.rope=mrope_interleaved"]


@pytest.mark.slow
@pytest.mark.long  # CI's 20 minutes: the split tower (encoder-tp1-split) and DeepStack under CP=2 stay in the default tier
def test_qwen3_vl_deepstack_with_split_tower_matches_one_process(tmp_path, vlm_cache):
    """Qwen3-VL (DeepStack) with the foundation at TP=2 and the tower at TP=1, its images shared
    out across the TP group: the gathered rows carry the DeepStack features too; losses and every
    gradient (the DeepStack mergers' included) are one process's."""
    (tmp_path / "ref").mkdir()
    (tmp_path / "tp2").mkdir()
    reference = probe(tmp_path / "ref" / "grads.pt", QWEN3_VL, vlm_cache)
    got = probe(tmp_path / "tp2" / "grads.pt", [*QWEN3_VL, "parallel.tp=2", "parallel.encoder.tp=1"], vlm_cache, nproc=2)
    assert_same_training(got, reference, learned=("deepstack.",))  # DeepStack did learn


SIGLIP_LLAMA = ["encoder=siglip_vit_debug", "projector=mlp_2x", "foundation=llama_debug"]
QWEN3_5_VL = ["encoder=qwen3_5_vit_debug", "projector=qwen3_vl_merger", "foundation=qwen3_5_debug",
              "vision.rope=mrope_interleaved", "vision.mrope_section=[2,1,1]"]


@pytest.mark.slow
@pytest.mark.long  # CI's 20 minutes: two runs, ~40 s on 2 CPU cores
def test_qwen3_5_vl_foundation_tp2_matches_one_process(tmp_path, vlm_cache):
    """Qwen3.5 (Gated DeltaNet and gated attention layers, each DeltaNet holding whole key heads and
    their value heads per TP rank) at TP=2 with the tower at TP=1, its images shared out across the
    TP group: losses, grad norms and every gradient are one process's."""
    (tmp_path / "ref").mkdir()
    (tmp_path / "tp2").mkdir()
    reference = probe(tmp_path / "ref" / "grads.pt", QWEN3_5_VL, vlm_cache)
    got = probe(tmp_path / "tp2" / "grads.pt", [*QWEN3_5_VL, "parallel.tp=2", "parallel.encoder.tp=1"], vlm_cache,
                nproc=2)
    assert any(".self_attention.in_proj_qkv." in n for n in reference["grads"])  # DeltaNet layers
    assert_same_training(got, reference, learned=("encoder.", "projector."))


@pytest.mark.slow
@pytest.mark.parametrize("model, layout", [
    pytest.param([], ["parallel.cp=2"], marks=pytest.mark.long),  # CI's 20 minutes: Qwen3-VL's CP=2 case covers it
    (QWEN3_VL, ["parallel.cp=2"]),
    pytest.param(SIGLIP_LLAMA, ["parallel.cp=2"], marks=pytest.mark.long),
    pytest.param(QWEN3_5_VL, ["parallel.cp=2"], marks=pytest.mark.long),  # Gated DeltaNet: state handed over across CP
    pytest.param([], ["parallel.cp=2", "parallel.tp=2", "parallel.encoder.tp=1"], marks=pytest.mark.long),  # 4 processes
    pytest.param([], ["parallel.cp=2", DECOUPLED], marks=pytest.mark.long),
], ids=["qwen2.5-vl", "qwen3-vl-deepstack", "siglip-llama-1d-rope", "qwen3.5-vl-deltanet", "qwen2.5-vl-tp2-cp2",
        "qwen2.5-vl-decoupled-encoder"])
def test_context_parallel_cp2_matches_one_process(model, layout, tmp_path, vlm_cache):
    """parallel.cp=2: each conversation of the packed (THD) rows padded to a multiple of 2*cp and
    split in megatron's load-balanced chunks after the vision features (and DeepStack's) are
    scattered in; each CP rank rotates its tokens by their own multimodal RoPE positions and attends
    over the whole row (1-D RoPE: by its position in its sample); also with the foundation at TP=2
    (4 processes, the tower split across TP), and with the decoupled encoder stage (the step's
    images shared out at once, before the schedule). The CP ranks share out the micro-batch's images
    (rank 0 encodes some, not all). The losses, grad norms and every gradient are one process's."""
    (tmp_path / "ref").mkdir()
    (tmp_path / "cp2").mkdir()
    reference = probe(tmp_path / "ref" / "grads.pt", model, vlm_cache)
    nproc = 4 if "parallel.tp=2" in layout else 2
    got = probe(tmp_path / "cp2" / "grads.pt", [*model, *layout], vlm_cache, nproc=nproc)
    (_, whole), (_, local) = got["first_row"]
    assert whole % 4 == 0 and local == whole // 2  # each CP rank holds half of the padded row
    (encoded, items), (encoded_alone, _) = got["first_items"], reference["first_items"]
    assert encoded_alone == items >= 2 and encoded > 0
    if DECOUPLED not in layout:  # (decoupled, rank 0 encoded its share of the whole step's images)
        assert encoded < items  # the CP ranks shared out the images
    assert_same_training(got, reference, learned=("encoder.", "projector.", "deepstack."))  # the tower did learn


@pytest.mark.slow
@pytest.mark.long  # three runs, 2-5 min on 2 CPU cores
@pytest.mark.parametrize("model, layout", [
    ([], ["parallel.pp=2"]),
    (QWEN3_VL, ["parallel.pp=2"]),
    (QWEN3_5_VL, ["parallel.pp=2"]),
    ([], ["parallel.pp=2", "parallel.tp=2", "parallel.encoder.tp=1"]),  # 4 processes
    ([], ["parallel.pp=2", DECOUPLED]),
    (QWEN3_VL, ["parallel.pp=2", DECOUPLED]),
    ([], ["parallel.pp=2", "parallel.cp=2"]),  # 4 processes
    ([], ["parallel.pp=2", "parallel.cp=2", DECOUPLED]),  # 4 processes
], ids=["qwen2.5-vl", "qwen3-vl-deepstack", "qwen3.5-vl-deltanet", "qwen2.5-vl-tp2-pp2", "qwen2.5-vl-decoupled-encoder",
        "qwen3-vl-deepstack-decoupled-encoder", "qwen2.5-vl-pp2-cp2", "qwen2.5-vl-pp2-cp2-decoupled-encoder"])
def test_foundation_pp2_matches_one_process(model, layout, tmp_path, vlm_cache):
    """parallel.pp=2: the tower and the first half of the foundation on stage 0, the rest and the
    loss on stage 1, hidden states of varying length between them; also with the foundation at
    TP=2 (4 processes, the tower split across TP on stage 0), with the decoupled encoder stage
    (``parallel.encoder.decoupled``: stage 0 encodes all the step's images before the schedule,
    more than its first micro-batch's, and runs the tower's backward once after it), and with
    CP=2 (4 processes: each stage's CP ranks hold half of every row, the stages exchange those
    halves, stage 0's CP ranks share out the images; coupled and decoupled). Pipeline
    stages draw their layers' initial weights differently from one process, so both start from
    the step-1 checkpoint of a PP=2 run, which one process loads (resharded): the losses of steps
    2..3, the grad norms and every gradient of step 2 (the tower's and DeepStack's mergers'
    included) are one (coupled) process's."""
    (tmp_path / "first").mkdir()
    probe(tmp_path / "first" / "grads.pt", [*model, "parallel.pp=2", "train.steps=1", "checkpoint.save=true"],
          vlm_cache, nproc=2)
    step1 = tmp_path / "first" / "run" / "checkpoints" / "step_00000001"
    reference = probe(resume_dir(tmp_path / "one", step1) / "grads.pt", [*model, "train.steps=3"], vlm_cache)
    nproc = 4 if {"parallel.tp=2", "parallel.cp=2"} & set(layout) else 2
    got = probe(resume_dir(tmp_path / "pp2", step1) / "grads.pt", [*model, "train.steps=3", *layout], vlm_cache,
                nproc=nproc)
    assert len(reference["losses"]) == 2
    (encoded, items), (encoded_alone, _) = got["first_items"], reference["first_items"]
    if DECOUPLED in layout and "parallel.cp=2" not in layout:  # before the first forward: the whole step's images
        assert encoded > items == encoded_alone
    assert_same_training(got, reference, learned=("encoder.", "projector.", "deepstack."), loss_rel=1e-4)
    if "parallel.cp=2" in layout:  # each CP rank held half of the padded row
        (_, whole), (_, local) = got["first_row"]
        assert whole % 4 == 0 and local == whole // 2
        if DECOUPLED not in layout:  # and stage 0's CP ranks shared out the images
            assert encoded_alone == items >= 2 and 0 < encoded < items

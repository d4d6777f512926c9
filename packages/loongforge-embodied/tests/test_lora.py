"""LoRA on the policies (``lf-embodied train lora.rank=N``, loongforge.core.lora): only the adapters
train; ``lf-to-lerobot`` exports the merged policy, which LeRobot's own Pi0 / Pi0.5 runs like the
LoRA policy; ``lora-to-peft`` exports the adapters in LeRobot's names, which PEFT loads onto
LeRobot's Pi0 / Pi0.5 (GR00T: onto ours) with the LoRA policy's loss."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn
from safetensors.torch import load_file

from embodied_helpers import policy_batch, tiny_overrides
from lerobot_reference import build_lerobot_pi0, build_lerobot_pi05, lerobot_loss
from loongforge.core.checkpoint import Checkpoint
from loongforge.core.lora import LoRALinear, merge_state, strip_adapters
from loongforge.embodied.cli import main
from loongforge.embodied.config import load_train_config
from loongforge.embodied.convert.lerobot_pi0 import to_lerobot_pi0
from loongforge.embodied.convert.lerobot_pi05 import to_lerobot_pi05
from loongforge.embodied.policies import build_policy
from loongforge.embodied.restore import restore_policy

RANK, ALPHA = 4, 8.0
SCALE = ALPHA / RANK
LEROBOT = {"pi05": (build_lerobot_pi05, to_lerobot_pi05), "pi0": (build_lerobot_pi0, to_lerobot_pi0)}


def _batch(cfg):
    return policy_batch(cfg, b=2, length=12)


def _train(tiny_dataset, run, *extra):
    args = tiny_overrides(tiny_dataset, run, "train.steps=2", "checkpoint.interval=1", "log.tensorboard=false",
                          "train.warmup_steps=0", "train.lr=0.05", f"lora.rank={RANK}", f"lora.alpha={ALPHA}", *extra)
    assert main(["train", *args]) == 0
    return load_train_config("train", args)


@pytest.mark.parametrize("family", ["pi05", "pi0"])
def test_lora_trains_adapters_and_exports_for_lerobot(tiny_dataset, tmp_path, family):
    """The default targets (``q/k/v/o_proj``, ``out_proj``) adapt the SigLIP, backbone and expert
    attention of Pi0 and Pi0.5 alike."""
    build_lerobot, to_lerobot = LEROBOT[family]
    run = tmp_path / "run"
    cfg = _train(tiny_dataset, run, f"model={family}")
    assert cfg.model.family == family
    first = Checkpoint(run / "checkpoints" / "step_00000001").tensors("model.")
    last = Checkpoint(run / "checkpoints" / "step_00000002")
    state = {k[len("model."):]: v for k, v in last.tensors("model.").items()}
    torch.manual_seed(cfg.train.seed)
    fresh = build_policy(cfg.model).state_dict()
    assert set(strip_adapters(state)) == set(fresh)
    for key, value in fresh.items():  # the base weights: bitwise their initial values after two updates
        assert torch.equal(state[key], value) and torch.equal(first[f"model.{key}"], value), key
    adapters = [k for k in state if ".lora_" in k]
    assert len(adapters) == 2 * 2 * 12  # (siglip q/k/v/out_proj + vlm and expert q/k/v/o_proj) x 2 layers
    moved = [k for k in adapters if not torch.equal(state[k], first[f"model.{k}"])]
    assert moved and all(".lora_B." in k or ".lora_A." in k for k in moved)
    # the last backbone layer's output projection is unreachable (frozen), its adapter too
    assert torch.equal(state["layers.1.vlm.self_attn.o_proj.lora_B.weight"], torch.zeros(cfg.model.vlm.width, RANK))
    optimised = {k[len("optim."):].rsplit(".", 1)[0] for k in last.reader.keys() if k.startswith("optim.")}
    assert optimised == set(adapters) - {f"layers.1.vlm.self_attn.o_proj.lora_{f}.weight" for f in "AB"}

    ours, _, _ = restore_policy(run / "checkpoints")
    assert isinstance(ours.layers[0].expert.self_attn.q_proj, LoRALinear)
    ours.eval()
    batch, noise, t = _batch(cfg.model)
    with torch.no_grad():
        want = ours(batch, noise, t)
        base = build_policy(cfg.model).eval()
        base.load_state_dict(fresh)
        assert (want - base(batch, noise, t)).abs().max() > 1e-3  # the adapters matter

    # merged: W + (alpha / r) B A in LeRobot's PI0Policy / PI05Policy layout; LeRobot's gives our loss
    out = tmp_path / "lerobot" / "model.safetensors"
    assert main(["convert", "lf-to-lerobot", str(run), str(out)]) == 0
    exported = load_file(str(out))
    expected = to_lerobot(merge_state(state, SCALE), cfg.model)
    assert set(exported) == set(expected)
    for key, value in expected.items():
        torch.testing.assert_close(exported[key], value, rtol=0, atol=1e-7, msg=key)
    lerobot = build_lerobot(cfg.model)
    lerobot.load_state_dict({k[len("model."):]: v for k, v in exported.items()}, strict=True)
    with torch.no_grad():
        torch.testing.assert_close(lerobot_loss(lerobot.eval(), batch, noise, t), want, rtol=1e-4, atol=1e-5)

    # the adapters alone, in LeRobot's names: PEFT loads them onto LeRobot's policy (inside a
    # PI0Policy / PI05Policy-like holder: its `model`) with the base weights, and the loss is ours
    from peft import PeftModel

    adapter = tmp_path / "adapter"
    assert main(["convert", "lora-to-peft", str(run), str(adapter)]) == 0
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["target_modules"]) == (
        RANK, ALPHA, ["k_proj", "o_proj", "out_proj", "q_proj", "v_proj"])
    keys = load_file(str(adapter / "adapter_model.safetensors"))
    assert ("base_model.model.model.paligemma_with_expert.gemma_expert.model.layers.0.self_attn.q_proj.lora_A.weight"
            in keys)
    lerobot = build_lerobot(cfg.model)
    lerobot.load_state_dict(to_lerobot(fresh, cfg.model, policy_prefix=False), strict=True)
    holder = nn.Module()
    holder.model = lerobot
    PeftModel.from_pretrained(holder, str(adapter))
    with torch.no_grad():
        torch.testing.assert_close(lerobot_loss(lerobot.eval(), batch, noise, t), want, rtol=1e-4, atol=1e-5)


def test_groot_lora_adapter_loads_with_peft_in_our_names(tiny_dataset, tmp_path, capsys):
    """GR00T has no LeRobot layout: its adapters keep LoongForge's names, which PEFT loads onto
    our own policy; the merged policy gives the same loss."""
    from peft import PeftModel

    run = tmp_path / "run"
    cfg = _train(tiny_dataset, run, "model=groot", r"lora.target_modules=[q_proj,v_proj,re:.*_attn\.(q|out)]")
    ours, _, _ = restore_policy(run / "checkpoints")
    ours.eval()
    batch, noise, t = _batch(cfg.model)
    with torch.no_grad():
        want = ours(batch, noise, t)
    adapter = tmp_path / "adapter"
    assert main(["convert", "lora-to-peft", str(run), str(adapter)]) == 0
    # the shortest suffixes that name exactly the adapted layers (the DiT's attention q and out)
    assert json.loads((adapter / "adapter_config.json").read_text())["target_modules"] == ["out", "q", "q_proj", "v_proj"]
    base = build_policy(cfg.model).eval()
    base.load_state_dict(strip_adapters(ours.state_dict()))
    peft = PeftModel.from_pretrained(base, str(adapter))
    with torch.no_grad():
        torch.testing.assert_close(peft.base_model.model(batch, noise, t), want, rtol=1e-5, atol=1e-6)
    capsys.readouterr()
    assert main(["convert", "lf-to-lerobot", str(run), str(tmp_path / "x.safetensors")]) == 2  # one line, no traceback
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "model.family=groot" in err[0] and "only pi0 and pi05 have a LeRobot layout" in err[0]


def test_targets_that_match_no_layer_are_one_error_line(tiny_dataset, tmp_path, capsys):
    args = tiny_overrides(tiny_dataset, tmp_path / "run", "train.steps=1", "lora.rank=2", "lora.target_modules=[to_q]")
    assert main(["train", *args]) == 2
    err = capsys.readouterr().err
    assert "lora.target_modules=['to_q'] match no linear layer; the model's are" in err and "'q_proj'" in err

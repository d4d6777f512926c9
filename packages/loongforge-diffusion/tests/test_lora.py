"""LoRA on the Wan DiT (``lf-diffusion train lora.rank=N``, loongforge.core.lora): only the adapters
train, the merged export is ``W + (alpha/r) B A`` and runs like the LoRA model in diffusers, the
adapter export loads with diffusers' ``load_lora_adapter`` and gives the LoRA model's output,
resume is exact, and compiled blocks give the eager LoRA model's gradients."""

import json

import pytest
import torch
from diffusers import WanTransformer3DModel

from loongforge.core.checkpoint import load_checkpoint
from loongforge.core.lora import LoRAConfig, LoRALinear, apply_lora
from loongforge.core.metrics import read_metrics
from loongforge.diffusion.cli import main
from loongforge.diffusion.model import WanConfig, WanDiT, WanExperts
from loongforge.diffusion.model.convert import read_diffusers_weights
from loongforge.diffusion.packing import pack

RANK, ALPHA = 4, 12.0
SCALE = ALPHA / RANK
TOL = dict(atol=2e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    path = tmp_path_factory.mktemp("wan") / "pretrained"
    torch.manual_seed(11)
    WanTransformer3DModel(**WanConfig().diffusers_kwargs()).save_pretrained(str(path))
    return path


def _inputs(cfg, seed=3):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(2, cfg.in_channels, 2, 8, 6, generator=g), torch.tensor([37.0, 912.5]),
            torch.randn(2, cfg.text_len, cfg.text_dim, generator=g))


def _lora_model(tensors, prefix="model."):
    """Our Wan DiT with the checkpoint's adapters (the model the run trained)."""
    experts = WanExperts(WanConfig())
    apply_lora(experts, LoRAConfig(rank=RANK, alpha=ALPHA, target_modules=["to_q", "to_k", "to_v", "to_out.0"]))
    experts.load_state_dict({k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}, strict=True)
    return experts.transformer.eval()


def test_lora_trains_adapters_only_and_exports_merged_and_peft(tmp_path, pretrained, synthetic_overrides):
    run = tmp_path / "run"
    assert main(["train", f"log.run_dir={run}", "train.steps=3", "train.global_batch_size=4", "train.warmup_steps=0",
                 f"model.pretrained={pretrained}", f"lora.rank={RANK}", f"lora.alpha={ALPHA}", *synthetic_overrides]) == 0
    tensors, manifest, _ = load_checkpoint(run / "checkpoints")
    assert manifest["lora"]["rank"] == RANK and len(manifest["lora"]["layers"]) == 2 * 2 * 4  # 2 blocks x 2 attn x 4
    base = read_diffusers_weights(pretrained)
    adapters = {k for k in tensors if k.startswith("model.") and ".lora_" in k}
    assert len(adapters) == 2 * 16
    # base weights: bitwise the pretrained ones after three updates; the adapters moved from B = 0
    assert {k[len("model.transformer."):] for k in tensors if k.startswith("model.") and k not in adapters} == set(base)
    for key, value in base.items():
        assert torch.equal(tensors[f"model.transformer.{key}"], value), key
    assert all(tensors[k].abs().max() > 0 for k in adapters if ".lora_B." in k)
    assert {k[len("optim."):].rsplit(".", 1)[0] for k in tensors if k.startswith("optim.")} == {k[6:] for k in adapters}
    assert {k for k in tensors if k.startswith("ema.")} == {"ema." + k[6:] for k in adapters}

    ours = _lora_model(tensors)
    x, t, text = _inputs(ours.config)
    with torch.no_grad():
        want = ours.forward_video(x, t, text)
        assert (want - _plain(base).forward_video(x, t, text)).abs().max() > 1e-4  # the adapters matter

    # merged: W + (alpha / r) B A in an ordinary diffusers model that runs like the LoRA model
    merged_dir = tmp_path / "merged"
    assert main(["convert", "lf-to-diffusers", str(run), str(merged_dir)]) == 0
    merged = read_diffusers_weights(merged_dir)
    for key, value in merged.items():
        layer = key[: -len(".weight")]
        if f"model.transformer.{layer}.lora_A.weight" in tensors:
            a, b = tensors[f"model.transformer.{layer}.lora_A.weight"], tensors[f"model.transformer.{layer}.lora_B.weight"]
            torch.testing.assert_close(value, base[key] + SCALE * b @ a, rtol=0, atol=1e-7)
            assert not torch.equal(value, base[key])
        else:
            assert torch.equal(value, base[key]), key
    with torch.no_grad():
        torch.testing.assert_close(WanTransformer3DModel.from_pretrained(str(merged_dir))(x, t, text, return_dict=False)[0],
                                   want, **TOL)

    # adapters alone, in diffusers' names: load_lora_adapter onto the base model gives our output
    peft_dir = tmp_path / "adapter"
    assert main(["convert", "lora-to-peft", str(run), str(peft_dir)]) == 0
    config = json.loads((peft_dir / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"], config["bias"]) == ("LORA", RANK, ALPHA, "none")
    assert config["target_modules"] == ["to_k", "to_out.0", "to_q", "to_v"]
    from safetensors.torch import load_file

    assert "transformer.blocks.0.attn1.to_q.lora_A.weight" in load_file(str(peft_dir / "adapter_model.safetensors"))
    ref = WanTransformer3DModel.from_pretrained(str(pretrained))
    ref.load_lora_adapter(str(peft_dir), use_safetensors=True)
    with torch.no_grad():
        torch.testing.assert_close(ref(x, t, text, return_dict=False)[0], want, **TOL)
    # WanPipeline.load_lora_weights' own steps (the file, its header's LoRA config, the transformer)
    from diffusers import WanPipeline

    state, metadata = WanPipeline.lora_state_dict(str(peft_dir), return_lora_metadata=True)
    assert metadata["transformer.lora_alpha"] == ALPHA
    ref = WanTransformer3DModel.from_pretrained(str(pretrained))
    WanPipeline.load_lora_into_transformer(state, transformer=ref, metadata=metadata)
    with torch.no_grad():
        torch.testing.assert_close(ref(x, t, text, return_dict=False)[0], want, **TOL)

    # the EMA of the adapters, merged on the model's base weights
    assert main(["convert", "lf-to-diffusers", str(run), str(tmp_path / "ema"), "--ema"]) == 0
    ema = read_diffusers_weights(tmp_path / "ema")
    a, b = (tensors[f"ema.transformer.blocks.1.attn2.to_v.lora_{f}.weight"] for f in "AB")
    torch.testing.assert_close(ema["blocks.1.attn2.to_v.weight"], base["blocks.1.attn2.to_v.weight"] + SCALE * b @ a,
                               rtol=0, atol=1e-7)
    assert main(["convert", "lora-to-peft", str(run), str(peft_dir)]) == 2  # the output exists


def _plain(base):
    plain = WanDiT(WanConfig()).eval()
    plain.load_state_dict(base)
    return plain


@pytest.mark.parametrize("recompute", ["none", "selective"])
def test_lora_resume_is_exact(tmp_path, synthetic_overrides, recompute):
    common = ["train.steps=4", "train.global_batch_size=4", "ema.decay=0.5", f"lora.rank={RANK}",
              f"train.recompute={recompute}", *synthetic_overrides]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert main(["train", f"log.run_dir={straight}", *common]) == 0
    assert main(["train", f"log.run_dir={resumed}", "train.exit_interval=2", *common]) == 0
    assert main(["train", f"log.run_dir={resumed}", *common]) == 0
    assert [r["loss"] for r in read_metrics(straight)] == [r["loss"] for r in read_metrics(resumed)]
    ta, _, _ = load_checkpoint(straight / "checkpoints")
    tb, _, _ = load_checkpoint(resumed / "checkpoints")
    assert set(ta) == set(tb) and any(".lora_B." in k for k in ta)
    for key in ta:
        assert torch.equal(ta[key], tb[key]), key
    # a run without lora refuses the LoRA checkpoint instead of dropping its adapters
    assert main(["train", f"log.run_dir={resumed}", *[o for o in common if not o.startswith("lora.")],
                 "train.steps=5"]) == 2


def test_lora_on_the_feed_forward_and_fused_projections_matches_the_module_forward():
    """Adapters on every linear layer of the blocks (the fused QKV / KV GEMMs, the output
    projections, the feed-forward run unfused): the DiT's output and gradients equal diffusers'
    WanTransformer3DModel with PEFT adapters of the same values, which calls every layer."""
    from peft import LoraConfig, inject_adapter_in_model, set_peft_model_state_dict

    cfg = WanConfig()
    ref = WanTransformer3DModel(**cfg.diffusers_kwargs())
    ours = WanDiT(cfg)
    ours.load_state_dict(ref.state_dict())
    targets = ["to_q", "to_k", "to_v", "to_out.0", "ffn.net.0.proj", "ffn.net.2"]
    apply_lora(ours, LoRAConfig(rank=RANK, alpha=ALPHA, target_modules=targets))
    for m in ours.modules():
        if isinstance(m, LoRALinear):
            torch.nn.init.normal_(m.lora_B.weight, std=0.2)
    inject_adapter_in_model(LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=targets), ref)
    set_peft_model_state_dict(ref, {k: v for k, v in ours.state_dict().items() if ".lora_" in k})
    x, t, text = _inputs(cfg)
    target = torch.randn(2, cfg.out_channels, 2, 8, 6)
    ref(x, t, text, return_dict=False)[0].sub(target).pow(2).mean().backward()
    ours.forward_video(x, t, text).sub(target).pow(2).mean().backward()
    want = {n.replace(".default", ""): p for n, p in ref.named_parameters() if ".lora_" in n}
    assert len(want) == 2 * 2 * 4 * 2 + 2 * 2 * 2
    for name, p in ours.named_parameters():
        if ".lora_" in name:
            torch.testing.assert_close(p.grad, want[name].grad, atol=1e-6, rtol=1e-4, msg=name)


@pytest.mark.slow
def test_compiled_lora_blocks_equal_eager():
    """Regional compilation with adapters and selective recomputation: the adapters' gradients
    equal the eager model's."""
    import torch._dynamo
    import torch._inductor.config

    cfg = WanConfig()
    eager, compiled = WanDiT(cfg), WanDiT(cfg)
    compiled.load_state_dict(eager.state_dict())
    for model in (eager, compiled):
        apply_lora(model, LoRAConfig(rank=RANK, alpha=ALPHA, target_modules=["to_q", "to_out.0", "ffn.net.2"]), seed=1)
        model.set_recompute("selective")
        for m in model.modules():
            if isinstance(m, LoRALinear):
                torch.nn.init.constant_(m.lora_B.weight, 0.05)
    torch._dynamo.reset()
    with torch._inductor.config.patch(compile_threads=1):
        compiled.compile_regions(dynamic=False)
        batch = pack([torch.randn(4, 3, 4, 6)], torch.tensor([100.0]), torch.randn(1, cfg.text_len, cfg.text_dim),
                     cfg.patch_size)
        grads = []
        for model in (eager, compiled):
            model(batch).pow(2).mean().backward()
            grads.append({k: p.grad for k, p in model.named_parameters() if p.requires_grad})
    assert set(grads[0]) == set(grads[1]) and len(grads[0]) == 2 * (2 * 2 + 1) * 2  # blocks x (to_q, to_out of attn1/2; ffn.net.2) x A/B
    for k, g in grads[0].items():
        torch.testing.assert_close(grads[1][k], g, atol=1e-5, rtol=1e-4, msg=k)


@pytest.mark.slow
def test_fsdp2_two_processes_equal_one(tmp_path, pretrained, synthetic_overrides, cache_dir):
    """A LoRA run on 2 gloo processes under FSDP2 (sharded pretrained load onto a meta-built model,
    adapters initialised after sharding, uneven packed micro-batches, stopped and resumed) follows
    the one-process run: the same losses and adapters, the base weights bitwise the pretrained ones."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    lr = 2e-3
    common = ["train.steps=3", "train.global_batch_size=6", "train.warmup_steps=0", f"train.lr={lr}",
              "train.lr_decay_style=constant", "checkpoint.interval=2", f"model.pretrained={pretrained}",
              f"lora.rank={RANK}", f"lora.alpha={ALPHA}", *synthetic_overrides]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "LOONGFORGE_ACCELERATOR": "cpu"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(Path(__file__).with_name("lora_worker.py")), str(tmp_path), *common],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    ref = tmp_path / "ref"
    assert main(["train", f"log.run_dir={ref}", *common]) == 0  # meanwhile, the 1-process reference
    output, _ = proc.communicate(timeout=500)
    assert proc.returncode == 0, output[-4000:]

    run = tmp_path / "lora_fsdp2"
    got, want = read_metrics(run), read_metrics(ref)
    assert [r["step"] for r in got] == [r["step"] for r in want] == [1, 2, 3]
    for g, w in zip(got, want):
        assert g["loss"] == pytest.approx(w["loss"], rel=1e-5)
        assert g["grad_norm"] == pytest.approx(w["grad_norm"], rel=1e-4)
    assert max(r["micro_batches"] for r in got) > 1
    tg, manifest, _ = load_checkpoint(run / "checkpoints")
    tw, _, _ = load_checkpoint(ref / "checkpoints")
    assert manifest["layout"]["data_parallel"] == "fsdp" and manifest["lora"]["rank"] == RANK
    assert set(tg) == set(tw)
    base = read_diffusers_weights(pretrained)
    for key in tw:
        if key.startswith("model.") and ".lora_" not in key:
            assert torch.equal(tg[key], base[key[len("model.transformer."):]]) and torch.equal(tw[key], tg[key]), key
        elif key.startswith("optim."):
            torch.testing.assert_close(tg[key], tw[key], atol=1e-4 * float(tw[key].abs().max()), rtol=0, msg=key)
        else:  # adapters (and their EMA) after three steps; Adam normalises tiny gradients: 5% of one lr step
            torch.testing.assert_close(tg[key], tw[key], atol=0.05 * lr, rtol=0, msg=key)


def test_two_expert_adapters_export_per_expert(tmp_path):
    """Wan 2.2: adapters of the trained expert only (``model.train_expert``), exported to
    ``OUT/transformer_2`` in diffusers' names; diffusers loads them onto that expert."""
    from loongforge.core.lora import export_peft_adapter
    from loongforge.diffusion.cli import lora_layouts

    cfg = WanConfig(boundary_ratio=0.9)
    experts = WanExperts(cfg)
    experts.transformer.requires_grad_(False)  # model.train_expert=transformer_2
    apply_lora(experts, LoRAConfig(rank=RANK, alpha=ALPHA, target_modules=["attn1.to_q", "attn2.to_v"]))
    assert not experts.transformer.blocks[0].attn1.to_q.lora_A.weight.requires_grad
    for m in experts.transformer_2.modules():
        if isinstance(m, LoRALinear):
            torch.nn.init.normal_(m.lora_B.weight, std=0.2)
    state = experts.state_dict()
    names = list(state)
    written = export_peft_adapter(names, state.__getitem__, {"rank": RANK, "alpha": ALPHA}, tmp_path / "adapter",
                                  lora_layouts({"experts": experts.names}, names))
    assert written == [tmp_path / "adapter" / "transformer", tmp_path / "adapter" / "transformer_2"]
    config = json.loads((written[1] / "adapter_config.json").read_text())
    assert config["target_modules"] == ["attn1.to_q", "attn2.to_v"]
    ref = WanTransformer3DModel(**cfg.diffusers_kwargs())
    ref.load_state_dict({k[len("transformer_2."):]: v for k, v in state.items()
                         if k.startswith("transformer_2.") and ".lora_" not in k})
    ref.load_lora_adapter(str(written[1]), use_safetensors=True)
    x, t, text = _inputs(cfg)
    with torch.no_grad():
        torch.testing.assert_close(ref(x, t, text, return_dict=False)[0],
                                   experts.transformer_2.eval().forward_video(x, t, text), **TOL)

"""Wan image-to-video: Wan 2.1 I2V (mask + condition latents on channels, CLIP image tokens in the
cross-attention) and Wan 2.2 TI2V (clean first latent frame, per-token timesteps) against
diffusers' WanTransformer3DModel on the same weights."""

import pytest
import torch
from diffusers import WanTransformer3DModel

from loongforge.diffusion.model import WanConfig, WanDiT
from loongforge.diffusion.packing import pack, unpack_outputs

TOL = dict(atol=2e-5, rtol=1e-5)
# diffusers' I2V attention takes the last 512 context tokens as the prompt (hard-coded)
I2V = dict(in_channels=12, out_channels=4, image_dim=24, added_kv_proj_dim=64, condition="i2v", text_len=512)
TI2V = dict(condition="ti2v")
IMAGE_TOKENS = 5


def _pair(**overrides):
    cfg = WanConfig(**overrides)
    ref = WanTransformer3DModel(**cfg.diffusers_kwargs()).eval()
    ours = WanDiT(cfg).eval()
    ours.load_state_dict(ref.state_dict(), strict=True)
    return cfg, ref, ours


def _first_frame_timesteps(t: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
    """``[B, f*h*w]``: 0 on the first latent frame's tokens, ``t`` elsewhere (WanPipeline's
    ``expand_timesteps``)."""
    f, h, w = grid
    mask = torch.ones(f, h, w)
    mask[0] = 0
    return mask.flatten()[None] * t[:, None]


def test_i2v_forward_equals_diffusers():
    cfg, ref, ours = _pair(**I2V)
    assert {n for n, _ in ref.named_parameters()} == {n for n, _ in ours.named_parameters()}
    x = torch.randn(2, cfg.in_channels, 3, 8, 6)
    t = torch.tensor([37.0, 912.5])
    text = torch.randn(2, cfg.text_len, cfg.text_dim)
    image = torch.randn(2, IMAGE_TOKENS, cfg.image_dim)
    with torch.no_grad():
        expected = ref(x, t, text, encoder_hidden_states_image=image, return_dict=False)[0]
        got = ours.forward_video(x, t, text, image)
    assert got.shape == expected.shape == (2, cfg.out_channels, 3, 8, 6)
    torch.testing.assert_close(got, expected, **TOL)
    with pytest.raises(ValueError, match="model.image_dim=24 but the pack has no image tokens"):
        ours.forward_video(x, t, text)


def test_ti2v_per_token_timesteps_forward_equals_diffusers():
    cfg, ref, ours = _pair(**TI2V)
    x = torch.randn(2, cfg.in_channels, 3, 8, 6)
    t = _first_frame_timesteps(torch.tensor([37.0, 912.5]), (3, 4, 3))
    text = torch.randn(2, cfg.text_len, cfg.text_dim)
    with torch.no_grad():
        expected = ref(x, t, text, return_dict=False)[0]
        got = ours.forward_video(x, t, text)
    torch.testing.assert_close(got, expected, **TOL)


@pytest.mark.parametrize("overrides", [I2V, TI2V], ids=["i2v", "ti2v"])
def test_image_conditioned_gradients_equal_diffusers(overrides):
    cfg, ref, ours = _pair(**overrides)
    x = torch.randn(2, cfg.in_channels, 2, 4, 6)
    t = torch.tensor([37.0, 912.5])
    if cfg.condition == "ti2v":
        t = _first_frame_timesteps(t, (2, 2, 3))
    text = torch.randn(2, cfg.text_len, cfg.text_dim)
    image = torch.randn(2, IMAGE_TOKENS, cfg.image_dim) if cfg.image_dim else None
    target = torch.randn(2, cfg.out_channels, 2, 4, 6)
    ref.train()(x, t, text, encoder_hidden_states_image=image, return_dict=False)[0].sub(target).pow(2).mean().backward()
    ours.train().forward_video(x, t, text, image).sub(target).pow(2).mean().backward()
    want = dict(ref.named_parameters())
    for name, p in ours.named_parameters():
        torch.testing.assert_close(p.grad, want[name].grad, atol=1e-6, rtol=1e-4, msg=name)


def _conditioned_inputs(cfg):
    """Three image-conditioned videos of different sizes: latents, timesteps, prompts, I2V image
    tokens (or None) and TI2V per-token timesteps (or None)."""
    xs = [torch.randn(cfg.in_channels, 3, 8, 6), torch.randn(cfg.in_channels, 1, 4, 4),
          torch.randn(cfg.in_channels, 2, 6, 10)]
    t = torch.tensor([10.0, 500.0, 999.0])
    text = torch.randn(3, cfg.text_len, cfg.text_dim)
    image = torch.randn(3, IMAGE_TOKENS, cfg.image_dim) if cfg.image_dim else None
    steps = None
    if cfg.condition == "ti2v":
        steps = [_first_frame_timesteps(t[i : i + 1], (x.shape[1], x.shape[2] // 2, x.shape[3] // 2))[0]
                 for i, x in enumerate(xs)]
    return xs, t, text, image, steps


def _conditioned_pack(cfg, device="cpu"):
    xs, t, text, image, steps = _conditioned_inputs(cfg)
    return pack(xs, t, text, cfg.patch_size, image=image, token_timesteps=steps).to(device)


@pytest.mark.parametrize("overrides", [I2V, TI2V], ids=["i2v", "ti2v"])
def test_image_conditioned_pack_equals_each_sample_alone(overrides):
    """Three image-conditioned videos of different sizes in one padded pack: each sample's output
    equals diffusers on that sample alone (its own image tokens, its own per-token timesteps)."""
    cfg, ref, ours = _pair(**overrides, attention_backend="split")
    xs, t, text, image, steps = _conditioned_inputs(cfg)
    batch = pack(xs, t, text, cfg.patch_size, pad_to_multiple=4, image=image, token_timesteps=steps)
    assert batch.num_pad > 0
    with torch.no_grad():
        outs = unpack_outputs(ours(batch), batch, cfg.patch_size)
        for i, x in enumerate(xs):
            ti = steps[i][None] if steps is not None else t[i : i + 1]
            img = image[i : i + 1] if image is not None else None
            expected = ref(x[None], ti, text[i : i + 1], encoder_hidden_states_image=img, return_dict=False)[0][0]
            torch.testing.assert_close(outs[i], expected, **TOL)


@pytest.mark.parametrize("overrides", [I2V, TI2V], ids=["i2v", "ti2v"])
def test_import_export_roundtrip_bitwise(tmp_path, overrides):
    """A diffusers I2V/TI2V checkpoint loads into our model (same forward), exports bit for bit,
    and the export is one diffusers' from_pretrained loads."""
    import json

    from loongforge.diffusion.model import WanExperts
    from loongforge.diffusion.model.convert import export_diffusers, load_pretrained, read_diffusers_weights

    cfg = WanConfig(**overrides)
    torch.manual_seed(3)
    ref = WanTransformer3DModel(**cfg.diffusers_kwargs()).eval()
    ref.save_pretrained(str(tmp_path / "src"))
    model = WanExperts(cfg)
    load_pretrained(model, tmp_path / "src")
    x, text = torch.randn(1, cfg.in_channels, 2, 4, 4), torch.randn(1, cfg.text_len, cfg.text_dim)
    t = torch.tensor([400.0]) if cfg.condition == "i2v" else _first_frame_timesteps(torch.tensor([400.0]), (2, 2, 2))
    image = torch.randn(1, IMAGE_TOKENS, cfg.image_dim) if cfg.image_dim else None
    with torch.no_grad():
        torch.testing.assert_close(model.transformer.eval().forward_video(x, t, text, image),
                                   ref(x, t, text, encoder_hidden_states_image=image, return_dict=False)[0], **TOL)
    state = {f"transformer.{k}": v for k, v in model.transformer.state_dict().items()}
    (out,) = export_diffusers(state, cfg, tmp_path / "out")
    back = read_diffusers_weights(out)
    assert json.loads((out / "config.json").read_text())["image_dim"] == cfg.image_dim
    assert set(back) == set(ref.state_dict())
    for k, v in ref.state_dict().items():
        assert torch.equal(back[k], v), k
    loaded = WanTransformer3DModel.from_pretrained(str(out)).eval()
    for k, v in ref.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k
    with torch.no_grad():
        torch.testing.assert_close(loaded(x, t, text, encoder_hidden_states_image=image, return_dict=False)[0],
                                   ref(x, t, text, encoder_hidden_states_image=image, return_dict=False)[0])


def test_import_drops_what_diffusers_drops_and_refuses_unknown_keys_by_name(tmp_path):
    from safetensors.torch import load_file, save_file

    from loongforge.diffusion.model import WanExperts
    from loongforge.diffusion.model.convert import WEIGHTS, load_pretrained

    cfg = WanConfig(**I2V)
    WanTransformer3DModel(**cfg.diffusers_kwargs()).save_pretrained(str(tmp_path / "src"))
    path = tmp_path / "src" / WEIGHTS
    state = load_file(str(path))
    state["blocks.0.attn2.norm_added_q.weight"] = torch.ones(cfg.hidden_size)  # diffusers skips it on load
    save_file(state, str(path))
    load_pretrained(WanExperts(cfg), tmp_path / "src")
    state["blocks.0.attn2.add_q_proj.weight"] = torch.ones(cfg.hidden_size, cfg.hidden_size)
    save_file(state, str(path))
    with pytest.raises(ValueError, match=r"unexpected \['blocks.0.attn2.add_q_proj.weight'\]"):
        load_pretrained(WanExperts(cfg), tmp_path / "src")
    # a T2V model refuses the I2V checkpoint by its config
    with pytest.raises(ValueError, match="in_channels=12 but model.in_channels=4"):
        load_pretrained(WanExperts(WanConfig()), tmp_path / "src")


def test_pretrained_reads_the_image_conditioning_from_the_checkpoint(tmp_path):
    """``model.pretrained=DIR``: an I2V transformer's config.json gives condition=i2v, image_dim
    and the channels; a TI2V pipeline's model_index.json (``expand_timesteps``) gives ti2v."""
    import json

    from loongforge.diffusion.cli import load_recipe

    WanTransformer3DModel(**WanConfig(**(I2V | dict(num_layers=3))).diffusers_kwargs()).save_pretrained(
        str(tmp_path / "i2v"))
    m = load_recipe(None, [f"model.pretrained={tmp_path / 'i2v'}"]).model
    assert (m.condition, m.in_channels, m.out_channels, m.image_dim, m.added_kv_proj_dim, m.num_layers) == (
        "i2v", 12, 4, 24, 64, 3)
    WanTransformer3DModel(**WanConfig(in_channels=6, out_channels=6).diffusers_kwargs()).save_pretrained(
        str(tmp_path / "ti2v" / "transformer"))
    (tmp_path / "ti2v" / "model_index.json").write_text(json.dumps({"expand_timesteps": True}))
    for directory in (tmp_path / "ti2v", tmp_path / "ti2v" / "transformer"):
        m = load_recipe(None, [f"model.pretrained={directory}"]).model
        assert (m.condition, m.in_channels, m.image_dim) == ("ti2v", 6, None)
    # TI2V's transformer may train text-to-video; an I2V one cannot drop its condition channels
    assert load_recipe(None, [f"model.pretrained={tmp_path / 'ti2v'}", "model.condition=none"]).model.condition == "none"
    with pytest.raises(ValueError, match="model.condition='ti2v' but .* has condition='i2v'"):
        load_recipe(None, [f"model.pretrained={tmp_path / 'i2v'}", "model.condition=ti2v"])


@pytest.mark.parametrize("overrides", [I2V, TI2V], ids=["i2v", "ti2v"])
def test_image_to_video_sampling_follows_wan_pipeline(overrides):
    """Euler sampling from an image equals WanImageToVideoPipeline's loop on the same weights:
    I2V concatenates the mask and condition latents and passes the CLIP tokens at every step; TI2V
    (expand_timesteps) puts the condition frame in at timestep 0 and back into the result."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    from loongforge.diffusion.conditioning import ImageCondition, first_frame_mask
    from loongforge.diffusion.model import WanExperts
    from loongforge.diffusion.sampling import generate

    cfg = WanConfig(**overrides)
    torch.manual_seed(1)
    experts = WanExperts(cfg).eval()
    ref = WanTransformer3DModel(**cfg.diffusers_kwargs()).eval()
    ref.load_state_dict(experts.transformer.state_dict())
    shape = (cfg.out_channels, 3, 4, 6)
    text = torch.randn(2, cfg.text_len, cfg.text_dim)
    if cfg.condition == "i2v":
        conds = [ImageCondition(torch.randn(shape), torch.randn(IMAGE_TOKENS, cfg.image_dim)) for _ in range(2)]
    else:
        conds = [ImageCondition(torch.randn(cfg.out_channels, 1, 4, 6)) for _ in range(2)]
    got = generate(experts, experts.config, text, [shape, shape], num_steps=5, shift=3.0, seed=3, image_conditions=conds)

    g = torch.Generator().manual_seed(3)
    latents = torch.stack([torch.randn(shape, generator=g), torch.randn(shape, generator=g)])
    condition = torch.stack([c.latent for c in conds])
    image = torch.stack([c.image for c in conds]) if cfg.image_dim else None
    mask = torch.ones(1, 1, *shape[1:])
    mask[:, :, 0] = 0  # the pipeline's TI2V first_frame_mask
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    scheduler.set_timesteps(5)
    with torch.no_grad():
        for t in scheduler.timesteps:
            if cfg.condition == "i2v":
                i2v_mask = first_frame_mask(cfg.mask_channels, shape)[None].expand(2, -1, -1, -1, -1)
                inputs, timestep = torch.cat([latents, i2v_mask, condition], dim=1), t.expand(2)
            else:
                inputs = (1 - mask) * condition + mask * latents
                timestep = (mask[0][0][:, ::2, ::2] * t).flatten()[None].expand(2, -1)
            v = ref(inputs, timestep, text, encoder_hidden_states_image=image, return_dict=False)[0]
            latents = scheduler.step(v, t, latents, return_dict=False)[0]
    if cfg.condition == "ti2v":
        latents = (1 - mask) * condition + mask * latents
    torch.testing.assert_close(torch.stack(got), latents, atol=1e-4, rtol=1e-4)


def test_ti2v_loss_leaves_the_given_first_frame_out():
    from loongforge.diffusion.objective import token_weights

    w = token_weights([6, 4], 2, "token", 8, given=[2, 0])
    assert w.tolist() == [0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0]
    w = token_weights([6, 4], 0, "sample", 8, given=[2, 4])
    assert w.tolist() == [0, 0] + [1 / 32] * 4 + [0] * 4


@pytest.mark.parametrize("overrides, match", [
    (dict(image_dim=8), "set both"),
    (dict(image_dim=8, added_kv_proj_dim=32, condition="i2v", in_channels=12), "must be the hidden size"),
    (dict(image_dim=8, added_kv_proj_dim=64, in_channels=12), "needs model.condition='i2v'"),
    (dict(condition="i2v"), r"in_channels \(4\) = 2 x model.out_channels \(4\)"),
    (dict(in_channels=12), "needs model.condition='i2v'"),
    (dict(condition="ti2v", patch_size=[2, 2, 2]), "temporal patch of 1"),
    (dict(condition="flf2v"), "one of none, i2v, ti2v"),
])
def test_condition_config_errors(overrides, match):
    with pytest.raises(ValueError, match=match):
        WanConfig(**overrides)


def test_released_image_to_video_flavours_match_diffusers_on_meta(capsys):
    """The shipped Wan 2.1 I2V 14B and Wan 2.2 TI2V 5B configs build (on the meta device) with
    exactly the parameters of diffusers' model of the same config; `info` reports the size."""
    from loongforge.core.models import get_model_spec
    from loongforge.diffusion.cli import main
    from loongforge.diffusion.model.spec import load_flavour

    spec = get_model_spec("wan")
    for flavour, condition in (("wan2.1-i2v-14b", "i2v"), ("wan2.2-ti2v-5b", "ti2v"),
                               ("debug-i2v", "i2v"), ("debug-ti2v", "ti2v")):
        cfg = load_flavour(flavour)
        assert cfg.condition == condition
        with torch.device("meta"):
            ours = spec.build(cfg)
            ref = WanTransformer3DModel(**cfg.diffusers_kwargs())
        assert {k: tuple(v.shape) for k, v in ours.transformer.state_dict().items()} == {
            k: tuple(v.shape) for k, v in ref.state_dict().items()}, flavour
    assert main(["info", "model=wan2_1_i2v_14b"]) == 0
    assert "parameters per part: 16394.88M" in capsys.readouterr().out
    from loongforge.diffusion.cli import load_recipe

    for config, condition in (("tiny_i2v", "i2v"), ("tiny_ti2v", "ti2v"), ("wan2_1_i2v_14b", "i2v"),
                              ("wan2_2_ti2v_5b", "ti2v")):  # the shipped train configs compose
        assert load_recipe(config, []).model.condition == condition


@pytest.mark.slow
@pytest.mark.long  # (the default tier's budget: test_model_equivalence compares compiled blocks with eager)
@pytest.mark.parametrize("overrides", [I2V, TI2V], ids=["i2v", "ti2v"])
def test_image_conditioned_compiled_blocks_equal_eager(overrides):
    """Regional compilation with selective checkpointing over an image-conditioned pack: output and
    gradients equal eager, both layers share one graph (the image tokens and the per-token
    modulation rows are block inputs like the prompt)."""
    import torch._dynamo
    import torch._inductor.config
    from torch._dynamo.utils import counters

    cfg, _, eager = _pair(**overrides)
    compiled = WanDiT(cfg)
    compiled.load_state_dict(eager.state_dict())
    for model in (eager, compiled):
        model.set_recompute("selective")
    torch._dynamo.reset()
    counters.clear()
    batch = _conditioned_pack(cfg)
    with torch._inductor.config.patch(compile_threads=1), torch._dynamo.config.patch(error_on_recompile=True):
        compiled.compile_regions(dynamic=False)
        results = []
        for model in (eager, compiled):
            out = model(batch)
            out.pow(2).mean().backward()
            results.append((out.detach(), {k: p.grad for k, p in model.named_parameters()}))
    assert counters["stats"]["unique_graphs"] == 2 and not counters["graph_break"]
    torch.testing.assert_close(results[1][0], results[0][0], atol=1e-5, rtol=1e-5)
    for k, g in results[0][1].items():
        torch.testing.assert_close(results[1][1][k], g, atol=1e-5, rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the varlen (flash) and cudnn backends need a CUDA device")
@pytest.mark.parametrize("backend", ["varlen", "cudnn", "auto"])
@pytest.mark.parametrize("overrides", [I2V, TI2V], ids=["i2v", "ti2v"])
def test_image_conditioned_pack_backends_equal_split_on_gpu(overrides, backend):
    """The CUDA attention backends over the image tokens' segments (I2V) and with per-token
    modulation rows (TI2V), bf16, against the per-sample SDPA backend."""
    cfg = WanConfig(**overrides, attention_backend=backend)
    ours = WanDiT(cfg).cuda().to(torch.bfloat16).eval()
    batch = _conditioned_pack(cfg, "cuda")
    with torch.no_grad():
        got = ours(batch)
        ours.config.attention_backend = "split"
        split = ours(batch)
    torch.testing.assert_close(got.float(), split.float(), atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("flavour", ["i2v", "ti2v"])
def test_sampling_from_an_image_file_equals_wan_image_to_video_pipeline(builtin_latents, tmp_path, flavour):
    """`sample.image` end to end against diffusers' own WanImageToVideoPipeline with the same tiny
    VAE, CLIP encoder, weights, prompt embedding and noise: our image encoding (resize, the I2V
    condition video and mask, CLIP's penultimate tokens, latent normalisation; TI2V's image latent)
    and sampling loop give the pipeline's latents."""
    import numpy as np
    from diffusers import FlowMatchEulerDiscreteScheduler, WanImageToVideoPipeline
    from PIL import Image

    from loongforge.diffusion.cli import load_recipe
    from loongforge.diffusion.data.encoders import load_image_encoder, load_text_encoder, load_vae
    from loongforge.diffusion.data.shards import LatentShards
    from loongforge.diffusion.model import WanExperts
    from loongforge.diffusion.sampling import encode_sample_image, generate

    png = tmp_path / "start.png"
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 256, (32, 48, 3), dtype=np.uint8)).save(png)
    # diffusers' I2V attention takes the last 512 context tokens as the prompt
    recipe = load_recipe(f"tiny_{flavour}", [f"sample.image={png}", "sample.num_frames=5", "sample.height=32",
                                             "sample.width=48", "model.text_len=512"])
    cfg, encoders = recipe.model, builtin_latents.parent / "encoders"
    facts = LatentShards(builtin_latents).manifest
    vae = load_vae(encoders, "cpu")
    cond = encode_sample_image(recipe, facts, vae, "cpu")
    torch.manual_seed(5)
    experts = WanExperts(cfg).eval()
    text = torch.randn(1, cfg.text_len, cfg.text_dim)
    shape = (cfg.out_channels, 2, 4, 6)  # 5 frames of 32 x 48 through the 4x / 8x VAE
    got = generate(experts, experts.config, text, [shape], num_steps=3, shift=3.0, seed=7, image_conditions=[cond])[0]

    ref = WanTransformer3DModel(**cfg.diffusers_kwargs()).eval()
    ref.load_state_dict(experts.transformer.state_dict())
    tokenizer, text_encoder = load_text_encoder(encoders, None, "cpu")
    processor, clip = load_image_encoder(encoders, "cpu") if cfg.image_dim else (None, None)
    pipe = WanImageToVideoPipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, transformer=ref,
                                   scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), image_processor=processor,
                                   image_encoder=clip, expand_timesteps=cfg.condition == "ti2v")
    noise = torch.randn(shape, generator=torch.Generator().manual_seed(7))[None]
    with Image.open(png) as image:
        want = pipe(image=image.convert("RGB"), prompt_embeds=text, height=32, width=48, num_frames=5,
                    num_inference_steps=3, guidance_scale=1.0, latents=noise, output_type="latent",
                    return_dict=False)[0][0]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)

"""The Wan DiT against diffusers' WanTransformer3DModel on the same weights."""

import json

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, WanTransformer3DModel
from torch.utils._python_dispatch import TorchDispatchMode

from loongforge.diffusion.model import WanConfig, WanDiT, WanExperts
from loongforge.diffusion.model.dit import attention_ops
from loongforge.diffusion.model.convert import export_diffusers, load_pretrained, read_diffusers_weights
from loongforge.diffusion.packing import pack, unpack_outputs
from loongforge.diffusion.sampling import generate

TOL = dict(atol=2e-5, rtol=1e-5)


def _pair(**overrides):
    cfg = WanConfig(**overrides)
    ref = WanTransformer3DModel(**cfg.diffusers_kwargs()).eval()
    ours = WanDiT(cfg).eval()
    ours.load_state_dict(ref.state_dict(), strict=True)
    return cfg, ref, ours


# text_len=2: cross-attention has 12x more queries than keys, so it runs as a batch of query chunks
@pytest.mark.parametrize("overrides", [{}, {"cross_attn_norm": False, "patch_size": [2, 2, 2], "num_attention_heads": 4,
                                             "attention_head_dim": 16}, {"text_len": 2}])
def test_forward_equals_diffusers(overrides):
    cfg, ref, ours = _pair(**overrides)
    pt = cfg.patch_size[0]
    x = torch.randn(2, cfg.in_channels, 2 * pt, 8, 6)
    t = torch.tensor([37.0, 912.5])
    text = torch.randn(2, cfg.text_len, cfg.text_dim)
    with torch.no_grad():
        expected = ref(x, t, text, return_dict=False)[0]
        got = ours.forward_video(x, t, text)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, **TOL)


def test_gradients_equal_diffusers():
    """Every parameter's gradient of the same loss equals diffusers' (fp32): our backward, the
    feed-forward's own included, is the exact model's."""
    cfg, ref, ours = _pair()
    x = torch.randn(2, cfg.in_channels, 2, 8, 6)
    t = torch.tensor([37.0, 912.5])
    text = torch.randn(2, cfg.text_len, cfg.text_dim)
    target = torch.randn_like(x)
    ref.train()(x, t, text, return_dict=False)[0].sub(target).pow(2).mean().backward()
    ours.train().forward_video(x, t, text).sub(target).pow(2).mean().backward()
    want = dict(ref.named_parameters())
    for name, p in ours.named_parameters():
        torch.testing.assert_close(p.grad, want[name].grad, atol=1e-6, rtol=1e-4, msg=name)


@pytest.mark.parametrize("backend", ["split", "masked", "flex"])
def test_packed_mixed_sizes_equal_each_sample_alone(backend):
    """Three videos of different durations and resolutions in one padded pack: every sample's
    output equals diffusers run on that sample alone."""
    cfg, ref, ours = _pair(attention_backend=backend)
    xs = [torch.randn(4, 3, 8, 6), torch.randn(4, 1, 4, 4), torch.randn(4, 2, 6, 10)]
    t = torch.tensor([10.0, 500.0, 999.0])
    text = torch.randn(3, cfg.text_len, cfg.text_dim)
    batch = pack(xs, t, text, cfg.patch_size, pad_to_multiple=4)
    assert batch.num_pad > 0 and batch.num_tokens % 4 == 0
    with torch.no_grad():
        outs = unpack_outputs(ours(batch), batch, cfg.patch_size)
        for i, x in enumerate(xs):
            expected = ref(x[None], t[i : i + 1], text[i : i + 1], return_dict=False)[0][0]
            torch.testing.assert_close(outs[i], expected, **TOL)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the varlen (flash) and cudnn backends need a CUDA device")
@pytest.mark.parametrize("backend", ["varlen", "cudnn"])
def test_pack_backends_equal_split_on_gpu(backend):
    cfg = WanConfig(attention_backend=backend)
    ours = WanDiT(cfg).cuda().to(torch.bfloat16).eval()
    xs = [torch.randn(4, 3, 8, 6), torch.randn(4, 1, 4, 4), torch.randn(4, 2, 6, 10)]
    batch = pack(xs, torch.tensor([10.0, 500.0, 999.0]), torch.randn(3, cfg.text_len, cfg.text_dim), cfg.patch_size).to("cuda")
    with torch.no_grad():
        got = ours(batch)
        ours.config.attention_backend = "split"
        split = ours(batch)
    torch.testing.assert_close(got.float(), split.float(), atol=3e-2, rtol=3e-2)


class _CountForwardOps(TorchDispatchMode):
    """Counts the forward ops run inside it: fused attention kernels, GEMMs of linear layers
    (``addmm``: every biased ``nn.Linear`` forward, the backward's gradient GEMMs being plain
    ``mm``; FP8 ``_scaled_mm`` on an e4m3 activation, the backward's having e5m2 grads) and the
    fused FP8 cast ops' e4m3 casts (the backward casts e5m2 grads; the feed-forward's GELU output
    is cast by its own op)."""

    def __init__(self):
        super().__init__()
        self.attention = self.linear = self.fp8 = self.fp8_casts = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.attention += func in attention_ops()
        fp8 = func is torch.ops.aten._scaled_mm.default and args[0].dtype == torch.float8_e4m3fn
        self.linear += func is torch.ops.aten.addmm.default or fp8
        self.fp8 += fp8
        name = func.name()
        self.fp8_casts += (name == "loongforge::fp8_cast_transpose" and not args[2]) or name == "loongforge::gelu_fp8_cast_transpose"
        return func(*args, **(kwargs or {}))


def _packed_pair_batch(cfg):
    return pack([torch.randn(4, 3, 4, 6), torch.randn(4, 1, 6, 4)], torch.tensor([100.0, 700.0]),
                torch.randn(2, cfg.text_len, cfg.text_dim), cfg.patch_size)


def _recomputed_under_each_policy(ours: WanDiT, batch) -> dict[str, _CountForwardOps]:
    """The forward ops each checkpointing policy reruns in the backward; asserts that every
    policy gives the gradients of no checkpointing."""
    grads, recomputed = {}, {}
    for policy in ("none", "full", "selective"):
        ours.zero_grad()
        ours.set_recompute(policy)
        loss = ours(batch).pow(2).mean()
        with _CountForwardOps() as count:
            loss.backward()
        recomputed[policy] = count
        grads[policy] = {k: p.grad.clone() for k, p in ours.named_parameters()}
    for policy in ("full", "selective"):
        for k in grads["none"]:
            torch.testing.assert_close(grads[policy][k], grads["none"][k], atol=1e-6, rtol=1e-5)
    return recomputed


@pytest.mark.parametrize("fp8", ["none", "tensorwise"])
def test_activation_checkpointing_policies_same_gradients(fp8):
    """full and selective checkpointing give the gradients of no checkpointing; full recomputes
    every attention and linear layer of the blocks in the backward, selective none of them (it
    keeps their outputs, FP8 GEMMs' too, and recomputes only the elementwise work)."""
    cfg, _, ours = _pair(fp8=fp8)
    recomputed = _recomputed_under_each_policy(ours, _packed_pair_batch(cfg))
    # attention: 2 layers x (self + cross) x 2 samples (the CPU backend runs one SDPA call per
    # sample); linear: 2 layers x (q/k/v fused, out, cross q, cross k/v fused, cross out, FFN up, down)
    assert {p: (c.attention, c.linear) for p, c in recomputed.items()} == {
        "none": (0, 0), "full": (8, 14), "selective": (0, 0)}
    with pytest.raises(ValueError, match="activation recomputation .yes."):
        ours.set_recompute("yes")


def test_selective_checkpointing_keeps_fused_fp8_casts():
    """With the fused cast op (Triton interpreter here) ``selective`` recomputes no FP8 cast in
    the backward (it keeps their outputs), ``full`` recomputes every one, and both give the
    gradients of no checkpointing."""
    from loongforge.diffusion.ops.feed_forward import FeedForwardKernels
    from loongforge.kernels.fp8_cast import fp8_cast_transpose
    from loongforge.kernels.gelu import gelu_fp8_cast_transpose, gelu_tanh_backward, gelu_tanh_backward_in_place

    cfg, _, ours = _pair(fp8="tensorwise")
    for module in ours.modules():
        if getattr(module, "fp8_cast", None) is not None:
            module.fp8_cast = fp8_cast_transpose
        if hasattr(module, "ffn_kernels"):
            module.ffn_kernels = FeedForwardKernels(gelu_tanh_backward, gelu_tanh_backward_in_place,
                                                    fp8_cast_transpose, gelu_fp8_cast_transpose)
    recomputed = _recomputed_under_each_policy(ours, _packed_pair_batch(cfg))
    # 2 layers x 6 FP8 linears x (input, weight); the down-projection's input is the GELU cast
    assert {p: c.fp8_casts for p, c in recomputed.items()} == {"none": 0, "full": 24, "selective": 0}


def test_fp8_tensorwise_blocks_stay_near_the_exact_model():
    """``model.fp8=tensorwise``: the blocks' token linears run FP8 GEMMs (e4m3 rounding, so the
    output moves by a few percent, not more) and the prompt's key/value projection does not."""
    cfg, _, exact = _pair()
    fp8 = WanDiT(WanConfig(fp8="tensorwise"))
    fp8.load_state_dict(exact.state_dict())
    batch = _packed_pair_batch(cfg)
    with torch.no_grad(), _CountForwardOps() as count:
        got = fp8(batch)
    want = exact(batch).detach()
    # 2 blocks x (self q/k/v, self out, cross q, cross out, FFN up, down) in FP8; the cross k/v
    # GEMMs, 5 embedder linears, the patch embedding and the head are not
    assert (count.fp8, count.linear) == (2 * 6, 2 * 7 + 7)
    rel = ((got - want).norm() / want.norm()).item()
    assert 0 < rel < 0.1


@pytest.mark.parametrize("overrides, match", [
    ({"fp8": "e4m3"}, "model.fp8='e4m3': one of none, tensorwise"),
    ({"fp8": "tensorwise", "ffn_dim": 100}, r"model.ffn_dim \(100\) to be multiples of 16"),
    ({"fp8": "tensorwise", "attention_head_dim": 12, "num_attention_heads": 2},
     r"model.num_attention_heads x model.attention_head_dim \(24\)"),
])
def test_fp8_config_errors(overrides, match):
    with pytest.raises(ValueError, match=match):
        WanConfig(**overrides)


@pytest.mark.slow
@pytest.mark.parametrize("fp8", ["none", "tensorwise"])
def test_compiled_blocks_equal_eager(fp8):
    """Regional compilation (inductor, fp32 on CPU) with selective checkpointing inside the
    compiled blocks, with plain and FP8 linears: output and gradients equal the eager model's,
    both layers run one graph, the output head another, and nothing breaks them."""
    import torch._dynamo
    import torch._inductor.config
    from torch._dynamo.utils import counters

    cfg, _, eager = _pair(fp8=fp8)
    eager.set_recompute("selective")
    compiled = WanDiT(cfg)
    compiled.load_state_dict(eager.state_dict())
    compiled.set_recompute("selective")
    torch._dynamo.reset()
    counters.clear()
    # no worker pool for small graphs; the second layer must reuse the first layer's graph
    with torch._inductor.config.patch(compile_threads=1), torch._dynamo.config.patch(error_on_recompile=True):
        compiled.compile_regions(dynamic=False)
        batch = pack([torch.randn(4, 3, 4, 6)], torch.tensor([100.0]), torch.randn(1, cfg.text_len, cfg.text_dim),
                     cfg.patch_size)
        results = []
        for model in (eager, compiled):
            out = model(batch)
            out.pow(2).mean().backward()
            results.append((out.detach(), {k: p.grad for k, p in model.named_parameters()}))
    assert counters["stats"]["unique_graphs"] == 2 and not counters["graph_break"]  # the blocks' and the head's
    torch.testing.assert_close(results[1][0], results[0][0], atol=1e-5, rtol=1e-5)
    for k, g in results[0][1].items():
        torch.testing.assert_close(results[1][1][k], g, atol=1e-5, rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled bf16 blocks with cuDNN/varlen attention need CUDA")
@pytest.mark.parametrize("fp8,backend", [("none", "auto"), ("tensorwise", "auto"), ("none", "cudnn")])
def test_compiled_blocks_equal_eager_on_gpu(fp8, backend):
    """The trainer's compiled path on CUDA (bf16 autocast, selective checkpointing, automatic
    dynamic shapes) over packs of changing layout (one video: SDPA; several: varlen, or the cuDNN
    segment op where the backend asks for it) equals eager
    within bf16 tolerance, without recompiling for every layout; with FP8 linears too (the Triton
    cast-transpose op inside compiled, checkpointed blocks)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    if fp8 != "none" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 linears need an sm_89+ GPU")
    cfg = WanConfig(fp8=fp8, attention_backend=backend)
    eager = WanDiT(cfg).cuda()
    compiled = WanDiT(cfg).cuda()
    compiled.load_state_dict(eager.state_dict())
    for model in (eager, compiled):
        model.set_recompute("selective")
    torch._dynamo.reset()
    counters.clear()
    compiled.compile_regions(dynamic=None)
    packs = [[torch.randn(4, 3, 8, 6)], [torch.randn(4, 3, 8, 6), torch.randn(4, 1, 4, 4), torch.randn(4, 2, 6, 10)],
             [torch.randn(4, 2, 4, 6), torch.randn(4, 3, 6, 6)], [torch.randn(4, 1, 8, 8), torch.randn(4, 2, 2, 6)]]
    for xs in packs:
        batch = pack(xs, torch.rand(len(xs)) * 1000, torch.randn(len(xs), cfg.text_len, cfg.text_dim), cfg.patch_size)
        batch = batch.to("cuda")
        results = []
        for model in (eager, compiled):
            model.zero_grad()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = model(batch)
            out.float().pow(2).mean().backward()
            results.append((out.float(), model.blocks[0].attn1.to_q.weight.grad))
        torch.testing.assert_close(results[1][0], results[0][0], atol=3e-2, rtol=3e-2)
        torch.testing.assert_close(results[1][1], results[0][1], atol=3e-2, rtol=5e-2)
    # blocks and head each: a one-video graph, a pack graph, then one length-generic pack graph
    assert counters["stats"]["unique_graphs"] <= 6


def test_pretrained_import_and_export_roundtrip(tmp_path):
    cfg = WanConfig()
    ref = WanTransformer3DModel(**cfg.diffusers_kwargs()).eval()
    ref.save_pretrained(str(tmp_path / "src"))
    model = WanExperts(cfg)
    load_pretrained(model, tmp_path / "src")
    x, t, text = torch.randn(1, 4, 2, 4, 4), torch.tensor([400.0]), torch.randn(1, cfg.text_len, cfg.text_dim)
    with torch.no_grad():
        torch.testing.assert_close(model.transformer.eval().forward_video(x, t, text), ref(x, t, text, return_dict=False)[0], **TOL)
    state = {f"transformer.{k}": v for k, v in model.transformer.state_dict().items()}
    (out,) = export_diffusers(state, cfg, tmp_path / "out")
    back = read_diffusers_weights(out)
    assert json.loads((out / "config.json").read_text())["_class_name"] == "WanTransformer3DModel"
    assert set(back) == set(ref.state_dict())
    for k, v in ref.state_dict().items():
        assert torch.equal(back[k], v), k
    with pytest.raises(ValueError, match="num_layers=2 but model.num_layers=3"):
        load_pretrained(WanExperts(WanConfig(num_layers=3)), tmp_path / "src")


@pytest.mark.parametrize("boundary_ratio", [None, 0.6])
def test_export_loads_with_diffusers_from_pretrained(tmp_path, boundary_ratio):
    """What export_diffusers writes (one transformer, or Wan 2.2's transformer/ + transformer_2/)
    is a checkpoint diffusers' WanTransformer3DModel.from_pretrained loads, with our weights and
    our forward."""
    cfg = WanConfig(boundary_ratio=boundary_ratio)
    torch.manual_seed(2)
    experts = WanExperts(cfg).eval()
    state = {f"{name}.{k}": v for name in experts.names for k, v in experts.expert(name).state_dict().items()}
    written = export_diffusers(state, cfg, tmp_path / "out")
    assert len(written) == len(experts.names)
    x, t, text = torch.randn(1, 4, 2, 4, 4), torch.tensor([400.0]), torch.randn(1, cfg.text_len, cfg.text_dim)
    for name, directory in zip(experts.names, written):
        if boundary_ratio is None:
            loaded = WanTransformer3DModel.from_pretrained(str(tmp_path / "out"))
        else:
            loaded = WanTransformer3DModel.from_pretrained(str(tmp_path / "out"), subfolder=name)
        loaded.eval()
        ours = experts.expert(name)
        assert set(loaded.state_dict()) == set(ours.state_dict())
        for k, v in ours.state_dict().items():
            assert torch.equal(loaded.state_dict()[k], v), k
        with torch.no_grad():
            torch.testing.assert_close(loaded(x, t, text, return_dict=False)[0], ours.forward_video(x, t, text), **TOL)


def test_two_expert_sampling_follows_wan_pipeline():
    """Euler sampling with two experts equals WanPipeline's loop (diffusers scheduler, transformer
    for t >= boundary, transformer_2 below) on the same weights."""
    cfg = WanConfig(boundary_ratio=0.6)
    torch.manual_seed(1)
    experts = WanExperts(cfg).eval()
    refs = {}
    for name in experts.names:
        refs[name] = WanTransformer3DModel(**cfg.diffusers_kwargs()).eval()
        refs[name].load_state_dict(experts.expert(name).state_dict())
    text = torch.randn(2, cfg.text_len, cfg.text_dim)
    shape = (4, 2, 4, 6)
    got = generate(experts, experts.config, text, [shape, shape], num_steps=6, shift=2.0, seed=3)

    g = torch.Generator().manual_seed(3)
    latents = torch.stack([torch.randn(shape, generator=g), torch.randn(shape, generator=g)])
    scheduler = FlowMatchEulerDiscreteScheduler(shift=2.0)
    scheduler.set_timesteps(6)
    used = set()
    with torch.no_grad():
        for t in scheduler.timesteps:
            name = "transformer" if t >= 600 else "transformer_2"
            used.add(name)
            v = refs[name](latents, t.expand(2), text, return_dict=False)[0]
            latents = scheduler.step(v, t, latents, return_dict=False)[0]
    assert used == {"transformer", "transformer_2"}
    torch.testing.assert_close(torch.stack(got), latents, atol=1e-4, rtol=1e-4)


def test_registered_family_builds_every_flavour():
    from loongforge.core.models import get_model_spec
    from loongforge.diffusion.model.spec import load_flavour
    from loongforge.diffusion.task import packed_flops

    spec = get_model_spec("wan")
    assert spec.config_class is WanConfig
    assert load_flavour("debug") == WanConfig()
    a14b = load_flavour("wan2.2-t2v-a14b")
    assert a14b.boundary_ratio == 0.875 and a14b.num_layers == 40
    with torch.device("meta"):
        model = spec.build(load_flavour("wan2.1-t2v-1.3b"))
    assert model.names == ["transformer"]
    assert sum(p.numel() for p in model.parameters()) == 1_418_996_800
    # per-token FLOPs grow linearly with the length (attention) on top of the constant part
    f = [packed_flops(WanConfig().cost_model(), [n]) / n for n in (100, 200, 400)]
    assert f[0] < f[1] < f[2]

"""The Wan 2.x DiT over packed token sequences.

Parameters carry exactly the names and shapes of diffusers' ``WanTransformer3DModel`` (text-to-video
and image-to-video variants), so ``load_state_dict`` of a diffusers checkpoint is the identity
mapping (see ``model/convert.py``). The forward differs where training needs it:

- inputs are a ``PackedBatch``: several videos of different sizes in one sequence; self-attention
  and cross-attention respect per-sample boundaries, each sample has its own timestep, prompt and
  3D RoPE grid;
- image conditioning (``model.condition``): Wan 2.1 I2V's mask and condition latents are input
  channels like the noisy latent's, and its CLIP image tokens (``image_dim``) go through diffusers'
  image embedder and a second attention of the cross-attention's queries over them (diffusers'
  ``add_k_proj``/``add_v_proj``/``norm_added_k``; the two outputs are summed before ``to_out``);
  Wan 2.2 TI2V's per-token timesteps (``PackedBatch.token_timesteps``) are embedded once per
  distinct value of the pack and every token looks its row of the modulation up, as tokens of
  per-sample timesteps look up their sample's;
- patch embedding is one GEMM over the packed patches (the Conv3d's kernel equals its stride);
- query/key/value projections of self-attention are one GEMM (key/value of cross-attention
  another), on the concatenated diffusers weights;
- with ``model.fp8=tensorwise`` the linears over video tokens (self-attention's projections,
  cross-attention's query and output, the feed-forward) run their GEMMs in FP8
  (``loongforge.diffusion.ops.fp8_tensorwise``); prompt projections stay in the autocast dtype;
- self-attention's query/key RMSNorm and RoPE are one registry op on the fused QKV projection's
  output (``loongforge.diffusion.ops.attention_inputs.normed_rotated_qkv``: one pass forward, one
  backward that writes the projection's whole gradient), also inside compiled blocks;
  cross-attention's query and key RMSNorms go through the registry's ``rms_norm``, whose torch
  reference a compiled block (``compile_regions``) uses instead, for inductor to fuse;
- with a ``ContextParallel`` group each rank computes its slice of the tokens, exchanging heads for
  sequence around self-attention (Ulysses);
- LoRA (``lora.rank > 0``, ``loongforge.core.lora``): the layers whose weights the blocks use
  directly (the fused projections, the feed-forward) add their adapters' updates themselves;
  a block with adapters on its feed-forward runs it as separate ops instead of the fused one;
- per-block activation checkpointing: ``full`` recomputes the whole block in the backward
  (keeping only its inputs, as diffusers' gradient checkpointing, in compiled blocks too),
  ``selective`` keeps the outputs of the attention kernels and of the GEMMs and recomputes only
  the elementwise work between them (norms, modulation, RoPE, GELU, gates): the backward then
  repeats no FLOP-heavy op, for about half the activation memory of ``none`` (on an H200, 4
  Wan-1.3B layers at 14040 tokens: 1.8x diffusers' checkpointed step against 1.6x keeping the
  attention outputs alone).

The modules that have nothing to do with packing (time/text embedder, LayerNorms, GELU
feed-forward) are diffusers' own, so parameters and settings are diffusers'. Inside the blocks
the LayerNorms with their adaLN modulation (or affine parameters) run as
``loongforge.diffusion.ops.modulated_norm.normalize_and_modulate`` (fp32 statistics and
transform, as diffusers' ``FP32LayerNorm`` then the modulation), and the feed-forward as
``loongforge.diffusion.ops.feed_forward.gelu_feed_forward`` (the same ops forward, a backward
that reads the hidden activation once, FP8 GEMMs with ``model.fp8``, where the GELU output is
quantised from fp32).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch
import torch.nn as nn
import torch.nn.functional as F
from diffusers.models.attention import FeedForward
from diffusers.models.normalization import FP32LayerNorm
from diffusers.models.transformers.transformer_wan import WanTimeTextImageEmbedding
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from loongforge.core.kernels import get_kernel, get_kernel_with_backward
from loongforge.diffusion.ops.feed_forward import feed_forward_kernels, gelu_feed_forward
from loongforge.diffusion.ops.fp8_tensorwise import fp8_linear_tensorwise
from loongforge.diffusion.ops.modulated_norm import normalize_and_modulate
from loongforge.core.lora import LoRALinear, lora_delta
from loongforge.core.training.torch_model import TorchModel
from loongforge.diffusion.context_parallel import ContextParallel, heads_to_seq, seq_to_heads
from loongforge.diffusion.model.attention import Segments, packed_attention
from loongforge.diffusion.model.config import CHECKPOINTING, WanConfig
from loongforge.diffusion.model.rope import rope_tables
from loongforge.diffusion.ops.attention_inputs import normed_rotated_qkv
from loongforge.diffusion.packing import PackedBatch, pack, unpack_outputs


@dataclass
class TokenContext:
    """What every block needs about this rank's tokens (built once per forward)."""

    sample_index: torch.Tensor  # [n] sample of each local token
    modulation_index: torch.Tensor | None  # [n] row of the timestep modulation of each token; None: one row
    rope_cos: torch.Tensor  # [n, head_dim / 2]: angle of each channel pair of a head
    rope_sin: torch.Tensor
    self_segments: Segments  # samples (and padding) of the full sequence (after the Ulysses all-to-all)
    cross_q_segments: Segments  # local token segments, one per locally present sample
    cross_k_segments: Segments  # their prompt rows in text[first_sample:last_sample + 1]
    image_k_segments: Segments | None  # their image tokens in image[first_sample:last_sample + 1] (I2V)
    first_sample: int
    last_sample: int
    backend: str
    cp: ContextParallel | None

    def per_token(self, per_row: torch.Tensor) -> torch.Tensor:
        """A modulation ``[rows, ...]`` (per sample, or per distinct timestep) per token."""
        return per_token(per_row, self.modulation_index)


def per_token(per_row: torch.Tensor, row_index: torch.Tensor | None) -> torch.Tensor:
    """``[rows, ...]`` -> broadcastable per-token ``[n or 1, ...]`` (``row_index`` None: one row)."""
    return per_row[:1] if row_index is None else per_row[row_index]


@cache
def attention_ops() -> frozenset:
    """The fused attention ops (every SDPA kernel, flash varlen)."""
    import torch.nn.attention.varlen  # noqa: F401  (registers torch_attn::_varlen_attn)

    names = ("_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention",
             "_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention_for_cpu")
    ops = {getattr(torch.ops.aten, n).default for n in names if hasattr(torch.ops.aten, n)}
    ops.add(torch.ops.torch_attn._varlen_attn.default)
    return frozenset(ops)


@cache
def kept_ops() -> frozenset:
    """The ops whose outputs selective checkpointing keeps: attention kernels, GEMMs (every
    ``nn.Linear`` of a block is ``addmm`` on its 2D packed tokens, ``mm`` without a bias,
    ``_scaled_mm`` in FP8) and the amax reductions that make FP8 scales (a scalar each; in a
    block only FP8 scales take an amax), which would otherwise make the backward recompute each
    FP8 linear's input to take it again."""
    return attention_ops() | {torch.ops.aten.addmm.default, torch.ops.aten.mm.default,
                              torch.ops.aten._scaled_mm.default, torch.ops.aten.amax.default}


# FP8 casts are kept too: their two FP8 copies together are the size of a bf16 input, and
# recomputing them means recomputing that input first (on the H200 bench: 2.5 ms a step slower).
# By name: the op exists only once loongforge-kernels has registered it. The ``cudnn`` attention
# backend's op is kept like every attention kernel.
KEPT_CUSTOM_OPS = ("loongforge::fp8_cast_transpose", "loongforge::gelu_fp8_cast_transpose",
                   "loongforge_diffusion::segment_attention")


def _keep_attention_and_gemms(ctx, op, *args, **kwargs):
    keep = op in kept_ops() or op.name() in KEPT_CUSTOM_OPS
    return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_contexts():
    return create_selective_checkpoint_contexts(_keep_attention_and_gemms)


def _recompute_everything(ctx, op, *args, **kwargs):
    return CheckpointPolicy.PREFER_RECOMPUTE


def _full_contexts():
    """``full`` as a policy that recomputes every op. Plain ``checkpoint`` inside a compiled block
    tags only the ops dynamo sees at the block's level as recomputable; the ops inside the
    block's own autograd functions (the adaLN norms, ``qk_norm_rope``, the feed-forward) come
    out untagged, and the partitioner then saves their outputs (the feed-forward's hidden
    activation, the norms' outputs, bf16 copies of the weights): on the whole Wan 1.3B at 32760
    tokens, 60.7 GiB a step against diffusers' 24.1 GiB. A policy goes through the
    selective-checkpointing path, which tags every op the block runs, theirs included; eager, it
    recomputes exactly what plain checkpointing does."""
    return create_selective_checkpoint_contexts(_recompute_everything)


def _fp8_cast(fp8: bool):
    """The registry's ``fp8_cast_transpose`` for FP8 linears (fused even in compiled blocks), or None."""
    return get_kernel("fp8_cast_transpose") if fp8 else None


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, fp8_cast) -> torch.Tensor:
    """``F.linear``, or its tensor-wise FP8 form when ``fp8_cast`` is an FP8 cast op."""
    return F.linear(x, weight, bias) if fp8_cast is None else fp8_linear_tensorwise(x, weight, bias, fp8_cast)


def _with_adapter(out: torch.Tensor, layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``out`` (``layer``'s GEMM on ``x``) plus the layer's LoRA update, when it has an adapter."""
    delta = lora_delta(layer, x)
    return out if delta is None else out + delta.to(out.dtype)


def _concat_linear(x: torch.Tensor, linears: tuple[nn.Linear, ...], fp8_cast=None) -> torch.Tensor:
    """``torch.cat([l(x) for l in linears], -1)`` as one GEMM on the concatenated weights (plus
    the layers' LoRA updates, concatenated likewise, where they have adapters)."""
    weight = torch.cat([lin.weight for lin in linears])
    bias = torch.cat([lin.bias for lin in linears])
    out = _linear(x, weight, bias, fp8_cast)
    deltas = [lora_delta(lin, x) for lin in linears]
    if all(d is None for d in deltas):
        return out
    deltas = [d if d is not None else x.new_zeros(*x.shape[:-1], lin.out_features) for d, lin in zip(deltas, linears)]
    return out + torch.cat(deltas, -1).to(out.dtype)


def _local_cross_bounds(bounds: list[int], lo: int, hi: int) -> tuple[list[int], int, int]:
    """Clip global per-sample bounds to the local token range [lo, hi)."""
    first = max(i for i in range(len(bounds) - 1) if bounds[i] <= lo)
    last = max(i for i in range(len(bounds) - 1) if bounds[i] < hi)
    q = [0] + [min(max(b, lo), hi) - lo for b in bounds[first + 1 : last + 1]] + [hi - lo]
    return q, first, last


class WanAttention(nn.Module):
    """Self- or cross-attention with diffusers' ``WanAttention`` parameters (to_q/k/v, to_out.0,
    norm_q/norm_k RMSNorm across heads; with ``added_kv_proj_dim``, I2V's add_k_proj/add_v_proj/
    norm_added_k over image tokens). ``fp8``: the projections of video tokens run in FP8."""

    def __init__(self, dim: int, heads: int, eps: float, fp8: bool = False, added_kv_proj_dim: int | None = None):
        super().__init__()
        self.heads, self.head_dim, self.eps, self.fp8_cast = heads, dim // heads, eps, _fp8_cast(fp8)
        self.to_q = nn.Linear(dim, dim)
        self.to_k = nn.Linear(dim, dim)
        self.to_v = nn.Linear(dim, dim)
        self.to_out = nn.ModuleList([nn.Linear(dim, dim), nn.Dropout(0.0)])
        self.norm_q = nn.RMSNorm(dim, eps=eps)
        self.norm_k = nn.RMSNorm(dim, eps=eps)
        if added_kv_proj_dim is not None:
            self.add_k_proj = nn.Linear(added_kv_proj_dim, dim)
            self.add_v_proj = nn.Linear(added_kv_proj_dim, dim)
            self.norm_added_k = nn.RMSNorm(dim, eps=eps)
        self.qk_kernels = get_kernel_with_backward("qk_norm_rope")
        self.use_kernels(reference=False)

    def use_kernels(self, reference: bool) -> None:
        """Resolve cross-attention's ``rms_norm`` once: the registry's fused one, or the torch
        reference. Self-attention's ``qk_norm_rope`` ops are resolved when the module is built and
        stay fused in compiled blocks too (inductor calls them as they are)."""
        self.rms_norm = get_kernel("rms_norm", force_reference=reference or None)

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        return x.unflatten(-1, (self.heads, self.head_dim))

    def _keys_values(self, context: torch.Tensor, k_proj: nn.Linear, v_proj: nn.Linear, norm: nn.RMSNorm):
        """Normed keys and values of prompt or image tokens ``[rows, L, D]``, as heads."""
        k, v = _concat_linear(context.flatten(0, 1), (k_proj, v_proj)).chunk(2, dim=-1)
        return self._heads(self.rms_norm(k, norm.weight, self.eps)), self._heads(v)

    def forward(self, x: torch.Tensor, tc: TokenContext, text: torch.Tensor | None = None,
                image: torch.Tensor | None = None) -> torch.Tensor:
        if text is None:
            qkv = _concat_linear(x, (self.to_q, self.to_k, self.to_v), self.fp8_cast)
            q, k, v = (self._heads(t) for t in normed_rotated_qkv(
                qkv, self.norm_q.weight, self.norm_k.weight, tc.rope_cos, tc.rope_sin, self.eps, self.qk_kernels))
            if tc.cp is not None:
                q, k, v = (seq_to_heads(t, tc.cp) for t in (q, k, v))
            out = packed_attention(q, k, v, tc.self_segments, tc.self_segments, tc.backend)
            if tc.cp is not None:
                out = heads_to_seq(out, tc.cp)
        else:
            # cross-attention reads the prompts (and images) of the samples present in this rank's tokens
            if tc.cp is not None:
                text = text[tc.first_sample : tc.last_sample + 1]
            q = _with_adapter(_linear(x, self.to_q.weight, self.to_q.bias, self.fp8_cast), self.to_q, x)
            q = self._heads(self.rms_norm(q, self.norm_q.weight, self.eps))
            k, v = self._keys_values(text, self.to_k, self.to_v, self.norm_k)
            out = packed_attention(q, k, v, tc.cross_q_segments, tc.cross_k_segments, tc.backend)
            if image is not None:  # I2V: a second attention over the image tokens, summed (diffusers' order)
                if tc.cp is not None:
                    image = image[tc.first_sample : tc.last_sample + 1]
                k, v = self._keys_values(image, self.add_k_proj, self.add_v_proj, self.norm_added_k)
                assert tc.image_k_segments is not None  # made whenever the batch has image tokens
                out_image = packed_attention(q, k, v, tc.cross_q_segments, tc.image_k_segments, tc.backend)
                out = out.flatten(1).type_as(q) + out_image.flatten(1).type_as(q)
        proj, out = self.to_out[0], out.flatten(1).type_as(x)
        return _with_adapter(_linear(out, proj.weight, proj.bias, self.fp8_cast), proj, out)


class WanBlock(nn.Module):
    """diffusers' ``WanTransformerBlock`` (same parameters and numerics) on packed tokens."""

    def __init__(self, cfg: WanConfig):
        super().__init__()
        dim = cfg.hidden_size
        fp8 = cfg.fp8 != "none"
        self.attn1 = WanAttention(dim, cfg.num_attention_heads, cfg.eps, fp8)
        self.attn2 = WanAttention(dim, cfg.num_attention_heads, cfg.eps, fp8, cfg.added_kv_proj_dim)
        self.norm2 = FP32LayerNorm(dim, cfg.eps, elementwise_affine=True) if cfg.cross_attn_norm else nn.Identity()
        self.ffn = FeedForward(dim, inner_dim=cfg.ffn_dim, activation_fn="gelu-approximate")
        self.scale_shift_table = nn.Parameter(torch.randn(1, 6, dim) / dim**0.5)
        self.checkpointing, self.ffn_kernels = "none", feed_forward_kernels(fp8)  # set_recompute sets it
        # norm1/norm3 of diffusers' block have no parameters: their LayerNorm is ``_layer_norm``
        self.eps, self.norm_kernels = cfg.eps, get_kernel_with_backward("modulated_layer_norm")

    def forward(self, x: torch.Tensor, text: torch.Tensor, temb: torch.Tensor, tc: TokenContext,
                image: torch.Tensor | None = None) -> torch.Tensor:
        if self.checkpointing == "none" or not torch.is_grad_enabled():
            return self._forward(x, text, temb, tc, image)
        contexts = _selective_contexts if self.checkpointing == "selective" else _full_contexts
        return checkpoint(self._forward, x, text, temb, tc, image, use_reentrant=False, context_fn=contexts)

    def _forward(self, x: torch.Tensor, text: torch.Tensor, temb: torch.Tensor, tc: TokenContext,
                 image: torch.Tensor | None = None) -> torch.Tensor:
        # temb: [rows, 6, dim] per sample (or per distinct timestep); the norms look each token's
        # row up (no per-token copy of the modulation), the gates are gathered per token where
        # inductor fuses the gather
        mod = self.scale_shift_table + temb.float()
        shift_msa, scale_msa, gate_msa, c_shift, c_scale, c_gate = mod.unbind(1)

        h = self._layer_norm(x, 1 + scale_msa, shift_msa, tc.modulation_index)
        x = (x.float() + self.attn1(h, tc) * tc.per_token(gate_msa)).type_as(x)

        affine = not isinstance(self.norm2, nn.Identity)
        h = self._layer_norm(x, self.norm2.weight[None], self.norm2.bias[None], None) if affine else x
        x = x + self.attn2(h, tc, text, image)

        h = self._layer_norm(x, 1 + c_scale, c_shift, tc.modulation_index)
        return (x.float() + self._feed_forward(h).float() * tc.per_token(c_gate)).type_as(x)

    def _layer_norm(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                    index: torch.Tensor | None) -> torch.Tensor:
        """diffusers' ``(FP32LayerNorm(x.float()) * weight + bias).type_as(x)`` as one registry op,
        one pass forward and one backward; ``weight``/``bias``: the adaLN modulation ``1 + scale``/
        ``shift`` per row (``index``: the row of each token, None for one row), or the
        norm's own affine parameters."""
        return normalize_and_modulate(x, weight, bias, self.eps, self.norm_kernels, index)

    def _feed_forward(self, h: torch.Tensor) -> torch.Tensor:
        """diffusers' ``FeedForward`` (tanh-GELU, dropouts of 0) with a fused backward (and FP8 GEMMs)."""
        up, down = self.ffn.net[0].proj, self.ffn.net[2]
        if isinstance(up, LoRALinear) or isinstance(down, LoRALinear):  # adapters: the unfused ops
            fp8_cast = self.attn1.fp8_cast
            hidden = F.gelu(_with_adapter(_linear(h, up.weight, up.bias, fp8_cast), up, h), approximate="tanh")
            return _with_adapter(_linear(hidden, down.weight, down.bias, fp8_cast), down, hidden)
        return gelu_feed_forward(h, up.weight, up.bias, down.weight, down.bias, self.ffn_kernels)


# Inductor's mix-order reductions (a norm's per-token reduction fused with a weight or bias
# gradient's per-channel one) leave one partial row per `split` tokens, summed by ATen afterwards.
# The default split at Wan's token counts is 16 (878 rows at 14k tokens, 12 such sums per block,
# ~24 us each on an H200); at 64 the sums shrink 4x for less parallelism in the fused kernel,
# which measured 0.2-0.6 ms a step faster (4 Wan-1.3B blocks, 14040 tokens).
INDUCTOR_OPTIONS = {"triton.mix_order_reduction_split_size": 64}


class WanDiT(TorchModel):
    def __init__(self, cfg: WanConfig):
        super().__init__()
        self.config = cfg
        dim = cfg.hidden_size
        self.patch_embedding = nn.Conv3d(cfg.in_channels, dim, kernel_size=tuple(cfg.patch_size), stride=tuple(cfg.patch_size))
        self.condition_embedder = WanTimeTextImageEmbedding(
            dim=dim, time_freq_dim=cfg.freq_dim, time_proj_dim=dim * 6, text_embed_dim=cfg.text_dim,
            image_embed_dim=cfg.image_dim,
        )
        self.blocks = nn.ModuleList([WanBlock(cfg) for _ in range(cfg.num_layers)])
        self.norm_out = FP32LayerNorm(dim, cfg.eps, elementwise_affine=False)
        self.proj_out = nn.Linear(dim, cfg.out_channels * cfg.patch_volume)
        self.scale_shift_table = nn.Parameter(torch.randn(1, 2, dim) / dim**0.5)
        self._compiled_head = None  # set by compile_regions

    recompute_modes = ("full", "selective")

    def set_recompute(self, policy: str) -> None:
        """Per-block activation recomputation (``train.recompute``): ``none``, ``full`` (the whole
        block) or ``selective`` (keep the attention and GEMM outputs, recompute the rest)."""
        if policy not in CHECKPOINTING:
            raise ValueError(f"activation recomputation {policy!r}: one of {', '.join(CHECKPOINTING)}")
        for block in self.blocks:
            block.checkpointing = policy

    def repeated_blocks(self) -> list[nn.Module]:
        return list(self.blocks)

    def compile_regions(self, dynamic: bool | None = None) -> None:
        """Regional compilation: every block is compiled (one graph serves all layers, since they
        share code and shapes), and so is the output head (norm, modulation, projection: a
        second small graph that fuses what eager would run as a handful of full-size passes);
        the embedders stay eager. Cross-attention's RMSNorms switch to the torch reference so
        inductor fuses them with the casts around them (the adaLN LayerNorms and self-attention's
        ``qk_norm_rope`` stay registry ops, which compiled graphs call as they are); segment
        lengths are handed to attention as upper bounds (``Segments(exact=False)``). ``dynamic``
        as in ``torch.compile``: False for one fixed pack shape, None to let packs of changing
        length recompile once into a length-generic graph."""
        for block in self.blocks:
            block.attn1.use_kernels(reference=True)
            block.attn2.use_kernels(reference=True)
            block.compile(dynamic=dynamic, options=INDUCTOR_OPTIONS)
        self._compiled_head = torch.compile(self._output_head, dynamic=dynamic, options=INDUCTOR_OPTIONS)

    @property
    def compiled(self) -> bool:
        """Whether ``compile_regions`` ran."""
        return self._compiled_head is not None

    def token_context(self, batch: PackedBatch, cp: ContextParallel | None,
                      device) -> tuple[TokenContext, torch.Tensor, int, int]:
        """What the blocks need about this rank's tokens ``[lo, hi)``, and the timestep of each
        modulation row."""
        n = batch.num_tokens
        lo, hi = cp.local_range(n) if cp is not None else (0, n)
        cross_q, first, last = _local_cross_bounds(batch.cross_attention_bounds, lo, hi)
        L = batch.text.shape[1]
        positions = batch.positions[lo:hi].to(device)
        cos, sin = rope_tables(positions, self.config.attention_head_dim)
        exact = not self.compiled
        segments = [Segments(batch.self_attention_bounds, exact), Segments(cross_q, exact),
                    Segments([i * L for i in range(last - first + 2)], exact)]
        if batch.image is not None:
            L_img = batch.image.shape[1]
            segments.append(Segments([i * L_img for i in range(last - first + 2)], exact))
        if torch.device(device).type == "cuda":  # what the CUDA backends read, built outside compiled code
            for seg in segments:
                seg.prepare(device)
        sample_index = batch.sample_index[lo:hi].to(device)
        if batch.token_timesteps is None:  # one modulation row per sample
            rows, row_index = batch.timesteps, None if batch.num_samples == 1 else sample_index
        else:  # one row per distinct timestep of the local tokens
            rows, row_index = torch.unique(batch.token_timesteps[lo:hi].to(device), return_inverse=True)
            row_index = None if rows.numel() == 1 else row_index
        tc = TokenContext(
            sample_index=sample_index,
            modulation_index=row_index,
            rope_cos=cos,
            rope_sin=sin,
            self_segments=segments[0],
            cross_q_segments=segments[1],
            cross_k_segments=segments[2],
            image_k_segments=segments[3] if batch.image is not None else None,
            first_sample=first,
            last_sample=last,
            backend=self.config.attention_backend,
            cp=cp,
        )
        return tc, rows, lo, hi

    def forward(self, batch: PackedBatch, cp: ContextParallel | None = None) -> torch.Tensor:
        """Predicted velocity for this rank's tokens: ``[n, pt*ph*pw*out_channels]``."""
        weight = self.patch_embedding.weight
        if (batch.image is None) != (self.config.image_dim is None):
            raise ValueError(f"model.image_dim={self.config.image_dim} but the pack has "
                             f"{'no' if batch.image is None else 'some'} image tokens")
        tc, rows, lo, hi = self.token_context(batch, cp, weight.device)
        x = F.linear(batch.patches[lo:hi].to(weight.device, weight.dtype), weight.flatten(1), self.patch_embedding.bias)

        image = None if batch.image is None else batch.image.to(weight.device, weight.dtype)
        temb, timestep_proj, text, image = self.condition_embedder(
            rows.to(weight.device), batch.text.to(weight.device, weight.dtype), image)
        timestep_proj = timestep_proj.unflatten(1, (6, -1))

        for block in self.blocks:
            x = block(x, text, timestep_proj, tc, image)

        head = self._compiled_head or self._output_head
        return head(x, self.scale_shift_table + temb.unsqueeze(1), tc.modulation_index)

    def _output_head(self, x: torch.Tensor, modulation: torch.Tensor, row_index: torch.Tensor | None) -> torch.Tensor:
        # per row -> per token in here, so that a compiled head fuses the gather and its
        # backward's reduction (eager, a pack of 2 x 14040 tokens spent 10 ms a step scattering back)
        shift, scale = per_token(modulation, row_index).unbind(1)
        x = (self.norm_out(x.float()) * (1 + scale) + shift).type_as(x)
        return self.proj_out(x)

    def forward_video(self, hidden_states: torch.Tensor, timestep: torch.Tensor, encoder_hidden_states: torch.Tensor,
                      encoder_hidden_states_image: torch.Tensor | None = None) -> torch.Tensor:
        """diffusers' calling convention: ``[B, C, F, H, W]`` latents -> ``[B, C_out, F, H, W]``;
        ``timestep`` ``[B]``, or ``[B, tokens]`` per token (Wan 2.2 TI2V)."""
        per_token_steps = list(timestep) if timestep.ndim == 2 else None
        per_sample = timestep.amax(1) if timestep.ndim == 2 else timestep  # (pads nothing here)
        batch = pack(list(hidden_states), per_sample, encoder_hidden_states, self.config.patch_size,
                     image=encoder_hidden_states_image, token_timesteps=per_token_steps)
        out = self.forward(batch)
        return torch.stack(unpack_outputs(out, batch, self.config.patch_size))

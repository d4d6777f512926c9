"""What every vision encoder shares: a megatron-core ``TransformerBlock`` over the packed patches
of all images and videos of a micro-batch, returning one feature per patch in input order. Each
encoder family subclasses ``VisionEncoder`` in its own module (``qwen2_5_vit``, ``siglip_vit``) with
its positions (``embed``, ``rotary``), and registers it as a component.

The patch embedding (a linear map of flattened patches, the same as a convolution with stride
equal to its kernel) and SigLIP's position table are plain torch modules: they are small and
replicated on every TP rank, and megatron has no module that embeds pre-flattened patches.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.module import MegatronModule

from loongforge.vlm.encoders import geometry
from loongforge.vlm.encoders.attention import SegmentBounds, segment_ids
from loongforge.vlm.encoders.layers import init_linear_, vit_block_spec
from loongforge.vlm.model_config import EncoderConfig


class VisionEncoder(MegatronModule):
    """Shared machinery: patch embedding, the block, the segmentations."""

    def __init__(self, cfg: EncoderConfig, config, pg_collection):
        super().__init__(config=config)
        from megatron.core.transformer.transformer_block import TransformerBlock

        self.cfg = cfg
        self.pg_collection = pg_collection
        self.tp_group = pg_collection.tp
        self.patch_embed = torch.nn.Linear(cfg.patch_dim, cfg.hidden_size, bias=cfg.patch_bias,
                                           dtype=config.params_dtype)
        init_linear_(self.patch_embed, cfg.init_method_std)
        self.decoder = TransformerBlock(config=config, spec=vit_block_spec(cfg), post_layer_norm=cfg.post_norm,
                                        pg_collection=pg_collection)

    @staticmethod
    def check_patches(pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> int:
        """The number of patches, checked against what the grids describe."""
        total = pixel_values.shape[0]
        if sum(geometry.patch_counts(grid_thw)) != total:
            raise ValueError(f"grid_thw {grid_thw.tolist()} describes {sum(geometry.patch_counts(grid_thw))} "
                             f"patches, pixel_values has {total}")
        return total

    def run_block(self, x: torch.Tensor, segments: torch.Tensor, rot: torch.Tensor | None,
                  layers: tuple[int, ...]) -> list[torch.Tensor]:
        """The block over ``x [s, hidden]`` with segment ids ``segments [2, s]`` and rotary angles
        ``rot [s, head_dim]`` (or None): the final output, then those of the 0-based ``layers``.
        Where the layers take the flash path (CUDA, half precision) the segments' boundaries are
        found here once for all of them."""
        flash = x.is_cuda and x.dtype in (torch.float16, torch.bfloat16)
        bounds = SegmentBounds.of(segments) if flash else None
        out = self.decoder(x[:, None, :], attention_mask=segments,
                           rotary_pos_emb=rot[:, None, None, :] if rot is not None else None,
                           packed_seq_params=bounds, extract_layer_indices=set(layers))
        out, extracted = out if layers else (out, [])
        return [t[:, 0] for t in (out, *extracted)]

    def embed(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        return self.patch_embed(pixel_values.to(self.patch_embed.weight.dtype))

    def rotary(self, grid_thw: torch.Tensor) -> torch.Tensor | None:
        return None

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """``pixel_values [patches, patch_dim]`` of items with grids ``grid_thw [n, 3]`` ->
        ``[patches, hidden]``."""
        return self.features(pixel_values, grid_thw)[0]

    def features(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor,
                 layers: tuple[int, ...] = ()) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The final features ``[patches, hidden]`` and the outputs of the 0-based ``layers``
        (DeepStack), each ``[patches, hidden]``, patches in input order."""
        total = self.check_patches(pixel_values, grid_thw)
        x = self.embed(pixel_values, grid_thw)
        rot = self.rotary(grid_thw)
        frames = segment_ids(geometry.frame_cu_seqlens(grid_thw), total)
        perm = None
        if self.cfg.uses_windows:
            m = self.cfg.spatial_merge_size
            units, lengths = geometry.window_order(grid_thw, m, self.cfg.window_units)
            perm = geometry.expand_units(units, m)
            x, frames = x[perm], frames[perm]
            rot = rot[perm] if rot is not None else None
            windows = segment_ids(torch.nn.functional.pad(lengths.cumsum(0), (1, 0)), total)
        else:
            windows = frames
        outputs = self.run_block(x, torch.stack([frames, windows]), rot, layers)
        if perm is not None:
            inverse = torch.argsort(perm)
            outputs = [t[inverse] for t in outputs]
        return outputs[0], outputs[1:]

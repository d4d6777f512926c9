"""What every projector shares: per-patch encoder features -> one foundation embedding per LLM
token. It concatenates the ``merge²`` consecutive patches of a token (the encoder keeps them
consecutive), optionally after a norm of each patch (the family's ``patch_norm``; of the merged
patches with ``norm_after_merge``), and runs
megatron-core's ``MultimodalProjector`` (an MLP of a column- and a row-parallel linear,
tensor-parallel in the vision tower's TP group)."""

from __future__ import annotations

import torch
from megatron.core.transformer.module import MegatronModule

from loongforge.vlm.encoders.layers import projector_transformer_config
from loongforge.vlm.model_config import EncoderConfig, ProjectorConfig


class Projector(MegatronModule):
    """[norm,] merge, Linear, GELU, Linear."""

    def __init__(self, cfg: ProjectorConfig, encoder: EncoderConfig, foundation_hidden: int, foundation_config,
                 pg_collection):
        from megatron.core.models.backends import LocalSpecProvider
        from megatron.core.models.vision.multimodal_projector import MultimodalProjector
        from megatron.core.transformer.mlp import MLPSubmodules

        merged = encoder.hidden_size * encoder.spatial_merge_size ** 2
        ffn = cfg.ffn(merged, foundation_hidden)
        config = projector_transformer_config(merged, ffn, foundation_hidden, pg_collection.tp.size(),
                                              encoder.init_method_std, foundation_config)
        super().__init__(config=config)
        self.cfg = cfg
        self.merged = merged
        self.tp_group = pg_collection.tp
        self.norm = None
        patch_norm = cfg.patch_norm()
        if patch_norm is not None:
            norm = {"RMSNorm": torch.nn.RMSNorm, "LayerNorm": torch.nn.LayerNorm}[patch_norm]
            width = merged if cfg.norm_after_merge() else encoder.hidden_size
            self.norm = norm(width, eps=cfg.norm_epsilon, dtype=config.params_dtype)
        backend = LocalSpecProvider()
        self.mlp = MultimodalProjector(
            config, MLPSubmodules(linear_fc1=backend.column_parallel_linear(), linear_fc2=backend.row_parallel_linear()),
            projector_type="mlp", input_size=merged, pg_collection=pg_collection)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """``[patches, encoder hidden] -> [tokens, foundation hidden]``."""
        merged_first = self.cfg.norm_after_merge()
        if self.norm is not None and not merged_first:
            features = self.norm(features)
        merged = features.reshape(-1, self.merged)
        if self.norm is not None and merged_first:
            merged = self.norm(merged)
        return self.mlp(merged[:, None, :])[:, 0]

"""The VLM: a vision tower (encoder + projector) feeding a foundation LLM on megatron-core.

The foundation is a megatron ``GPTModel`` built from a loongforge-llm family's layer spec and
architecture config, with multimodal RoPE (``position_embedding_type="mrope"``) when the VLM
asks for it. Vision features replace the embeddings of the image/video placeholder tokens, in
order, before the foundation's first layer; with DeepStack (an encoder with ``deepstack_layers``,
Qwen3-VL) features of intermediate encoder layers are also added to the outputs of the
foundation's first layers (``loongforge.vlm.deepstack``). The tower lives on the first pipeline
stage.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from megatron.core.transformer.module import MegatronModule

from loongforge.llm.api import GPTConfig
from loongforge.vlm import deepstack
from loongforge.vlm.context_parallel import local_rows
from loongforge.vlm.encoders import build_encoder
from loongforge.vlm.encoders.geometry import patch_counts
from loongforge.vlm.encoders.layers import encoder_transformer_config
from loongforge.vlm.model_config import EncoderConfig, ProjectorConfig, VisionTokensConfig
from loongforge.vlm.parallel import (VisionGroups, build_vision_groups, gather_rows, mark_replicated_parameters,
                                    split_items)
from loongforge.vlm.projectors import build_projector


def component_config(section: str, value, role: str):
    """A part's config from a plain dict (a checkpoint manifest): its family's config class."""
    if not isinstance(value, dict):
        return value
    from loongforge.core.models import get_component

    family = value.get("family")
    if family is None:
        raise ValueError(f"{section}: no family (the registered {role} component) in {value}")
    return get_component(family, role).config_class(**value)


def foundation_config(value: dict) -> GPTConfig:
    """A foundation config from a plain dict (a checkpoint manifest): its LLM family's config class."""
    from loongforge.core.models import get_model_spec

    return get_model_spec(value.get("family", "llama")).config_class(**value)


@dataclass
class VLMModelConfig:
    """The model a VLM config composes: ``encoder``, ``projector`` and ``foundation`` come from
    their config groups; ``vision`` says how vision tokens enter the foundation."""

    encoder: EncoderConfig = field(default_factory=lambda: component_config("encoder", {"family": "qwen2_5_vit"},
                                                                           "vision_encoder"))
    projector: ProjectorConfig = field(default_factory=lambda: component_config("projector",
                                                                               {"family": "patch_merge_mlp"}, "projector"))
    foundation: GPTConfig = field(default_factory=GPTConfig)
    vision: VisionTokensConfig = field(default_factory=VisionTokensConfig)

    def __post_init__(self):
        self.encoder = component_config("encoder", self.encoder, "vision_encoder")
        self.projector = component_config("projector", self.projector, "projector")
        if isinstance(self.foundation, dict):  # from a manifest: its family's config class (MoEConfig ...)
            self.foundation = foundation_config(self.foundation)
        if isinstance(self.vision, dict):
            self.vision = VisionTokensConfig(**self.vision)
        if self.vision.multimodal:
            self.vision.section_for(self.rotary_dim)  # raises on a section that does not fit
        layers = self.encoder.deepstack_indices()
        if len(layers) > self.foundation.num_layers:
            raise ValueError(f"encoder.deepstack_layers={list(layers)}: {len(layers)} DeepStack features for a "
                             f"foundation of {self.foundation.num_layers} layers (one per layer, from the first)")

    @property
    def rotary_dim(self) -> int:
        """The dims of each foundation head that RoPE rotates (``rotary_percent`` of the head, as
        megatron's rotary embeddings take it; Qwen3.5: a quarter)."""
        f = self.foundation
        return int(f.head_dim * f.rotary_percent) if f.rotary_percent < 1.0 else f.head_dim

    @property
    def mrope_section(self) -> list[int] | None:
        """The (t, h, w) frequency pairs of multimodal RoPE (None for 1D RoPE)."""
        return self.vision.section_for(self.rotary_dim) if self.vision.multimodal else None

    @property
    def rotary_chunks(self) -> list[int] | None:
        """The ``mrope_section`` of megatron's TransformerConfig (``VisionTokensConfig.rotary_chunks``)."""
        return self.vision.rotary_chunks(self.rotary_dim) if self.vision.multimodal else None

    def parameter_counts(self) -> dict[str, int]:
        """Parameters of the encoder, the projector (DeepStack's mergers included) and the foundation."""
        e, f = self.encoder, self.foundation
        merged = e.hidden_size * e.spatial_merge_size ** 2
        projector = self.projector.parameter_count(e.hidden_size, merged, f.hidden_size)
        merger = deepstack.merger_config(self.projector)
        projector += len(e.deepstack_indices()) * merger.parameter_count(e.hidden_size, merged, f.hidden_size)
        return {"encoder": e.parameter_count(), "projector": projector, "foundation": sum(f.parameter_counts().values())}

    @property
    def tokens_per_patch_group(self) -> int:
        """Patches per LLM token."""
        return self.encoder.spatial_merge_size ** 2


def build_foundation(cfg: VLMModelConfig, transformer_config, pgs, pre_process: bool, post_process: bool):
    """The foundation GPTModel from its family's decoder spec (loongforge-llm's ``decoder_spec``: one
    layer's spec, or a hybrid family's block of per-layer specs); its fast-layer attention layers
    share one RoPE table cache (``share_rope_tables``)."""
    from megatron.core.models.gpt import GPTModel

    from loongforge.llm.api import decoder_spec, share_rope_tables

    f = cfg.foundation
    if f.vocab_size % pgs.tp.size():
        raise ValueError(f"foundation.vocab_size={f.vocab_size} must be divisible by parallel.tp={pgs.tp.size()}")
    layers = decoder_spec(f, transformer_config)  # a family with no megatron layers is refused by name
    model = GPTModel(
        config=transformer_config,
        transformer_layer_spec=layers,
        vocab_size=f.vocab_size,
        max_sequence_length=f.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=f.tie_embeddings,
        position_embedding_type="mrope" if cfg.vision.multimodal else "rope",
        rotary_percent=f.rotary_percent,
        rotary_base=int(f.rotary_base),
        pg_collection=pgs,
    )
    share_rope_tables(model)
    if pgs.cp.size() > 1:  # on the fast layer (VLMConfig refuses others: context_parallel.check_foundation_layers)
        # the layers rotate each token by the angles of its own position (this rank's positions: see
        # loongforge.vlm.context_parallel), so the rotary embedding must not slice them per CP rank again
        model.rotary_pos_emb.cp_group = None
    return model


class VisionLanguageModel(MegatronModule):
    """``forward(tokens, position_ids, attention_mask, labels, pixel_values, grid_thw, packed_seq_params,
    cp_index, vision)`` (``packed_seq_params`` and ``cp_index`` for THD rows and context parallelism,
    ``vision`` for features encoded before the schedule: see ``forward``).

    ``tokens [b, s]``; ``position_ids [3, b, s]`` (mrope) or ``[b, s]``; ``pixel_values
    [patches, patch_dim]`` and ``grid_thw [items, 3]``: the micro-batch's images and videos in
    the order their placeholder tokens appear (row-major over ``[b, s]``). Returns the
    per-token loss ``[b, s]`` with ``labels``, else the logits ``[b, s, vocab/tp]``.
    """

    def __init__(self, cfg: VLMModelConfig, transformer_config, pgs, groups: VisionGroups, *,
                 encoder_recompute: str = "none", pre_process: bool = True, post_process: bool = True):
        from megatron.core.enums import ModelType

        super().__init__(config=transformer_config)
        self.model_type = ModelType.encoder_or_decoder  # read by megatron's schedules
        if cfg.vision.image_token_id is None or cfg.vision.video_token_id is None:
            raise ValueError("vision.image_token_id and vision.video_token_id must be set (the tokenizer's "
                             "image/video placeholder ids)")
        self.cfg = cfg
        self.groups = groups
        self.pre_process, self.post_process = pre_process, post_process
        self.image_token_id, self.video_token_id = cfg.vision.image_token_id, cfg.vision.video_token_id
        self.language_model = build_foundation(cfg, transformer_config, pgs, pre_process, post_process)
        self.deepstack = None  # DeepStack's patch mergers (torch.nn.ModuleList), with an encoder that has them
        if pre_process:
            enc_config = encoder_transformer_config(cfg.encoder, groups.tp_size, encoder_recompute, transformer_config)
            self.encoder = build_encoder(cfg.encoder, enc_config, groups.pgs)
            self.projector = build_projector(cfg.projector, cfg.encoder, cfg.foundation.hidden_size,
                                             transformer_config, groups.pgs)
            mark_replicated_parameters(self.encoder, groups)
            mark_replicated_parameters(self.projector, groups)
            if cfg.encoder.deepstack_indices():
                if transformer_config.recompute_granularity == "full":
                    raise ValueError("full activation recompute of the foundation cannot be combined with DeepStack "
                                     "(encoder.deepstack_layers): use selective recompute or none")
                self.deepstack = deepstack.build_mergers(cfg.encoder, cfg.projector, cfg.foundation.hidden_size,
                                                         transformer_config, groups.pgs)
                mark_replicated_parameters(self.deepstack, groups)

    # -- pipeline plumbing ------------------------------------------------------------------
    def set_input_tensor(self, input_tensor) -> None:
        self.language_model.set_input_tensor(input_tensor)

    @property
    def share_embeddings_and_output_weights(self) -> bool:
        """Read by megatron's ``finalize_model_grads`` on the first and last pipeline stages (the
        outermost module with ``pre_process``): a tied foundation's word embeddings and its output
        layer's copy get their gradients all-reduced across the two."""
        return self.language_model.share_embeddings_and_output_weights

    def shared_embedding_or_output_weight(self):
        """The foundation's word embeddings on the first stage, their output-layer copy on the last."""
        return self.language_model.shared_embedding_or_output_weight()

    # -- vision -----------------------------------------------------------------------------
    @property
    def vision_width(self) -> int:
        """Width of the tower's rows: the foundation embedding, then one per DeepStack feature."""
        return self.cfg.foundation.hidden_size * (1 + len(self.cfg.encoder.deepstack_indices()))

    def _tower(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        train_encoder = any(p.requires_grad for p in self.encoder.parameters())
        layers = self.cfg.encoder.deepstack_indices()
        with torch.set_grad_enabled(torch.is_grad_enabled() and train_encoder):
            features, intermediate = self.encoder.features(pixel_values, grid_thw, layers)
        if not layers:
            return self.projector(features)
        assert self.deepstack is not None  # built whenever the encoder has DeepStack layers
        return torch.cat([self.projector(features), *(m(x) for m, x in zip(self.deepstack, intermediate))], dim=-1)

    def encode_vision(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """One row per vision token of the items, in item order: its foundation embedding, then its
        DeepStack features (``vision_width`` wide). The ranks that see the same micro-batch share
        out its items (see ``loongforge.vlm.parallel``): the CP ranks of a context-parallel job,
        then, with the tower split across the foundation's TP group, the TP ranks; each encodes its
        share and the shares are all-gathered."""
        groups = self.groups

        def within_cp(pixels, grid):  # the TP ranks' share-out of a split tower, or the whole tower
            if groups.split is None:
                return self._tower(pixels, grid)
            return self._shared_out(pixels, grid, groups.split, self._tower, grad_scale=float(groups.split_size))

        cp = groups.pgs.cp
        if cp is not None and cp.size() > 1:
            return self._shared_out(pixel_values, grid_thw, cp, within_cp, sum_grads=True)
        return within_cp(pixel_values, grid_thw)

    def _shared_out(self, pixel_values, grid_thw, group, encode, grad_scale: float = 1.0,
                    sum_grads: bool = False) -> torch.Tensor:
        """``encode`` of this rank's share of the items (``split_items`` over ``group``), the
        shares all-gathered (``gather_rows``) and put back in item order."""
        sizes = patch_counts(grid_thw)
        merge = self.cfg.tokens_per_patch_group
        shares = split_items(sizes, group.size())
        starts = [0]
        for n in sizes:
            starts.append(starts[-1] + n)
        mine = shares[group.rank()]
        if mine:
            pixels = torch.cat([pixel_values[starts[i]:starts[i + 1]] for i in mine])
            local = encode(pixels, grid_thw[mine])
        else:  # requiring grad when the tower trains, as the other ranks' shares do, so that every rank of
            # the group runs the same backward (the gather's and the foundation's collectives)
            tower = (*self.encoder.parameters(), *self.projector.parameters(),
                     *(self.deepstack.parameters() if self.deepstack is not None else ()))
            trains = torch.is_grad_enabled() and any(p.requires_grad for p in tower)
            local = torch.zeros((0, self.vision_width), dtype=self.config.params_dtype,
                                device=pixel_values.device, requires_grad=trains)
        counts = [sum(sizes[i] for i in share) // merge for share in shares]
        gathered = gather_rows(local, counts, group, grad_scale=grad_scale, sum_grads=sum_grads)
        # rows of item i in the gathered (share-ordered) tensor, items back in their own order
        row_of, offset = {}, 0
        for share in shares:
            for i in share:
                row_of[i] = offset
                offset += sizes[i] // merge
        index = torch.cat([torch.arange(row_of[i], row_of[i] + sizes[i] // merge) for i in range(len(sizes))])
        return gathered[index.to(gathered.device)]

    def embed(self, tokens: torch.Tensor, pixel_values: torch.Tensor | None, grid_thw: torch.Tensor | None,
              vision: torch.Tensor | None = None):
        """Token embeddings ``[s, b, h]`` with vision features at the placeholder tokens, and the
        DeepStack additions to the first layers' outputs (``[s, b, h]`` each; none without
        DeepStack or vision tokens). ``vision``: the items' ``encode_vision`` rows, encoded
        beforehand (``loongforge.vlm.encoder_stage``); None: encoded here."""
        embeddings = self.language_model.embedding(input_ids=tokens, position_ids=None)
        placeholders = (tokens == self.image_token_id) | (tokens == self.video_token_id)
        n = int(placeholders.sum())
        if grid_thw is None or grid_thw.numel() == 0:
            if n:
                raise ValueError(f"the micro-batch has {n} image/video placeholder tokens but no images or videos")
            return embeddings, []
        if vision is None:
            vision = self.encode_vision(pixel_values, grid_thw)
        if vision.shape[0] != n:
            raise ValueError(f"the micro-batch has {n} image/video placeholder tokens for {vision.shape[0]} vision "
                             f"tokens of its {grid_thw.shape[0]} images/videos")
        main, *deep = vision.split(self.cfg.foundation.hidden_size, dim=-1)
        batch_major = embeddings.transpose(0, 1).masked_scatter(placeholders[..., None], main.to(embeddings.dtype))
        additions = deepstack.dense_additions(deep, placeholders, embeddings.dtype)
        if self.config.sequence_parallel:
            from megatron.core.tensor_parallel import scatter_to_sequence_parallel_region

            additions = [scatter_to_sequence_parallel_region(a, group=self.language_model.pg_collection.tp)
                         for a in additions]
        return batch_major.transpose(0, 1).contiguous(), additions

    # -- forward ----------------------------------------------------------------------------
    def forward(self, tokens, position_ids, attention_mask=None, labels=None, pixel_values=None, grid_thw=None,
                packed_seq_params=None, cp_index=None, vision=None, loss_mask=None):
        """``packed_seq_params``: a THD row's (no ``attention_mask`` then). ``cp_index``: under
        context parallelism, the row positions of this CP rank's tokens (``loongforge.vlm.context_parallel``):
        ``tokens``, ``pixel_values`` and ``grid_thw`` are the whole row's, ``position_ids`` and
        ``labels`` this rank's. ``vision``: the items' vision rows encoded before the schedule
        (the decoupled encoder stage, ``loongforge.vlm.encoder_stage``) in place of ``pixel_values``.
        ``loss_mask``: which of this rank's tokens count in the loss (the foundation's fused loss
        leaves the others out of its gradient work)."""
        decoder_input, additions = None, []
        if self.pre_process:
            embeddings, additions = self.embed(tokens, pixel_values, grid_thw, vision)
            decoder_input = local_rows(embeddings, cp_index)
            additions = [local_rows(a, cp_index) for a in additions]
        if cp_index is not None:
            tokens = tokens.index_select(1, cp_index.to(tokens.device))
        with deepstack.added_to_layer_outputs(self.language_model.decoder.layers, additions):
            return self.language_model(tokens, position_ids, attention_mask, decoder_input=decoder_input,
                                       labels=labels, loss_mask=loss_mask, packed_seq_params=packed_seq_params)

    # -- checkpoints ------------------------------------------------------------------------
    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        """The foundation's shards as megatron lays them out; the tower's with the ranks that
        hold the same tower shard as its replicas (it is replicated across the foundation's
        TP group when its own TP is 1)."""
        from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group

        metadata = ensure_metadata_has_dp_cp_group(metadata)
        out = self.language_model.sharded_state_dict(f"{prefix}language_model.", sharded_offsets, metadata)
        if self.pre_process:
            tower = {**metadata, "dp_cp_group": self.groups.replica}
            out.update(self.encoder.sharded_state_dict(f"{prefix}encoder.", (), tower))
            out.update(self.projector.sharded_state_dict(f"{prefix}projector.", (), tower))
            for i, merger in enumerate(self.deepstack or ()):
                out.update(merger.sharded_state_dict(f"{prefix}deepstack.{i}.", (), tower))
        return out


def build_vlm(cfg: VLMModelConfig, ctx, transformer_config, pre_process: bool = True, post_process: bool = True, *,
              encoder_tp: int = 1, split_across_foundation_tp: bool = True, encoder_recompute: str = "none"):
    """This rank's VLM; the vision tower gets its own process groups (``build_vision_groups``)."""
    groups = build_vision_groups(ctx, encoder_tp, split_across_foundation_tp)
    return VisionLanguageModel(cfg, transformer_config, ctx.pgs, groups, encoder_recompute=encoder_recompute,
                               pre_process=pre_process, post_process=post_process)

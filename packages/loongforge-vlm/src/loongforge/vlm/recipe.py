"""The VLM SFT recipe: config schema and the megatron task the shared trainer runs.

A config composes ``encoder``, ``projector`` and ``foundation`` from their YAML groups. The
shared ``parallel`` group (``tp``...) is the layout the foundation runs on; ``parallel.encoder``
(tp 1 or the foundation's, recompute) is the vision tower's own. ``trainable`` names the parts that
learn (pre-training the projector alone, projector + foundation, or everything).

Each step takes ``train.global_batch_size`` conversations; the DP load balancer
(``loongforge.core.training.balanced.BalancedSteps``) plans them across DP ranks and into
packed micro-batches of at most ``balance.token_cap`` (default ``train.seq_length``). A
sample's length for the balancer is vision-token aware: its tokens in the foundation (text and
image/video tokens) plus the vision tower's work on its patches in foundation-token
equivalents (``VLMTask.sample_costs``); micro-batches are capped in the same unit, so a
micro-batch bounds the tower's work too, and ``tokens_per_s`` counts these units. The loss is
summed over assistant tokens and normalised by their count over the whole global batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar
from functools import partial
from pathlib import Path

import numpy as np

from loongforge.core.config import to_dict
from loongforge.core.training.schema import (
    BalanceConfig,
    CheckpointConfig,
    LogConfig,
    LoRAConfig,
    ParallelConfig,
    SequenceTrainConfig,
)
from loongforge.core.training.task import MegatronTask
from loongforge.llm.api import GPTConfig
from loongforge.vlm.data.media import MediaConfig
from loongforge.vlm.lora import DEFAULT_TARGETS as DEFAULT_LORA_TARGETS
from loongforge.vlm.model import VLMModelConfig
from loongforge.vlm.encoders.qwen2_5_vit import QwenViTConfig
from loongforge.vlm.encoders.siglip_vit import SigLIPViTConfig
from loongforge.vlm.model_config import EncoderConfig, ProjectorConfig, VisionTokensConfig
from loongforge.vlm.projectors.patch_merge_mlp import PatchMergeMLPConfig

CONFIG_DIR = Path(__file__).resolve().parent / "configs"
PARTS = ("encoder", "projector", "foundation")


def encoder_init_from_hf(encoder: EncoderConfig) -> str | None:
    """``encoder.init_from_hf``: the HF directory (or hub id) of a SigLIP encoder's initial weights;
    None for an encoder that reads none."""
    return encoder.init_from_hf if isinstance(encoder, SigLIPViTConfig) else None


@dataclass
class EncoderParallel:
    """The vision tower (encoder + projector). ``tp``: 1 or the foundation's tp. With tp=1 and
    ``split_across_foundation_tp`` the ranks of one foundation TP group encode disjoint shares of
    the micro-batch's images (data parallel across the foundation's TP group). With ``decoupled``
    the tower runs once per step outside the pipeline schedule (``loongforge.vlm.encoder_stage``)."""

    tp: int = 1  # tensor parallel size of the vision tower: 1 or the foundation's
    recompute: str = "none"  # activation recomputation of the vision tower: none | selective | full
    split_across_foundation_tp: bool = True  # with tp=1: the foundation's TP ranks encode disjoint shares of the images
    # encode all of a step's micro-batches' images in one batched forward before the (pipeline) schedule
    # and run the tower's backward once after it, instead of once per micro-batch inside it
    decoupled: bool = False

    def __post_init__(self):
        if self.tp < 1:
            raise ValueError(f"parallel.encoder.tp={self.tp}: must be >= 1")
        if self.recompute not in ("none", "selective", "full"):
            raise ValueError(f"parallel.encoder.recompute={self.recompute!r}: one of none, selective, full")


@dataclass
class VLMParallelConfig(ParallelConfig):
    """The shared ``parallel`` group (``tp``, ``pp``...: the job's layout, which the foundation runs
    on) plus ``encoder``: the vision tower's own layout."""

    encoder: EncoderParallel = field(default_factory=EncoderParallel)

    def __post_init__(self):
        super().__post_init__()
        if self.encoder.tp not in (1, self.tp):
            raise ValueError(f"parallel.encoder.tp={self.encoder.tp}: must be 1 or parallel.tp={self.tp}")
        if self.ep != 1:
            raise ValueError(f"parallel.ep={self.ep}: the VLM recipe runs the foundation with tensor, pipeline, "
                             f"context and data parallelism only (ep=1)")
        if self.data_parallel not in ("auto", "ddp"):
            raise ValueError(f"parallel.data_parallel={self.data_parallel!r}: the VLM runs on the megatron-core "
                             f"engine (auto/ddp)")


@dataclass
class VLMDataConfig:
    path: str | None = None  # JSONL of conversations with images/videos; null: the shipped shapes set
    media_root: str | None = None  # base of relative media paths (default: the JSONL's directory)
    # a tokenizer directory or a Hugging Face Hub id (owner/name); default: loongforge-llm's bundled one + vision tokens
    tokenizer: str | None = None
    chat_template: str | None = None  # a Jinja file to use instead of the tokenizer's template
    cache_dir: str | None = None  # media indices and the shipped set; null: $LOONGFORGE_CACHE/vlm-data
    too_long: str = "skip"  # a sample over balance.token_cap: skip | error
    num_workers: int = 0  # DataLoader worker processes; 0: load in the training process
    media: MediaConfig = field(default_factory=MediaConfig)

    def __post_init__(self):
        if self.too_long not in ("skip", "error"):
            raise ValueError(f"data.too_long={self.too_long!r}: one of skip, error")
        if self.num_workers < 0:
            raise ValueError(f"data.num_workers={self.num_workers}: must be >= 0")


@dataclass
class VLMConfig:
    # keys the groups hold (the foundation is an LLM config) that this recipe refuses, with why:
    # `lf-vlm train --help` and the config reference leave them out (loongforge.core.config_docs)
    UNSETTABLE: ClassVar[dict[str, str]] = {
        "foundation.init_from_hf": "the VLM recipe does not read HF directories online; convert the model "
                                   "(lf-vlm convert hf-to-lf) and set checkpoint.load"}

    encoder: EncoderConfig = field(default_factory=QwenViTConfig)  # a registered encoder's config class
    projector: ProjectorConfig = field(default_factory=PatchMergeMLPConfig)
    foundation: GPTConfig = field(default_factory=GPTConfig)
    vision: VisionTokensConfig = field(default_factory=VisionTokensConfig)
    parallel: VLMParallelConfig = field(default_factory=VLMParallelConfig)
    # the parts trained (encoder, projector, foundation); the others are frozen
    trainable: list[str] = field(default_factory=lambda: list(PARTS))
    data: VLMDataConfig = field(default_factory=VLMDataConfig)
    train: SequenceTrainConfig = field(default_factory=SequenceTrainConfig)
    balance: BalanceConfig = field(default_factory=BalanceConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    log: LogConfig = field(default_factory=LogConfig)
    # rank > 0: train adapters only; a target `PART.NAME` (encoder., projector., foundation.) selects in
    # that part, a plain `NAME` in every part (loongforge.vlm.lora)
    lora: LoRAConfig = field(default_factory=lambda: LoRAConfig(target_modules=list(DEFAULT_LORA_TARGETS)))

    def __post_init__(self):
        from loongforge.core.training.megatron_engine import check_train_config

        check_train_config(self.train)  # the parallel group checks itself (VLMParallelConfig)
        if self.train.seq_chunks != 1:
            raise ValueError(f"train.seq_chunks={self.train.seq_chunks}: ChunkPipe runs in lf-llm's pre-training, "
                             f"not the VLM recipe (1)")
        unknown = [p for p in self.trainable if p not in PARTS]
        if unknown or not self.trainable or len(set(self.trainable)) != len(self.trainable):
            raise ValueError(f"trainable={list(self.trainable)}: a non-empty list of distinct parts among {', '.join(PARTS)}")
        if self.train.micro_batch_size not in (None, 1):
            raise ValueError(f"train.micro_batch_size={self.train.micro_batch_size}: the VLM recipe packs micro-batches "
                             f"by tokens (balance.token_cap); leave it null (or 1)")
        if self.foundation.init_from_hf:
            raise ValueError(f"foundation.init_from_hf={self.foundation.init_from_hf}: "
                             f"{self.UNSETTABLE['foundation.init_from_hf']}")
        encoder_hf = encoder_init_from_hf(self.encoder)
        for key, value in (("checkpoint.load", self.checkpoint.load), ("lora.base", self.lora.base)):
            if encoder_hf and value:
                raise ValueError(f"encoder.init_from_hf={encoder_hf} and {key}={value} both give the encoder's "
                                 f"initial weights; set one")
        if self.encoder.in_channels != 3:
            raise ValueError(f"encoder.in_channels={self.encoder.in_channels}: the data pipeline reads RGB (3)")
        if self.encoder.deepstack_indices() and self.train.recompute == "full":
            raise ValueError(f"train.recompute=full with encoder.deepstack_layers={list(self.encoder.deepstack_indices())}: "
                             f"full recompute of the foundation would drop DeepStack's gradients; use selective or none")
        if self.parallel.cp > 1:
            from loongforge.vlm.context_parallel import check_foundation_layers

            check_foundation_layers(self.foundation, self.parallel.cp)
        if self.parallel.pp > 1:
            from loongforge.vlm.pipeline import check_pipeline

            check_pipeline(self)
        if self.parallel.encoder.decoupled and self.train.overlap_grad_reduce:
            raise ValueError("parallel.encoder.decoupled=true with train.overlap_grad_reduce=true: megatron's "
                             "overlapped gradient reduction starts during or at the end of its schedule, before the "
                             "decoupled tower's backward; set one of them to false")
        self.model()  # cross-part checks (mrope section vs the foundation's head dim)

    def model(self) -> VLMModelConfig:
        return VLMModelConfig(encoder=self.encoder, projector=self.projector, foundation=self.foundation,
                              vision=self.vision)


class VLMTask(MegatronTask):
    """SFT of a composed VLM on image/video conversations (assistant tokens only)."""

    family = "vlm"
    model_section = None  # the model config is the encoder/projector/foundation/vision groups
    variable_micro_batches = True

    def __init__(self, cfg: VLMConfig):
        from loongforge.vlm.data.tokenizer import default_tokenizer_dir, load_vlm_tokenizer

        self.cfg = cfg
        self.tokenizer_dir = Path(cfg.data.tokenizer).expanduser() if cfg.data.tokenizer else default_tokenizer_dir()
        self.tokenizer, self.vision_ids = load_vlm_tokenizer(self.tokenizer_dir, cfg.data.media.placeholders)
        if len(self.tokenizer) > cfg.foundation.vocab_size:
            from loongforge.llm.api import DataError

            raise DataError(f"tokenizer {self.tokenizer_dir} has {len(self.tokenizer)} tokens (vision tokens "
                            f"included), more than foundation.vocab_size={cfg.foundation.vocab_size}")
        vision = cfg.vision
        if vision.image_token_id is None:
            vision.image_token_id = self.vision_ids.image
        if vision.video_token_id is None:
            vision.video_token_id = self.vision_ids.video
        if cfg.data.media.placeholders == "qwen":  # recorded for Qwen-VL's config.json (InternVL's has no such ids)
            if vision.vision_start_token_id is None:
                vision.vision_start_token_id = self.vision_ids.start
            if vision.vision_end_token_id is None:
                vision.vision_end_token_id = self.vision_ids.end
        if (vision.image_token_id, vision.video_token_id) != (self.vision_ids.image, self.vision_ids.video):
            raise ValueError(f"vision.image_token_id/video_token_id={vision.image_token_id}/{vision.video_token_id} "
                             f"differ from the tokenizer's {self.vision_ids.image}/{self.vision_ids.video}")
        self.model_cfg = cfg.model()
        self.encoder_tower = None  # encoder.init_from_hf's tower, checked before any model is built
        encoder_hf = encoder_init_from_hf(cfg.encoder)
        if encoder_hf:
            from loongforge.vlm.hf_siglip import checked_tower

            self.encoder_tower = checked_tower(cfg.encoder, encoder_hf)
        self._dataset = None

    # -- model --------------------------------------------------------------------------------
    def model_config_dict(self) -> dict:
        return to_dict(self.model_cfg)

    def transformer_config_kwargs(self) -> dict:
        from loongforge.vlm.pipeline import pipeline_config_kwargs

        kwargs = self.cfg.foundation.transformer_config_kwargs()
        if self.model_cfg.rotary_chunks is not None:
            kwargs["mrope_section"] = self.model_cfg.rotary_chunks
        return pipeline_config_kwargs(self.cfg.parallel.pp, kwargs)

    def build_model(self, ctx, transformer_config, pre_process, post_process, load_initial_weights=True):
        # builds from the config; whole HF models come in through `lf-vlm convert`, a SigLIP tower through
        # encoder.init_from_hf (read here, before any adapter: the HF weights are the base)
        from loongforge.vlm.model import build_vlm

        enc = self.cfg.parallel.encoder
        model = build_vlm(self.model_cfg, ctx, transformer_config, pre_process, post_process, encoder_tp=enc.tp,
                          split_across_foundation_tp=enc.split_across_foundation_tp, encoder_recompute=enc.recompute)
        if pre_process and load_initial_weights and self.encoder_tower is not None:
            from loongforge.vlm.hf_siglip import load_tower

            load_tower(model.encoder, self.cfg.encoder, self.encoder_tower)
        parts = {"foundation": model.language_model}
        if pre_process:
            parts.update(encoder=model.encoder, projector=model.projector)
        if pre_process and model.deepstack is not None:
            parts["deepstack"] = model.deepstack  # DeepStack's mergers learn with the projector
        for name, part in parts.items():
            part.requires_grad_(("projector" if name == "deepstack" else name) in self.cfg.trainable)
        if self.cfg.lora.enabled:
            from loongforge.vlm.lora import add_adapters

            add_adapters(model, self.cfg, self.model_config_dict(), load_initial_weights)
        return model

    def flops_per_token(self, seq_length: int) -> float:
        return self.cfg.foundation.flops_per_token(seq_length)

    def tokenizer_ref(self) -> str:
        return str(self.tokenizer_dir)

    # -- data ---------------------------------------------------------------------------------
    def geometry(self):
        from loongforge.vlm.data.media import PatchGeometry

        e = self.cfg.encoder
        return PatchGeometry(e.patch_size, e.temporal_patch_size, e.spatial_merge_size)

    def sample_costs(self, dataset) -> np.ndarray:
        """Each sample's length in foundation-token equivalents: its tokens plus the vision
        tower's FLOPs on its patches divided by the foundation's FLOPs per token."""
        per_patch = self.cfg.encoder.flops_per_patch() / self.flops_per_token(self.cfg.train.seq_length)
        return self.padded_lengths(dataset.lengths) + np.ceil(dataset.patches * per_patch).astype(np.int64)

    def padded_lengths(self, lengths: np.ndarray) -> np.ndarray:
        """Each sample's positions in a packed row: under context parallelism padded to a multiple of
        ``2*cp`` (``loongforge.vlm.context_parallel``)."""
        multiple = 2 * self.cfg.parallel.cp if self.cfg.parallel.cp > 1 else 1
        return -(-lengths // multiple) * multiple

    def token_cap(self) -> int:
        return self.cfg.balance.token_cap or self.cfg.train.seq_length

    def dataset(self):
        if self._dataset is None:
            from loongforge.llm.api import DataError
            from loongforge.llm.api import read_chat_template
            from loongforge.vlm.data.dataset import VLMDataset, build_index
            from loongforge.vlm.data.shipped import shipped_dataset

            data = self.cfg.data
            from loongforge.core.cache import cache_dir

            cache = data.cache_dir or str(cache_dir("vlm-data"))
            path = data.path or shipped_dataset(cache)
            index = build_index(path, self.tokenizer, self.tokenizer_dir, cache, data.media, self.geometry(),
                                template=read_chat_template(data.chat_template), media_root=data.media_root,
                                video_timestamps=self.cfg.vision.frames_as_images)
            dataset = VLMDataset(index, self.vision_ids, data.media, self.geometry(), rope=self.cfg.vision.rope,
                                 tokens_per_second=self.cfg.vision.tokens_per_second)
            cost = self.sample_costs(dataset)
            over = np.flatnonzero(cost > self.token_cap())
            if over.size and data.too_long == "error":
                i = int(over[0])
                raise DataError(f"{dataset.where(i)}: {int(dataset.lengths[i])} tokens + vision work = {int(cost[i])} "
                                f"exceeds balance.token_cap={self.token_cap()} ({over.size} sample(s) do; raise the cap "
                                f"or set data.too_long=skip)")
            if over.size:
                dataset = dataset.subset(np.flatnonzero(cost <= self.token_cap()))
                print(f"lf-vlm: skipped {over.size} sample(s) longer than balance.token_cap={self.token_cap()}", flush=True)
            self._dataset = dataset
        return self._dataset

    def describe(self) -> str:
        c = self.cfg
        decoupled = ", decoupled" if c.parallel.encoder.decoupled else ""
        return (f"{c.encoder.family} + {c.projector.family} + {c.foundation.family} (encoder tp={c.parallel.encoder.tp}"
                f"{decoupled}), "
                f"trainable {'+'.join(c.trainable)}")

    def collate(self, ctx):
        """How one micro-batch's samples become its packed row on this rank: under context parallelism
        a THD row padded to ``2*cp`` multiples and this CP rank's share of it
        (``loongforge.vlm.context_parallel``); else a THD row on the fast layer (no ``T x T`` mask) and
        for a foundation whose layers take packed rows only (Qwen3.5's Gated DeltaNet), a row with the
        dense document-causal mask on megatron's own attention otherwise."""
        from loongforge.vlm.context_parallel import collate_cp_share
        from loongforge.vlm.data.packing import pack, pack_thd
        from loongforge.vlm.foundation_attention import on_fast_layer, takes_packed_rows_only

        cp = ctx.pgs.cp
        if cp.size() > 1:
            return partial(collate_cp_share, cp.size(), cp.rank())
        f = self.cfg.foundation
        return pack_thd if on_fast_layer(f) or takes_packed_rows_only(f) else pack

    def steps(self, ctx, start_step: int):
        from loongforge.core.training.balanced import BalancedSteps

        train = self.cfg.train
        data = self.dataset()
        return BalancedSteps(
            data, self.sample_costs(data), self.collate(ctx), self.cfg.balance,
            samples_per_step=train.global_batch_size, token_cap=self.token_cap(),
            dp_rank=ctx.dp_rank, dp_size=ctx.dp_size, seed=train.seed,
            flops_per_token=self.flops_per_token, consumed_samples=start_step * train.global_batch_size,
            num_workers=self.cfg.data.num_workers, device=ctx.device,
        )

    # -- the step -----------------------------------------------------------------------------
    def before_schedule(self, model, micro_batches):
        """With ``parallel.encoder.decoupled``: the step's images encoded in one batch before the
        schedule, the tower's backward after it (``loongforge.vlm.encoder_stage``)."""
        if not self.cfg.parallel.encoder.decoupled:
            return None
        from loongforge.vlm.encoder_stage import encode_step

        return encode_step(model, micro_batches)

    def forward(self, model, batch):
        from loongforge.llm.api import masked_token_loss, packed_seq_params

        output = model(batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"],
                       loss_mask=batch["loss_mask"], pixel_values=batch["pixel_values"], grid_thw=batch["grid_thw"],
                       packed_seq_params=packed_seq_params(batch), cp_index=batch.get("cp_index"),
                       vision=batch.get("vision"))
        return output, partial(masked_token_loss, batch["loss_mask"])

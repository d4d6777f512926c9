"""The ``lf-diffusion train``/``sample`` config: one dataclass per YAML group, validated on load."""

from __future__ import annotations

from dataclasses import dataclass, field

from loongforge.core.training.schema import CheckpointConfig, LogConfig, ParallelConfig
from loongforge.diffusion.model.config import WanConfig
from loongforge.diffusion.objective import ObjectiveConfig

EXPERT_CHOICES = ("all", "transformer", "transformer_2")


@dataclass
class DataConfig:
    # a `lf-diffusion preprocess` output directory; null: the built-in moving-shapes set
    # (generated and preprocessed into the cache on first use)
    root: str | None = None
    synthetic_clips: int = 48  # size of the built-in set
    # tokens per micro-batch pack (the packing length); 0: all of a rank's samples in one pack
    max_tokens_per_pack: int = 0

    def __post_init__(self):
        if self.synthetic_clips < 1:
            raise ValueError(f"data.synthetic_clips={self.synthetic_clips}: must be >= 1")
        if self.max_tokens_per_pack < 0:
            raise ValueError(f"data.max_tokens_per_pack={self.max_tokens_per_pack}: must be >= 0")


@dataclass
class TrainConfig:
    steps: int = 60
    global_batch_size: int = 8  # samples per step over all data-parallel ranks
    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup_steps: int = 5
    lr_decay_style: str = "cosine"  # cosine | linear | constant
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    seed: int = 1234
    precision: str = "auto"  # auto (bf16 on GPU, fp32 on CPU) | bf16 | fp32
    data_parallel: str = "ddp"  # ddp | fsdp2
    # which Wan 2.2 expert(s) to train: all (one per step, chosen by the timestep density) or one
    expert: str = "all"
    exit_interval: int = 0  # stop this run after N steps (resume later); 0: run to train.steps
    balance: bool = True  # balance samples over DP ranks by compute cost (loongforge.core.balance)

    def __post_init__(self):
        for key in ("steps", "global_batch_size"):
            if getattr(self, key) < 1:
                raise ValueError(f"train.{key}={getattr(self, key)}: must be >= 1")
        if self.lr_decay_style not in ("cosine", "linear", "constant"):
            raise ValueError(f"train.lr_decay_style={self.lr_decay_style!r}: one of cosine, linear, constant")
        if not 0 <= self.min_lr <= self.lr:
            raise ValueError(f"train.min_lr={self.min_lr} must be in [0, train.lr={self.lr}]")
        if self.precision not in ("auto", "bf16", "fp32"):
            raise ValueError(f"train.precision={self.precision!r}: one of auto, bf16, fp32")
        if self.data_parallel not in ("ddp", "fsdp2"):
            raise ValueError(f"train.data_parallel={self.data_parallel!r}: one of ddp, fsdp2")
        if self.expert not in EXPERT_CHOICES:
            raise ValueError(f"train.expert={self.expert!r}: one of {', '.join(EXPERT_CHOICES)}")
        if self.exit_interval < 0 or self.warmup_steps < 0:
            raise ValueError("train.exit_interval and train.warmup_steps must be >= 0")


@dataclass
class EmaConfig:
    decay: float = 0.0  # 0: no EMA weights
    update_interval: int = 1

    def __post_init__(self):
        if not 0.0 <= self.decay < 1.0:
            raise ValueError(f"ema.decay={self.decay}: must be in [0, 1)")
        if self.update_interval < 1:
            raise ValueError(f"ema.update_interval={self.update_interval}: must be >= 1")


@dataclass
class SampleConfig:
    num_samples: int = 4
    num_steps: int = 20
    shift: float = 3.0  # sampling schedule shift (FlowMatchEulerDiscreteScheduler)
    guidance_scale: float = 1.0  # > 1: classifier-free guidance against the empty (zero) prompt
    seed: int = 0
    use_ema: bool = True  # use EMA weights when the checkpoint has them
    # prompts to encode with the dataset's text encoder; empty: the first dataset samples' prompts
    # and sizes (their decoded latents are drawn as a reference row)
    prompts: list[str] = field(default_factory=list)
    num_frames: int = 9  # video size for `prompts`
    height: int = 32
    width: int = 32
    fps: int = 4

    def __post_init__(self):
        for key in ("num_samples", "num_steps", "num_frames", "height", "width", "fps"):
            if getattr(self, key) < 1:
                raise ValueError(f"sample.{key}={getattr(self, key)}: must be >= 1")


@dataclass
class DiffusionRecipe:
    model: WanConfig = field(default_factory=WanConfig)
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    ema: EmaConfig = field(default_factory=EmaConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    log: LogConfig = field(default_factory=lambda: LogConfig(run_dir="runs/diffusion"))
    sample: SampleConfig = field(default_factory=SampleConfig)

    def __post_init__(self):
        for key in ("tp", "pp", "ep"):
            if getattr(self.parallel, key) != 1:
                raise ValueError(
                    f"parallel.{key}={getattr(self.parallel, key)}: the diffusion engine (FSDP2/DDP + Ulysses CP) "
                    "shards data and context only; set parallel.cp"
                )
        if self.model.num_attention_heads % self.parallel.cp:
            raise ValueError(
                f"parallel.cp={self.parallel.cp} must divide model.num_attention_heads={self.model.num_attention_heads} "
                "(Ulysses splits heads)"
            )
        if self.model.compile and self.parallel.cp > 1:
            raise ValueError(
                f"model.compile=true with parallel.cp={self.parallel.cp}: compiled blocks run without context "
                "parallelism (Ulysses all-to-alls stay eager); set model.compile=null or false"
            )
        if self.train.expert != "all" and self.model.boundary_ratio is None:
            raise ValueError(f"train.expert={self.train.expert!r} needs two experts (set model.boundary_ratio)")

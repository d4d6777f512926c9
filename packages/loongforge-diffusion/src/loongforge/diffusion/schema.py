"""The ``lf-diffusion train``/``sample`` config: one dataclass per YAML group, validated on load."""

from __future__ import annotations

from dataclasses import dataclass, field

from loongforge.core.training.ema import EmaConfig
from loongforge.core.training.schema import (
    BalanceConfig,
    CheckpointConfig,
    LoRAConfig,
    LogConfig,
    ParallelConfig,
    TrainConfig,
)
from loongforge.diffusion.model.config import WanConfig
from loongforge.diffusion.model.family import DEFAULT_FAMILY, DiTConfig, model_config_class
from loongforge.diffusion.objective import ObjectiveConfig


WAN_LORA_TARGETS = ("to_q", "to_k", "to_v", "to_out.0")  # self- and cross-attention of every block


# old key names read under the new ones for one release (``loongforge.core.config.load_config``)
RENAMED_KEYS = {"data.root": "data.path"}


@dataclass
class DataConfig:
    # a `lf-diffusion preprocess` output directory; null: the built-in moving-shapes set
    # (generated and preprocessed into the cache on first use)
    path: str | None = None
    synthetic_clips: int = 48  # size of the built-in set
    # frames of each built-in clip at most (9: the whole clips; 1: their first frames, an image set)
    synthetic_frames: int = 9

    def __post_init__(self):
        if self.synthetic_clips < 1:
            raise ValueError(f"data.synthetic_clips={self.synthetic_clips}: must be >= 1")
        if self.synthetic_frames < 1 or (self.synthetic_frames - 1) % 4:
            raise ValueError(f"data.synthetic_frames={self.synthetic_frames}: 1 + 4k frames (the VAE's temporal grid)")


@dataclass
class SampleConfig:
    num_samples: int = 4  # videos `lf-diffusion sample` draws
    num_steps: int = 20  # denoising steps per video
    shift: float = 3.0  # sampling schedule shift (FlowMatchEulerDiscreteScheduler)
    guidance_scale: float = 1.0  # > 1: classifier-free guidance against the empty (zero) prompt
    seed: int = 0  # seed of the initial noise
    use_ema: bool = True  # use EMA weights when the checkpoint has them
    # prompts to encode with the dataset's text encoder; empty: the first dataset samples' prompts
    # and sizes (their decoded latents are drawn as a reference row)
    prompts: list[str] = field(default_factory=list)
    # image-conditioned models (model.condition i2v/ti2v): an image file that starts every video
    # (resized and center-cropped to height x width; prompts default to one empty prompt); null:
    # the dataset samples' own first frames (stored conditions)
    image: str | None = None
    num_frames: int = 9  # video size for `prompts` and `image`
    height: int = 32  # video height in pixels (for `prompts` and `image`)
    width: int = 32  # video width in pixels (for `prompts` and `image`)
    fps: int = 4  # frames per second of the written GIF

    def __post_init__(self):
        for key in ("num_samples", "num_steps", "num_frames", "height", "width", "fps"):
            if getattr(self, key) < 1:
                raise ValueError(f"sample.{key}={getattr(self, key)}: must be >= 1")


@dataclass
class DiffusionRecipe:
    # the model.family's config class (loongforge.diffusion.model.family): Wan's by default
    model: DiTConfig = field(default_factory=WanConfig)
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=lambda: TrainConfig(
        steps=60, warmup_steps=5, weight_decay=0.0, adam_beta2=0.999))
    ema: EmaConfig = field(default_factory=EmaConfig)
    # rank > 0: train low-rank adapters of the DiT's attention projections only (diffusers' usual Wan targets)
    lora: LoRAConfig = field(default_factory=lambda: LoRAConfig(target_modules=list(WAN_LORA_TARGETS)))
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    balance: BalanceConfig = field(default_factory=BalanceConfig)  # token_cap null: a rank's samples in one pack
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    log: LogConfig = field(default_factory=lambda: LogConfig(run_dir="runs/diffusion"))
    sample: SampleConfig = field(default_factory=SampleConfig)

    def __post_init__(self):
        from loongforge.core.training.torch_engine import check_parallel_config, check_train_config

        check_parallel_config(self.parallel, context_parallel=True)
        check_train_config(self.train)
        self.model.check_recipe(self)
        if self.train.compile and self.parallel.cp > 1:
            raise ValueError(
                f"train.compile=true with parallel.cp={self.parallel.cp}: compiled blocks run without context "
                "parallelism (Ulysses all-to-alls stay eager); set train.compile=null or false"
            )
        if self.train.micro_batch_size is not None:
            raise ValueError(f"train.micro_batch_size={self.train.micro_batch_size}: lf-diffusion packs micro-batches "
                             f"by tokens (balance.token_cap); leave it null")
        unsupported = {"balance.fit_steps": (self.balance.fit_steps, 0), "balance.max_micro_batches":
                       (self.balance.max_micro_batches, None), "balance.shuffle": (self.balance.shuffle, True)}
        for key, (value, default) in unsupported.items():
            if value != default:
                raise ValueError(f"{key}={value}: not supported by lf-diffusion (its step order is a seeded "
                                 f"permutation per epoch and its plans are made from the FLOPs model)")


def recipe_schema(family: str = DEFAULT_FAMILY) -> DiffusionRecipe:
    """The run config of ``model.family=family``: its ``model`` section the family's config class."""
    return DiffusionRecipe(model=model_config_class(family)())

"""Config schemas of ``lf-embodied`` (validated dataclasses; YAML under ``configs/``).

``load_train_config(name, overrides)`` composes ``configs/<name>.yaml`` (default ``train``) with
its ``policy`` group (``policy=groot`` or ``--policy groot`` selects ``configs/policy/groot.yaml``)
and ``key=value`` overrides through ``loongforge.core.config.load_config``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from loongforge.core.config import load_config

CONFIG_DIR = Path(__file__).parent / "configs"

POLICY_NAMES = ("pi05", "groot")
NORM_MODES = ("mean_std", "min_max", "quantiles", "quantile10", "identity")
PARALLEL_MODES = ("auto", "none", "ddp", "fsdp", "hsdp")
DTYPES = ("fp32", "bf16")


def _positive(group: str, obj, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if value < 1:
            raise ValueError(f"{group}.{name}={value}: must be >= 1")


@dataclass
class DatasetConfig:
    root: str | None = None  # a LeRobot dataset directory; None = the synthetic demo dataset (cache dir)
    repo_id: str = "local/dataset"  # name recorded in the dataset metadata; never downloaded
    image_keys: list[str] | None = None  # cameras to use, in order; None = every camera of the dataset
    state_key: str = "observation.state"
    action_key: str = "action"
    state_norm: str = "quantiles"
    action_norm: str = "quantiles"
    eval_episodes: int = 1  # the last N episodes are held out from training for `lf-embodied eval`
    num_workers: int = 0
    video_backend: str = "pyav"

    def __post_init__(self):
        for key in ("state_norm", "action_norm"):
            if getattr(self, key) not in NORM_MODES:
                raise ValueError(f"dataset.{key}={getattr(self, key)!r}: one of {', '.join(NORM_MODES)}")
        if self.eval_episodes < 0 or self.num_workers < 0:
            raise ValueError("dataset.eval_episodes and dataset.num_workers must be >= 0")


@dataclass
class VisionConfig:
    """A SigLIP vision tower (transformers ``SiglipVisionModel``)."""

    hidden_size: int = 32
    num_layers: int = 2
    num_heads: int = 2
    intermediate_size: int = 64
    patch_size: int = 8
    layer_norm_eps: float = 1e-6

    def __post_init__(self):
        _positive("policy.vision", self, "hidden_size", "num_layers", "num_heads", "intermediate_size", "patch_size")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"policy.vision.hidden_size={self.hidden_size} not divisible by num_heads={self.num_heads}")


@dataclass
class GemmaConfig:
    """A Gemma-style decoder stack (RMSNorm with 1+w scale, GeGLU MLP, RoPE, multi-query attention)."""

    width: int = 64
    depth: int = 2
    mlp_dim: int = 128
    num_heads: int = 8
    num_kv_heads: int = 1
    head_dim: int = 8
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0

    def __post_init__(self):
        _positive("policy gemma", self, "width", "depth", "mlp_dim", "num_heads", "num_kv_heads", "head_dim")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")


@dataclass
class DiTConfig:
    """The GR00T-style action head: DiT blocks with adaLN timestep conditioning and cross-attention."""

    width: int = 64
    depth: int = 2
    num_heads: int = 4
    mlp_ratio: float = 4.0
    vlm_layer: int = -1  # backbone layer whose hidden states the head attends to (-1 = last)

    def __post_init__(self):
        _positive("policy.dit", self, "width", "depth", "num_heads")
        if self.width % self.num_heads:
            raise ValueError(f"policy.dit.width={self.width} not divisible by num_heads={self.num_heads}")


@dataclass
class PolicyConfig:
    name: str = "pi05"  # pi05 | groot
    chunk_size: int = 8  # action horizon predicted per observation
    max_state_dim: int = 8  # state/action vectors are zero-padded to these sizes
    max_action_dim: int = 8
    num_cameras: int = 2  # image slots; absent cameras are filled with masked -1 images
    image_size: int = 32  # square input side; camera frames are resized (with padding) to it
    max_token_len: int = 48  # language tokens (instruction + discretised state), padded
    vocab_size: int = 520  # >= the tokenizer's vocabulary (ByteTokenizer.vocab_size)
    discrete_state: bool = True  # pi05: the normalised state enters as 256-bin tokens in the prompt
    vision: VisionConfig = field(default_factory=VisionConfig)
    vlm: GemmaConfig = field(default_factory=GemmaConfig)
    expert: GemmaConfig = field(default_factory=lambda: GemmaConfig(width=32, mlp_dim=64))
    dit: DiTConfig = field(default_factory=DiTConfig)
    # flow matching (pi convention: x_t = t * noise + (1 - t) * actions, target u = noise - actions)
    time_sampling: str = "beta"  # beta | uniform
    time_beta_alpha: float = 1.5
    time_beta_beta: float = 1.0
    time_scale: float = 0.999
    time_offset: float = 0.001
    min_period: float = 4e-3
    max_period: float = 4.0
    num_inference_steps: int = 10
    pretrained: str | None = None  # weights to start from: a safetensors file
    pretrained_format: str = "loongforge"  # loongforge | lerobot (lerobot's pi05 state-dict names)

    def __post_init__(self):
        if self.name not in POLICY_NAMES:
            raise ValueError(f"policy.name={self.name!r}: one of {', '.join(POLICY_NAMES)}")
        _positive("policy", self, "chunk_size", "max_state_dim", "max_action_dim", "num_cameras", "vocab_size",
                  "num_inference_steps", "image_size", "max_token_len")
        if self.image_size % self.vision.patch_size:
            raise ValueError(f"policy.image_size={self.image_size} is not a multiple of policy.vision.patch_size={self.vision.patch_size}")
        if self.time_sampling not in ("beta", "uniform"):
            raise ValueError(f"policy.time_sampling={self.time_sampling!r}: one of beta, uniform")
        if self.pretrained_format not in ("loongforge", "lerobot"):
            raise ValueError(f"policy.pretrained_format={self.pretrained_format!r}: one of loongforge, lerobot")
        if self.name == "pi05":
            v, e = self.vlm, self.expert
            if (v.num_heads, v.num_kv_heads, v.head_dim, v.depth) != (e.num_heads, e.num_kv_heads, e.head_dim, e.depth):
                raise ValueError(
                    "policy.vlm and policy.expert must agree on num_heads, num_kv_heads, head_dim and depth "
                    f"(the action expert attends jointly with the backbone): vlm={v}, expert={e}"
                )
        if not -self.vlm.depth <= self.dit.vlm_layer < self.vlm.depth:
            raise ValueError(f"policy.dit.vlm_layer={self.dit.vlm_layer}: out of range for policy.vlm.depth={self.vlm.depth}")


@dataclass
class ParallelConfig:
    mode: str = "auto"  # auto (ddp when world > 1) | none | ddp | fsdp | hsdp
    dp_replicate: int = 1  # hsdp: replica groups; each shards over world / dp_replicate ranks
    param_dtype: str = "fp32"  # compute dtype: fsdp/hsdp cast parameters (MixedPrecisionPolicy); none/ddp autocast
    reduce_dtype: str = "fp32"  # fsdp/hsdp gradient reduction dtype
    activation_checkpointing: bool = False
    compile: bool = False  # torch.compile each transformer block
    compile_backend: str = "inductor"

    def __post_init__(self):
        if self.mode not in PARALLEL_MODES:
            raise ValueError(f"parallel.mode={self.mode!r}: one of {', '.join(PARALLEL_MODES)}")
        for key in ("param_dtype", "reduce_dtype"):
            if getattr(self, key) not in DTYPES:
                raise ValueError(f"parallel.{key}={getattr(self, key)!r}: one of {', '.join(DTYPES)}")
        _positive("parallel", self, "dp_replicate")


@dataclass
class OptimConfig:
    lr: float = 3e-3
    min_lr: float = 1e-4
    warmup_steps: int = 5
    weight_decay: float = 0.01
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0

    def __post_init__(self):
        if self.lr <= 0 or self.min_lr < 0 or self.min_lr > self.lr:
            raise ValueError(f"optim.lr={self.lr}, optim.min_lr={self.min_lr}: need 0 <= min_lr <= lr, lr > 0")
        if self.warmup_steps < 0:
            raise ValueError(f"optim.warmup_steps={self.warmup_steps}: must be >= 0")


@dataclass
class EvalConfig:
    hook: str = "offline_mse"  # an EvalHook name (built in or from the loongforge.embodied.eval_hooks group)
    max_batches: int = 4
    batch_size: int = 8
    seed: int = 0


@dataclass
class TrainConfig:
    run_dir: str = "runs/embodied"
    steps: int = 100
    batch_size: int = 8  # global batch (split evenly over data-parallel ranks)
    seed: int = 1234
    log_every: int = 10
    save_every: int = 50  # 0 = only at the end
    keep_last: int = 2
    resume: bool = True  # continue from RUN_DIR/checkpoints/latest when present
    progress: bool = True
    tensorboard: bool = True  # TensorBoard scalars next to RUN_DIR/metrics.jsonl
    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)

    def __post_init__(self):
        _positive("train", self, "steps", "batch_size", "log_every")
        if self.save_every < 0 or self.keep_last < 0:
            raise ValueError("save_every and keep_last must be >= 0")


def load_train_config(name_or_path: str | None = "train", overrides: Sequence[str] = ()) -> TrainConfig:
    """``configs/<name>.yaml`` (or a YAML path) + overrides, validated."""
    return load_config(TrainConfig, name_or_path, overrides, config_dirs=[CONFIG_DIR])

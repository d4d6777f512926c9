"""The ``lf-embodied`` config: the shared groups of every ``lf-*`` CLI (``train``, ``parallel``,
``checkpoint``, ``log``, ``lora``), ``eval``, ``data`` (a LeRobot dataset) and ``model`` (the policy), whose class is the
selected policy family's own (``Pi0Config``, ``Pi05Config``, ``SmolVLAConfig``, ``GrootN17Config``,
``Pi05DiTHeadConfig``, registered with their policies through ``loongforge.models``).

``load_train_config(name, overrides)`` composes ``configs/<name>.yaml`` (default ``train``) with
its ``model`` group (``model=smolvla`` or ``--model smolvla`` selects ``configs/model/smolvla.yaml``)
and ``key=value`` overrides through ``loongforge.core.config``; the ``model`` section is validated
as the config class of ``model.family``. The names of earlier releases (``policy``, ``data.root``,
``policy.tokenizer``: ``RENAMED_KEYS``) are read with a note; a renamed policy family
(``RENAMED_POLICIES``) is refused naming its new name. ``make_task(cfg)`` is the task the
config's policy family registers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from loongforge.core.config import load_config, read_section, rename_overrides
from loongforge.core.training.schema import (
    CheckpointConfig,
    EvalConfig,
    LoRAConfig,
    LogConfig,
    ParallelConfig,
    TrainConfig,
)

CONFIG_DIR = Path(__file__).parent / "configs"

# the attention projections of the Gemma stacks (q/k/v/o_proj) and of the SigLIP tower (q/k/v/out_proj)
POLICY_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "out_proj")
# old key names read under the new ones for one release (``loongforge.core.config.load_config``)
RENAMED_KEYS = {"policy.tokenizer": "data.tokenizer", "policy": "model", "data.root": "data.path"}
NORM_MODES = ("mean_std", "min_max", "quantiles", "quantile10", "identity")


def positive(group: str, obj, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if value < 1:
            raise ValueError(f"{group}.{name}={value}: must be >= 1")


@dataclass
class DatasetConfig:
    path: str | None = None  # a LeRobot dataset directory; None = the synthetic demo dataset (cache dir)
    # a tokenizer directory (PaliGemma's tokenizer.json / tokenizer.model / tokenizer_config.json), loaded
    # with transformers' AutoTokenizer; null: model.pretrained's directory when it holds one, else byte tokens
    tokenizer: str | None = None
    repo_id: str = "local/dataset"  # name recorded in the dataset metadata; never downloaded
    image_keys: list[str] | None = None  # cameras to use, in order; None = every camera of the dataset
    state_key: str = "observation.state"  # the dataset feature holding the robot state
    action_key: str = "action"  # the dataset feature holding the actions
    state_norm: str = "quantiles"  # state normalisation: mean_std | min_max | quantiles | quantile10 | identity
    action_norm: str = "quantiles"  # action normalisation: mean_std | min_max | quantiles | quantile10 | identity
    eval_episodes: int = 1  # the last N episodes are held out from training for `lf-embodied eval`
    num_workers: int = 0  # DataLoader worker processes; 0: load in the training process
    video_backend: str = "pyav"  # video decoder of LeRobot's dataset (pyav | torchcodec)

    def __post_init__(self):
        for key in ("state_norm", "action_norm"):
            if getattr(self, key) not in NORM_MODES:
                raise ValueError(f"data.{key}={getattr(self, key)!r}: one of {', '.join(NORM_MODES)}")
        if self.eval_episodes < 0 or self.num_workers < 0:
            raise ValueError("data.eval_episodes and data.num_workers must be >= 0")


@dataclass
class VisionConfig:
    """A SigLIP vision tower (transformers ``SiglipVisionModel``)."""

    hidden_size: int = 32  # hidden size of the vision tower
    num_layers: int = 2  # transformer layers
    num_heads: int = 2  # attention heads
    intermediate_size: int = 64  # hidden width of the MLP
    patch_size: int = 8  # side of a square patch in pixels
    layer_norm_eps: float = 1e-6  # epsilon of the LayerNorms

    def __post_init__(self):
        positive("model.vision", self, "hidden_size", "num_layers", "num_heads", "intermediate_size", "patch_size")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"model.vision.hidden_size={self.hidden_size} not divisible by num_heads={self.num_heads}")


@dataclass
class GemmaConfig:
    """A Gemma-style decoder stack (RMSNorm with 1+w scale, GeGLU MLP, RoPE, multi-query attention)."""

    width: int = 64  # hidden size
    depth: int = 2  # decoder layers
    mlp_dim: int = 128  # hidden width of the GeGLU MLP
    num_heads: int = 8  # query heads
    num_kv_heads: int = 1  # key/value heads (1: multi-query attention)
    head_dim: int = 8  # width of one head
    rms_norm_eps: float = 1e-6  # epsilon of the RMSNorms
    rope_theta: float = 10000.0  # RoPE base frequency

    def __post_init__(self):
        positive("model.vlm", self, "width", "depth", "mlp_dim", "num_heads", "num_kv_heads", "head_dim")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")


@dataclass
class PolicyConfig:
    """What every flow-matching policy shares: the action chunk, padding, cameras, prompt, the
    SigLIP + Gemma backbone and the flow-matching time distribution. A policy family extends it
    with its own fields (``Pi0Config``, ``Pi05Config``, ``SmolVLAConfig``, ``GrootN17Config``...)."""

    family: str = "pi05"  # the registered policy family (loongforge.models)
    chunk_size: int = 8  # action horizon predicted per observation
    max_state_dim: int = 8  # state/action vectors are zero-padded to these sizes
    max_action_dim: int = 8  # actions are zero-padded to this size
    num_cameras: int = 2  # image slots; absent cameras are filled with masked -1 images
    image_size: int = 32  # square input side; camera frames are resized (with padding) to it
    max_token_len: int = 48  # language tokens (instruction + discretised state), padded
    vocab_size: int = 520  # >= the tokenizer's vocabulary (the byte tokenizer's: 516)
    discrete_state: bool = True  # the normalised state enters as 256-bin tokens in the prompt
    vision: VisionConfig = field(default_factory=VisionConfig)
    vlm: GemmaConfig = field(default_factory=GemmaConfig)
    # flow matching (pi convention: x_t = t * noise + (1 - t) * actions, target u = noise - actions)
    time_sampling: str = "beta"  # beta | uniform
    time_beta_alpha: float = 1.5  # alpha of the Beta distribution of flow-matching times (time_sampling=beta)
    time_beta_beta: float = 1.0  # beta of the Beta distribution of flow-matching times (time_sampling=beta)
    time_scale: float = 0.999  # a sampled time t becomes t * time_scale + time_offset
    time_offset: float = 0.001  # added to the scaled time (keeps t away from 0)
    min_period: float = 4e-3  # shortest period of the sinusoidal time embedding
    max_period: float = 4.0  # longest period of the sinusoidal time embedding
    num_inference_steps: int = 10  # Euler steps of the flow when sampling actions (eval)
    pretrained: str | None = None  # weights to start from: a safetensors file
    pretrained_format: str = "loongforge"  # loongforge | lerobot (LeRobot's pi0 / pi05 state-dict names)

    def __post_init__(self):
        positive("model", self, "chunk_size", "max_state_dim", "max_action_dim", "num_cameras", "vocab_size",
                  "num_inference_steps", "image_size", "max_token_len")
        if self.image_size % self.vision.patch_size:
            raise ValueError(f"model.image_size={self.image_size} is not a multiple of model.vision.patch_size={self.vision.patch_size}")
        if self.time_sampling not in ("beta", "uniform"):
            raise ValueError(f"model.time_sampling={self.time_sampling!r}: one of beta, uniform")
        if self.pretrained_format not in ("loongforge", "lerobot"):
            raise ValueError(f"model.pretrained_format={self.pretrained_format!r}: one of loongforge, lerobot")

    def time_kwargs(self) -> dict:
        """The flow-matching time distribution, as ``flow_matching.draw_noise_and_time`` takes it."""
        return dict(kind=self.time_sampling, alpha=self.time_beta_alpha, beta=self.time_beta_beta,
                    scale=self.time_scale, offset=self.time_offset)


@dataclass
class EmbodiedEvalConfig(EvalConfig):
    """``eval``: the shared evaluation cadence plus the policy evaluation hook and its sampling."""

    hook: str = "offline_mse"  # an EvalHook name (built in or from the loongforge.embodied.eval_hooks group)
    batch_size: int = 8  # samples per evaluation batch
    seed: int = 0  # seed of the evaluation's noise and sampling


@dataclass
class EmbodiedConfig:
    model: PolicyConfig = field(default_factory=PolicyConfig)  # the policy
    data: DatasetConfig = field(default_factory=DatasetConfig)
    train: TrainConfig = field(default_factory=lambda: TrainConfig(
        steps=100, global_batch_size=8, lr=3e-3, min_lr_ratio=1 / 30, warmup_steps=5, weight_decay=0.01, adam_beta2=0.95))
    # rank > 0: train low-rank adapters of the policy's attention projections only
    lora: LoRAConfig = field(default_factory=lambda: LoRAConfig(target_modules=list(POLICY_LORA_TARGETS)))
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    checkpoint: CheckpointConfig = field(default_factory=lambda: CheckpointConfig(interval=50))
    log: LogConfig = field(default_factory=lambda: LogConfig(run_dir="runs/embodied", interval=10))
    eval: EmbodiedEvalConfig = field(default_factory=EmbodiedEvalConfig)

    def __post_init__(self):
        from loongforge.core.training.torch_engine import check_parallel_config, check_train_config

        check_parallel_config(self.parallel, context_parallel=False)
        check_train_config(self.train)


# policy families that were renamed: old name -> what to use instead
RENAMED_POLICIES = {
    "groot": "pi05_dit_head (the GR00T-style DiT head on the Pi0.5 backbone it always was); "
             "GR00T N1.7's own action head is groot_n1_7",
}


def check_renamed_policy(family: str, key: str = "model.family") -> None:
    """A renamed policy family is refused naming the new one."""
    from loongforge.core.config import ConfigError

    if family in RENAMED_POLICIES:
        raise ConfigError(f"{key}={family}: renamed; use {RENAMED_POLICIES[family]}")


def saved_model_section(config: dict) -> dict:
    """The ``model`` section of a run config saved in a checkpoint (``policy`` before it was renamed)."""
    return config.get("model") or config.get("policy") or {}


def policy_config_class(family: str) -> type[PolicyConfig]:
    """The config class the policy family registers (its ``ModelSpec.config_class``)."""
    from loongforge.core.config import ConfigError
    from loongforge.core.models import ModelRegistryError, get_model_spec

    check_renamed_policy(family)
    try:
        config_class = get_model_spec(family).config_class
    except ModelRegistryError as exc:
        raise ConfigError(f"model.family={family!r}: {exc}") from exc
    if not (isinstance(config_class, type) and issubclass(config_class, PolicyConfig)):
        raise ConfigError(f"model.family={family!r} is not a policy (its config is {config_class.__name__})")
    return config_class


def make_task(cfg: EmbodiedConfig):
    """The task the config's policy family registers (``ModelSpec.task``)."""
    from loongforge.core.models import get_model_spec

    return get_model_spec(cfg.model.family).make_task(cfg)


def load_train_config(name_or_path: str | None = "train", overrides: Sequence[str] = ()) -> EmbodiedConfig:
    """``configs/<name>.yaml`` (or a YAML path) + overrides, validated; the ``model`` section as the
    config class of its ``family``."""
    for given, override in zip(overrides, rename_overrides(overrides, RENAMED_KEYS, note=False)):
        key, _, value = override.partition("=")  # under its new name: policy=groot is model=groot
        if key.strip().lstrip("+~") in ("model", "model.family"):
            check_renamed_policy(value.strip(), given.partition("=")[0].strip().lstrip("+~"))
    family = read_section(EmbodiedConfig, "model", name_or_path, overrides, [CONFIG_DIR],
                          renamed=RENAMED_KEYS).get("family", "pi05")
    schema = EmbodiedConfig(model=policy_config_class(family)())
    cfg = load_config(schema, name_or_path, overrides, config_dirs=[CONFIG_DIR], renamed=RENAMED_KEYS)
    return resolve_hub_ids(cfg)


def resolve_hub_ids(cfg: EmbodiedConfig) -> EmbodiedConfig:
    """``data.path=owner/dataset``, ``model.pretrained=owner/model`` and ``data.tokenizer=owner/model``
    as their local hub snapshots (``loongforge.core.hub``); a model repository gives its
    ``model.safetensors`` (and its tokenizer files stay beside it)."""
    from loongforge.core.hub import is_hub_id, resolve_local

    cfg.data.path = resolve_local(cfg.data.path, key="data.path", repo_type="dataset")  # a path stays as it is
    if cfg.model.pretrained and is_hub_id(cfg.model.pretrained):  # a repository: its weights file
        cfg.model.pretrained = str(Path(resolve_local(cfg.model.pretrained, key="model.pretrained"))
                                   / "model.safetensors")
    cfg.data.tokenizer = resolve_local(cfg.data.tokenizer, key="data.tokenizer")
    return cfg

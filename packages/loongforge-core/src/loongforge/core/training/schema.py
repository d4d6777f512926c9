"""Config groups every megatron-core recipe shares (train, parallel, checkpoint, log, balance)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TrainConfig:
    steps: int = 100
    global_batch_size: int = 8
    micro_batch_size: int = 2
    seq_length: int = 128
    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup_steps: int = 10
    lr_decay_style: str = "cosine"  # cosine | linear | constant
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    seed: int = 1234
    precision: str = "auto"  # auto (bf16 on GPU, fp32 on CPU) | bf16 | fp32
    use_distributed_optimizer: bool = False
    overlap_grad_reduce: bool = False
    recompute: str = "none"  # none | selective | full

    def __post_init__(self):
        for key in ("steps", "global_batch_size", "micro_batch_size", "seq_length"):
            if getattr(self, key) < 1:
                raise ValueError(f"train.{key}={getattr(self, key)}: must be >= 1")
        if self.global_batch_size % self.micro_batch_size:
            raise ValueError(
                f"train.global_batch_size={self.global_batch_size} is not a multiple of "
                f"train.micro_batch_size={self.micro_batch_size}"
            )
        if self.precision not in ("auto", "bf16", "fp32"):
            raise ValueError(f"train.precision={self.precision!r}: one of auto, bf16, fp32")
        if self.lr_decay_style not in ("cosine", "linear", "constant"):
            raise ValueError(f"train.lr_decay_style={self.lr_decay_style!r}: one of cosine, linear, constant")
        if self.recompute not in ("none", "selective", "full"):
            raise ValueError(f"train.recompute={self.recompute!r}: one of none, selective, full")
        if not 0 <= self.warmup_steps < self.steps:
            raise ValueError(f"train.warmup_steps={self.warmup_steps} must be in [0, train.steps={self.steps})")
        if not 0 <= self.min_lr <= self.lr:
            raise ValueError(f"train.min_lr={self.min_lr} must be in [0, train.lr={self.lr}]")


@dataclass
class ParallelConfig:
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1

    def __post_init__(self):
        for key in ("tp", "pp", "cp", "ep"):
            if getattr(self, key) < 1:
                raise ValueError(f"parallel.{key}={getattr(self, key)}: must be >= 1")


@dataclass
class CheckpointConfig:
    dir: str | None = None  # default: RUN_DIR/checkpoints
    interval: int = 0  # save every N steps (0: only at the end)
    keep_last: int = 2
    resume: bool = True  # resume from DIR/latest when it exists
    load: str | None = None  # initial weights (a LoongForge checkpoint dir) when not resuming
    save: bool = True

    def __post_init__(self):
        if self.interval < 0 or self.keep_last < 0:
            raise ValueError("checkpoint.interval and checkpoint.keep_last must be >= 0")


@dataclass
class LogConfig:
    run_dir: str = "runs/default"
    interval: int = 1
    tensorboard: bool = True
    progress: bool = True
    sample_ids: bool = False  # write the dataset indices each DP rank trains to RUN_DIR/sample_ids/dp_rank_<r>.jsonl


@dataclass
class BalanceConfig:
    """DP load balancing (``loongforge.core.balance``): per step, the global batch's samples are
    planned across DP ranks and into micro-batches of at most ``token_cap`` tokens so that every
    rank has about the same compute. With ``enable: false`` the same sampler keeps the plain
    contiguous split (still packed under the cap)."""

    enable: bool = True
    coefficients: list[float] | None = None  # [a, b, c] of a*sum(len^2) + b*tokens + c; null: the model's FLOPs formula
    fit_steps: int = 0  # > 0: refit a, b, c from the measured compute seconds of this many steps, then broadcast
    skip_threshold: float = 1.02  # keep the plain split when its max/mean rank cost is at most this
    token_cap: int | None = None  # tokens per micro-batch (the packing length); null: train.seq_length
    max_micro_batches: int | None = None  # per rank and step; null: as many as the rank's samples need
    shuffle: bool = True  # a fresh permutation of the dataset every epoch (seeded by train.seed)

    def __post_init__(self):
        if self.coefficients is not None:
            if len(self.coefficients) != 3 or any(not float(v) >= 0 for v in self.coefficients) or not any(self.coefficients):
                raise ValueError(f"balance.coefficients={list(self.coefficients)}: three numbers [a, b, c], >= 0, not all 0")
        if self.fit_steps < 0:
            raise ValueError(f"balance.fit_steps={self.fit_steps}: must be >= 0")
        if self.skip_threshold < 1:
            raise ValueError(f"balance.skip_threshold={self.skip_threshold}: must be >= 1 (max/mean rank cost)")
        for key in ("token_cap", "max_micro_batches"):
            value = getattr(self, key)
            if value is not None and value < 1:
                raise ValueError(f"balance.{key}={value}: must be >= 1 (or null)")

"""The config groups of the ``lf-*`` CLIs. ``train``, ``parallel``, ``checkpoint``, ``log`` and
``lora`` are in every CLI (``loongforge.core.cli.SHARED_GROUPS``); ``balance`` (the DP load
balancer) is in the CLIs whose samples differ in length (lf-llm, lf-vlm, lf-diffusion) and ``eval``
in the CLIs whose task has an evaluation (lf-embodied). A key here means the same thing wherever its
group appears; a modality adds groups of its own (``model``, ``data``, ``objective``, ``ema``...)
or extends one of these (``SequenceTrainConfig`` adds ``seq_length`` for token-sequence models,
``lf-vlm`` adds ``parallel.encoder``), but never renames a key. Each modality's recipe chooses its
own defaults through the shipped YAML and the dataclass ``default_factory`` of its top-level config.

A key one engine cannot honour is refused by that engine with the key named (``parallel.tp=2`` on
the PyTorch-native engine, ``parallel.data_parallel=fsdp`` on megatron-core), before any process
group is made.
"""

from __future__ import annotations

from dataclasses import dataclass, field

PRECISIONS = ("auto", "bf16", "bf16-pure", "fp32")
DECAY_STYLES = ("cosine", "linear", "constant")
RECOMPUTE = ("none", "selective", "full")
OPTIMIZER_KERNELS = ("torch", "loongforge")
DATA_PARALLEL = ("auto", "ddp", "fsdp", "hsdp")
WANDB_MODES = ("online", "offline", "disabled")


def _one_of(key: str, value, choices) -> None:
    if value not in choices:
        raise ValueError(f"{key}={value!r}: one of {', '.join(map(str, choices))}")


@dataclass
class TrainConfig:
    """Steps, batch, optimizer (AdamW) and LR schedule: what the loop owns.

    ``global_batch_size`` samples make one optimizer step, over all data-parallel ranks;
    ``micro_batch_size`` samples go through the model at a time (null: a rank's whole share in one
    micro-batch, or as a recipe that packs by tokens plans them). The LR warms up linearly over
    ``warmup_steps`` (step ``s``, counted from 0, runs at ``lr * (s + 1) / warmup_steps``), then
    decays to ``lr * min_lr_ratio`` at ``steps`` (``final_lr``; ``loongforge.core.training.schedule``),
    so a new ``lr`` alone scales the whole schedule.
    """

    steps: int = 100  # optimizer steps of the whole run
    global_batch_size: int = 8  # samples per optimizer step, over all data-parallel ranks
    micro_batch_size: int | None = None  # samples per forward/backward on a rank; null: a rank's whole share
    lr: float = 1e-3  # peak learning rate (AdamW)
    min_lr_ratio: float = 0.1  # the learning rate reached at the last step, as a fraction of lr
    # deprecated (removed in the next release): the last step's learning rate as an absolute value,
    # used instead of lr * min_lr_ratio when set
    min_lr: float | None = None
    warmup_steps: int = 10  # linear warm-up: step s (from 0) runs at lr * (s + 1) / warmup_steps
    lr_decay_style: str = "cosine"  # cosine | linear | constant
    weight_decay: float = 0.01  # AdamW weight decay (not on biases and norms)
    adam_beta1: float = 0.9  # AdamW beta1
    adam_beta2: float = 0.95  # AdamW beta2
    adam_eps: float = 1e-8  # AdamW epsilon
    clip_grad: float = 1.0  # max global grad norm; 0: no clipping (the norm is still logged)
    seed: int = 1234  # initial weights, data order and noise
    # auto (bf16 on accelerators, fp32 on CPU) | bf16 (mixed: bf16 compute, fp32 main weights, grads and
    # optimizer state) | bf16-pure (bf16 weights, grads and optimizer state) | fp32
    precision: str = "auto"
    recompute: str = "none"  # activation recomputation: none | selective | full
    # the activations the first N repeated blocks (of each model part or pipeline stage) save for
    # the backward wait in pinned host memory (copied on side streams, prefetched one block ahead)
    offload_layers: int = 0
    compile: bool | None = None  # torch.compile the model's blocks; null: on CUDA where the model supports it
    exit_interval: int = 0  # stop this run after N steps (it resumes from its checkpoint later); 0: run to steps
    # a step whose loss or grad norm is not finite skips its update; the run stops (exit 1) after
    # this many such steps in a row (1: at the first); 0: never stop, skip them all
    nonfinite_patience: int = 1
    use_distributed_optimizer: bool = False  # megatron-core engine: shard optimizer state over DP (ZeRO-1)
    overlap_grad_reduce: bool = False  # megatron-core engine: overlap the DP gradient reduction with the backward
    # on CUDA (the megatron-core engine's standard optimizer, the PyTorch-native engine's unsharded
    # parameters): loongforge (loongforge-kernels' adamw_step, one kernel per param group at 16-byte
    # accesses; torch's fused AdamW where the kernels are not installed) | torch (torch's fused AdamW)
    optimizer_kernel: str = "loongforge"

    def __post_init__(self):
        for key in ("steps", "global_batch_size"):
            if getattr(self, key) < 1:
                raise ValueError(f"train.{key}={getattr(self, key)}: must be >= 1")
        if self.micro_batch_size is not None:
            if self.micro_batch_size < 1:
                raise ValueError(f"train.micro_batch_size={self.micro_batch_size}: must be >= 1 (or null)")
            if self.global_batch_size % self.micro_batch_size:
                raise ValueError(f"train.global_batch_size={self.global_batch_size} is not a multiple of "
                                 f"train.micro_batch_size={self.micro_batch_size}")
        _one_of("train.precision", self.precision, PRECISIONS)
        _one_of("train.lr_decay_style", self.lr_decay_style, DECAY_STYLES)
        _one_of("train.recompute", self.recompute, RECOMPUTE)
        _one_of("train.optimizer_kernel", self.optimizer_kernel, OPTIMIZER_KERNELS)
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"train.min_lr_ratio={self.min_lr_ratio}: must be in [0, 1] (a fraction of train.lr)")
        if self.min_lr is not None and not 0 <= self.min_lr <= self.lr:
            raise ValueError(f"train.min_lr={self.min_lr} must be in [0, train.lr={self.lr}] "
                             f"(or set train.min_lr_ratio instead)")
        if self.offload_layers and self.recompute == "full":
            raise ValueError(f"train.offload_layers={self.offload_layers} with train.recompute=full: full "
                             f"recomputation saves only each block's input; offload with none or selective")
        for key in ("warmup_steps", "exit_interval", "nonfinite_patience", "offload_layers"):
            if getattr(self, key) < 0:
                raise ValueError(f"train.{key}={getattr(self, key)}: must be >= 0")
        if self.clip_grad < 0 or self.weight_decay < 0:
            raise ValueError(f"train.clip_grad={self.clip_grad}, train.weight_decay={self.weight_decay}: must be >= 0")

    @property
    def final_lr(self) -> float:
        """The learning rate reached at the last step: ``lr * min_lr_ratio`` (or the deprecated
        absolute ``min_lr`` when set)."""
        return self.min_lr if self.min_lr is not None else self.lr * self.min_lr_ratio


@dataclass
class SequenceTrainConfig(TrainConfig):
    """``train`` of token-sequence models (LLM, VLM): adds the sequence length."""

    seq_length: int = 128  # tokens per training sequence (sample length)
    # ChunkPipe: each sequence goes through the model in N equal chunks, each attending to the keys
    # and values of the chunks before it; activation memory follows the chunk, not the sequence, for
    # one more forward per chunk (exact gradients; lf-llm's dense families, see loongforge.llm.chunk_pipe)
    seq_chunks: int = 1

    def __post_init__(self):
        super().__post_init__()
        if self.seq_length < 1:
            raise ValueError(f"train.seq_length={self.seq_length}: must be >= 1")
        if self.seq_chunks < 1:
            raise ValueError(f"train.seq_chunks={self.seq_chunks}: must be >= 1")


@dataclass
class ParallelConfig:
    """How the job is split. ``tp``/``pp``/``cp``/``ep``: tensor, pipeline, context and expert
    parallel sizes; data parallel is what the world size leaves. ``data_parallel``: how the
    data-parallel replicas keep the model (auto: megatron's DDP on the megatron-core engine,
    DDP on the PyTorch-native engine; ``fsdp``: FSDP2 sharding; ``hsdp``: FSDP2 sharding inside
    groups of ``world / dp_replicate`` ranks, replicated across the ``dp_replicate`` groups)."""

    tp: int = 1  # tensor-parallel size
    pp: int = 1  # pipeline-parallel size
    cp: int = 1  # context-parallel size (the sequence split over ranks)
    ep: int = 1  # expert-parallel size (MoE)
    data_parallel: str = "auto"  # auto | ddp | fsdp | hsdp (the PyTorch-native engine)
    dp_replicate: int = 1  # hsdp: replica groups (FSDP2 shards within each)
    # seconds the rendezvous or any collective may wait for the other ranks before the run stops
    # with an error (a rank that died or stalled never leaves the others hanging)
    timeout_s: int = 600

    def __post_init__(self):
        for key in ("tp", "pp", "cp", "ep", "dp_replicate", "timeout_s"):
            if getattr(self, key) < 1:
                raise ValueError(f"parallel.{key}={getattr(self, key)}: must be >= 1")
        _one_of("parallel.data_parallel", self.data_parallel, DATA_PARALLEL)
        if self.dp_replicate != 1 and self.data_parallel != "hsdp":
            raise ValueError(f"parallel.dp_replicate={self.dp_replicate} needs parallel.data_parallel=hsdp")


@dataclass
class CheckpointConfig:
    dir: str | None = None  # default: RUN_DIR/checkpoints
    interval: int = 0  # save every N steps (0: only at the end)
    keep_last: int = 2  # older step directories are pruned after a save (0: keep all)
    resume: bool = True  # resume from DIR/latest when it exists
    # with resume=false, a DIR holding an earlier run's checkpoints is refused unless this is true:
    # then they are removed (and RUN_DIR/metrics.jsonl kept aside) before the new run starts
    overwrite: bool = False
    load: str | None = None  # initial weights (a LoongForge checkpoint dir) when not resuming
    save: bool = True  # false: write no checkpoint at all

    def __post_init__(self):
        if self.interval < 0 or self.keep_last < 0:
            raise ValueError("checkpoint.interval and checkpoint.keep_last must be >= 0")
        if self.overwrite and self.resume:
            raise ValueError("checkpoint.overwrite=true starts the run over, removing its checkpoints: it needs "
                             "checkpoint.resume=false (resuming continues from them)")


@dataclass
class LogConfig:
    run_dir: str = "runs/default"  # metrics.jsonl, TensorBoard, config.yaml and (by default) checkpoints
    interval: int = 1  # a metrics.jsonl / TensorBoard record every N steps (and at the last step)
    tensorboard: bool = True  # TensorBoard scalars in RUN_DIR/tensorboard
    progress: bool = True  # the console progress bar
    sample_ids: bool = False  # write the dataset indices each DP rank trains to RUN_DIR/sample_ids/dp_rank_<r>.jsonl
    # also log the run's config and every metric to Weights & Biases (rank 0; pip install
    # "loongforge-core[wandb]"); a run resumed from its checkpoint continues the same W&B run (its id is
    # kept in RUN_DIR/wandb_run_id)
    wandb: bool = False
    wandb_project: str = "loongforge"  # the W&B project
    wandb_entity: str | None = None  # the W&B team or user; null: wandb's default
    wandb_name: str | None = None  # the W&B run name; null: the run dir's name
    wandb_mode: str | None = None  # online | offline | disabled; null: wandb's default (WANDB_MODE, else online)

    def __post_init__(self):
        if self.interval < 1:
            raise ValueError(f"log.interval={self.interval}: must be >= 1")
        if self.wandb_mode is not None:
            _one_of("log.wandb_mode", self.wandb_mode, WANDB_MODES)
        if not self.wandb_project:
            raise ValueError("log.wandb_project: must not be empty")
        # a missing wandb package is checked when a run starts (wandb_run.require_wandb), not here:
        # a checkpoint's config with log.wandb=true must still load for info, convert and sampling


@dataclass
class EvalConfig:
    """The evaluation hook of the loop: every ``interval`` steps (and never when 0) the task's
    ``evaluate`` runs on the current weights and its metrics are logged as ``eval/<name>``."""

    interval: int = 0  # run the task's evaluation every N steps (0: never)
    max_batches: int = 4  # batches per evaluation

    def __post_init__(self):
        if self.interval < 0 or self.max_batches < 1:
            raise ValueError(f"eval.interval={self.interval} must be >= 0 and eval.max_batches={self.max_batches} >= 1")


@dataclass
class BalanceConfig:
    """DP load balancing (``loongforge.core.balance``): per step, the global batch's samples are
    planned across DP ranks and into micro-batches of at most ``token_cap`` tokens so that every
    rank has about the same compute. With ``enable: false`` the same sampler keeps the plain
    contiguous split (still packed under the cap)."""

    enable: bool = True  # plan each step's samples across DP ranks by cost (false: the plain split)
    coefficients: list[float] | None = None  # [a, b, c] of a*sum(len^2) + b*tokens + c; null: the model's FLOPs formula
    fit_steps: int = 0  # > 0: refit a, b, c from the measured compute seconds of this many steps, then broadcast
    skip_threshold: float = 1.02  # keep the plain split when its max/mean rank cost is at most this
    token_cap: int | None = None  # tokens per micro-batch (the packing length); null: the recipe's default
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


@dataclass
class LoRAConfig:
    """Low-rank adapters (``lora``), the same keys in every ``lf-*`` CLI that trains them (lf-llm's and
    lf-vlm's megatron layers, the PyTorch-native engine's ``nn.Linear`` layers: ``loongforge.core.lora``).
    ``rank > 0`` adds ``(alpha / rank) * B A dropout(x)`` to every linear layer whose qualified name
    matches ``target_modules`` (A ``[rank, in]`` Kaiming-uniform, B ``[out, rank]`` zero, so training
    starts from the base model) and freezes every other parameter. An entry matches a layer whose
    name is it or ends with ``.`` + it; an entry ``re:PATTERN`` matches names the regular expression
    matches in full. Each CLI sets its own default targets (``lf-vlm``: an entry may start with the
    part it selects in, ``foundation.``, ``encoder.`` or ``projector.``)."""

    rank: int = 0  # 0: no adapters (full-parameter training)
    alpha: float = 16.0  # the update is scaled by alpha / rank
    dropout: float = 0.0  # on the adapter's input
    # layers to adapt: name suffixes (`to_q`, `self_attn.q_proj`) or `re:REGEX` (matched in full)
    target_modules: list[str] = field(default_factory=list)
    base: str | None = None  # checkpoint of the base weights (loaded before the adapters are added)

    def __post_init__(self):
        import re

        if self.rank < 0:
            raise ValueError(f"lora.rank={self.rank}: must be >= 0 (0 disables LoRA)")
        if self.rank and self.alpha <= 0:
            raise ValueError(f"lora.alpha={self.alpha}: must be positive")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"lora.dropout={self.dropout}: must be in [0, 1)")
        if self.rank and not self.target_modules:
            raise ValueError("lora.target_modules is empty: name the linear layers to adapt")
        for target in self.target_modules:
            if target.startswith("re:"):
                try:
                    re.compile(target[3:])
                except re.error as exc:
                    raise ValueError(f"lora.target_modules: {target!r} is not a regular expression ({exc})") from None

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

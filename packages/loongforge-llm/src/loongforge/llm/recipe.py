"""The LLM recipes' config schema, and the pre-training task the shared trainer runs.

``recipe: pretrain`` trains on indexed datasets (``data``); ``recipe: sft`` on chat
conversations (``sft``, the task in ``loongforge.llm.sft_recipe``), planned over DP ranks by
the load balancer (``balance``)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from loongforge.core.config import ConfigError, load_config, read_section
from loongforge.core.models import ModelRegistryError, get_model_spec
from loongforge.core.training.schema import (
    BalanceConfig,
    CheckpointConfig,
    LogConfig,
    ParallelConfig,
    SequenceTrainConfig,
)
from loongforge.core.training.task import MegatronTask, StepBatch
from loongforge.llm.data.sft import SFTDataConfig
from loongforge.llm.lora import DEFAULT_TARGETS, LoRAConfig
from loongforge.llm.model_config import GPTConfig
from loongforge.llm.shipped_configs import CONFIG_DIR

if TYPE_CHECKING:
    from loongforge.llm.layers.fp8_plan import FP8Plan


@dataclass
class DataConfig:
    # Indexed datasets (prefixes of .bin/.idx written by `lf-llm preprocess`); empty: the bundled corpus.
    prefixes: list[str] = field(default_factory=list)
    weights: list[float] = field(default_factory=list)  # blend weights, one per prefix (default equal)
    # a tokenizer directory (or tokenizer.json), or a Hugging Face Hub id (owner/name); default: the
    # bundled tokenizer. With data.prefixes empty it tokenizes the bundled corpus; with data.prefixes
    # it must be the tokenizer they were preprocessed with (its end-of-document id is read)
    tokenizer: str | None = None
    cache_dir: str | None = None  # tokenized corpora and sample indices; null: $LOONGFORGE_CACHE/llm-data

    def __post_init__(self):
        if self.weights and len(self.weights) != len(self.prefixes):
            raise ValueError(f"data.weights has {len(self.weights)} entries for {len(self.prefixes)} data.prefixes")
        if any(w <= 0 for w in self.weights):
            raise ValueError(f"data.weights={self.weights}: must be positive")

    def resolved_cache_dir(self) -> str:
        """``data.cache_dir``, or the LoongForge cache's ``llm-data`` folder (``loongforge.core.cache``)."""
        from loongforge.core.cache import cache_dir

        return self.cache_dir or str(cache_dir("llm-data"))


@dataclass
class KernelsConfig:
    # true: the torch reference of every fused op, even where the Triton kernels would run
    # (the same switch as LOONGFORGE_KERNELS=reference)
    force_reference: bool = False


@dataclass
class LLMConfig:
    model: GPTConfig = field(default_factory=GPTConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: SequenceTrainConfig = field(default_factory=SequenceTrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    log: LogConfig = field(default_factory=LogConfig)
    recipe: str = "pretrain"  # pretrain | sft
    sft: SFTDataConfig = field(default_factory=SFTDataConfig)
    balance: BalanceConfig = field(default_factory=BalanceConfig)  # used by recipe=sft
    kernels: KernelsConfig = field(default_factory=KernelsConfig)
    # rank > 0: train low-rank adapters only
    lora: LoRAConfig = field(default_factory=lambda: LoRAConfig(target_modules=list(DEFAULT_TARGETS)))
    # none | blockwise | adaptive: the dense layers' QKV, attention-output and MLP GEMMs in blockwise
    # FP8 (e4m3; adaptive: per linear shape, the GEMMs whose FP8 form measured faster at the start of
    # the run, agreed by all ranks and saved in the checkpoints); see layers.fp8_linear, layers.fp8_plan
    fp8: str = "none"

    def __post_init__(self):
        from loongforge.core.training.megatron_engine import check_parallel_config, check_train_config

        check_parallel_config(self.parallel)  # what the megatron-core engine cannot do, before any process group
        check_train_config(self.train)
        if self.recipe not in ("pretrain", "sft"):
            raise ValueError(f"recipe={self.recipe!r}: one of pretrain, sft")
        if self.model.init_from_hf:
            for key, value in (("checkpoint.load", self.checkpoint.load), ("lora.base", self.lora.base)):
                if value:
                    raise ValueError(f"model.init_from_hf={self.model.init_from_hf} and {key}={value} both give the "
                                     f"initial weights; set one")
        if self.fp8 != "none":
            from loongforge.llm.layers.fp8_linear import check_fp8_mode

            check_fp8_mode(self.fp8)
        if self.parallel.tp > 1:
            check_tensor_parallel(self)
        if self.parallel.cp > 1:
            check_context_parallel(self)
        if getattr(self.model, "moe_a2a_overlap", False):
            check_moe_a2a_overlap(self)
        if self.train.seq_chunks > 1:
            from loongforge.llm.chunk_pipe import check_chunk_pipe

            check_chunk_pipe(self.train.seq_chunks, family=self.model.family, seq_length=self.train.seq_length,
                             parallel=self.parallel, recompute=self.train.recompute, packed=self.recipe == "sft")
        if self.recipe == "sft":
            check_sft_config(self)


def check_sft_config(cfg: LLMConfig) -> None:
    """Cross-group rules of ``recipe: sft`` (run while the config is built, before any process group)."""
    train, parallel = cfg.train, cfg.parallel
    if train.micro_batch_size not in (None, 1):
        raise ValueError(
            f"train.micro_batch_size={train.micro_batch_size}: recipe=sft plans its micro-batches by tokens "
            f"(balance.token_cap); set train.micro_batch_size=1"
        )
    cap = cfg.balance.token_cap
    if cap is not None and cap < train.seq_length:
        raise ValueError(f"balance.token_cap={cap} is below train.seq_length={train.seq_length}: "
                         f"a conversation of seq_length positions would fit no micro-batch")
    if parallel.pp > 1:
        if not cfg.sft.packing:
            raise ValueError("sft.packing=false with parallel.pp>1: the pipeline needs one micro-batch shape; use packing")
        if cap not in (None, train.seq_length):
            raise ValueError(f"balance.token_cap={cap} with parallel.pp>1: packed rows are padded to "
                             f"train.seq_length={train.seq_length}, so the cap must equal it")
    if cfg.data.prefixes:
        raise ValueError("data.prefixes are indexed pre-training data; recipe=sft reads sft.files")


def check_tensor_parallel(cfg: LLMConfig) -> None:
    """What ``parallel.tp > 1`` needs (before any process group) beyond what megatron checks when it
    builds: the Qwen3.5 families' Gated DeltaNet heads split over TP (``layers.gated_delta_net_tp``)."""
    from loongforge.llm.qwen3_5_config import LinearAttentionFields

    if isinstance(cfg.model, LinearAttentionFields):
        from loongforge.llm.layers.gated_delta_net_tp import HeadShards

        m = cfg.model
        HeadShards(m.linear_num_key_heads, m.linear_num_value_heads, m.linear_key_head_dim, m.linear_value_head_dim,
                   tp=cfg.parallel.tp)


def check_context_parallel(cfg: LLMConfig) -> None:
    """What ``parallel.cp > 1`` needs (before any process group): sequences that split into
    ``2*cp`` equal chunks; for DeepSeek-V3.2's sparse attention in SFT, packed rows, whose
    padding for CP (``families.dsa_context_parallel``) is left out of the indexer loss."""
    cp, seq = cfg.parallel.cp, cfg.train.seq_length
    if getattr(cfg.model, "attention_variant", None) == "dsa" and cfg.recipe == "sft" and not cfg.sft.packing:
        raise ValueError(f"parallel.cp={cp}: model.attention_variant=dsa (DeepSeek-V3.2 sparse attention) with "
                         f"recipe=sft needs sft.packing=true: unpacked rows are padded to a multiple of 2*cp = "
                         f"{2 * cp} and those pad positions would enter the indexer's loss as queries (packed rows "
                         f"mark CP's padding, which the loss leaves out)")
    if seq % (2 * cp):
        raise ValueError(f"parallel.cp={cp}: train.seq_length={seq} must be a multiple of 2*cp = {2 * cp} "
                         f"(each sequence is cut into 2*cp chunks, two per CP rank)")


def check_moe_a2a_overlap(cfg: LLMConfig) -> None:
    """What ``model.moe_a2a_overlap`` (megatron's combined 1F1B schedule) needs, before any process
    group: expert parallelism to overlap, one pipeline stage (megatron needs virtual pipeline stages
    otherwise), no full recomputation or ChunkPipe, pre-training (the SFT task has no schedule plan of
    its rows) and not fp32 (megatron runs it in bf16 or fp16; ``train.precision=auto`` is checked when
    it resolves, by the engine)."""
    key = "model.moe_a2a_overlap=true"
    train, parallel = cfg.train, cfg.parallel
    for bad, why in ((parallel.ep == 1, "needs parallel.ep > 1 (there is no expert all-to-all to overlap)"),
                     (parallel.pp > 1, f"with parallel.pp={parallel.pp}: megatron overlaps it across "
                                       "virtual pipeline stages only; use parallel.pp=1"),
                     (train.recompute == "full", "with train.recompute=full: megatron overlaps without it"),
                     (train.seq_chunks > 1, f"with train.seq_chunks={train.seq_chunks}: ChunkPipe runs the dense families"),
                     (cfg.recipe == "sft", "with recipe=sft: the SFT task gives megatron's combined schedule "
                                           "no plan of its rows; overlap is for recipe=pretrain"),
                     (train.precision == "fp32", "with train.precision=fp32: megatron overlaps in bf16")):
        if bad:
            raise ValueError(f"{key} {why}")


def _config_class(family: str) -> type[GPTConfig]:
    try:
        config_class = get_model_spec(family).config_class
    except ModelRegistryError as exc:
        raise ConfigError(f"model.family={family!r}: {exc}") from exc
    if not (isinstance(config_class, type) and issubclass(config_class, GPTConfig)):
        raise ConfigError(f"model.family={family!r} is not an LLM family (its config is {config_class.__name__})")
    return config_class


def _model_from_hf(hf_dir: str) -> GPTConfig:
    """``model.init_from_hf=DIR``: the model section of the HF model in DIR."""
    from loongforge.core.hf_mapping import MappingError
    from loongforge.core.hf_mapping.online import hf_model_config
    from loongforge.core.hub import resolve_local

    path = Path(resolve_local(hf_dir, key="model.init_from_hf")).expanduser().resolve()
    try:
        family, model = hf_model_config(path)
    except (MappingError, ValueError) as exc:
        raise ConfigError(f"model.init_from_hf={hf_dir}: {exc}") from exc
    if not isinstance(model, _config_class(family)):
        raise ConfigError(f"model.init_from_hf={hf_dir}: family {family!r} read no LLM config from {path / 'config.json'}")
    return replace(model, init_from_hf=str(path))


def load_llm_config(name_or_path: str | None, overrides: Sequence[str] = ()) -> LLMConfig:
    """Compose and validate an LLM config. The ``model`` group is validated as its family's
    config class (``ModelSpec.config_class``: the MoE families extend GPTConfig), so each
    family's own fields are known keys and unknown ones are errors. With ``model.init_from_hf``
    the model section is the HF model's (family and architecture from its ``config.json``) and
    takes no other ``model.*`` override."""
    model = read_section(LLMConfig, "model", name_or_path, overrides, [CONFIG_DIR])
    if model.get("init_from_hf"):
        hf_model = _model_from_hf(str(model["init_from_hf"]))
        rest = [o for o in overrides if o.split("=", 1)[0].strip().lstrip("+~") != "model.init_from_hf"]
        reason = (f"model.init_from_hf={model['init_from_hf']} sets the whole model section from "
                  f"{hf_model.init_from_hf}/config.json")
        return resolve_tokenizer(load_config(LLMConfig(model=hf_model), name_or_path, rest, [CONFIG_DIR],
                                             fixed={"model": reason}))
    config_class = _config_class(model.get("family", GPTConfig.family))
    return resolve_tokenizer(load_config(LLMConfig(model=config_class()), name_or_path, overrides, [CONFIG_DIR]))


def resolve_tokenizer(cfg: LLMConfig) -> LLMConfig:
    """``data.tokenizer=owner/name``: the local snapshot of that hub repository (before any group)."""
    from loongforge.core.hub import resolve_local

    if cfg.data.tokenizer:
        cfg.data.tokenizer = resolve_local(cfg.data.tokenizer, key="data.tokenizer")
    return cfg


def collate(samples: list[dict]) -> dict[str, torch.Tensor]:
    return {k: torch.stack([torch.as_tensor(s[k]) for s in samples]) for k in ("tokens", "labels", "loss_mask", "position_ids")}


class GlobalBatchSampler:
    """Step k trains on dataset samples ``[k*G, (k+1)*G)``; DP rank r takes its contiguous
    ``G/dp`` share, split into micro-batches. The same global batch on any layout is the same
    set of samples, and the position is just ``consumed_samples``."""

    def __init__(self, global_batch_size: int, micro_batch_size: int, dp_rank: int, dp_size: int):
        self.G, self.mbs, self.dp_rank, self.dp_size = global_batch_size, micro_batch_size, dp_rank, dp_size

    def step_indices(self, step: int) -> list[list[int]]:
        per_rank = self.G // self.dp_size
        start = step * self.G + self.dp_rank * per_rank
        idx = list(range(start, start + per_rank))
        return [idx[i : i + self.mbs] for i in range(0, per_rank, self.mbs)]


class LLMTask(MegatronTask):
    """GPT pre-training on an indexed dataset: next-token loss over ``loss_mask`` tokens."""

    variable_micro_batches = False

    def __init__(self, cfg: LLMConfig):
        self.cfg = cfg
        self.family = cfg.model.family
        self.spec = get_model_spec(cfg.model.family)
        self._dataset = None
        if cfg.data.prefixes:  # the files exist and the blend is well formed, before any process group
            from loongforge.llm.data.gpt import resolve_blend

            resolve_blend(self._blend())
        if cfg.data.tokenizer:  # it loads and fits model.vocab_size, before any process group
            from loongforge.llm.data import load_tokenizer
            from loongforge.llm.data.vocabulary import check_tokenizer_fits

            check_tokenizer_fits(f"data.tokenizer={cfg.data.tokenizer}", load_tokenizer(cfg.data.tokenizer).vocab_size,
                                 cfg.model.vocab_size)
        # fp8=adaptive: the run's FP8Plan (layers.fp8_plan), measured when the model is built or
        # restored from the checkpoint a run resumes; saved in every checkpoint's manifest
        self.fp8_plan: FP8Plan | None = None

    def manifest_fields(self) -> dict:
        """The checkpoint manifest's entries of this task: ``fp8_plan`` (fp8=adaptive)."""
        return {"fp8_plan": self.fp8_plan.to_dict()} if self.fp8_plan is not None else {}

    def restore(self, manifest: dict) -> None:
        """A resumed run's manifest, before the model is built: an fp8=adaptive run takes the
        checkpoint's ``fp8_plan`` and measures no shape it covers."""
        record = manifest.get("fp8_plan")
        if self.cfg.fp8 != "adaptive" or record is None:
            return
        from loongforge.core.checkpoint import CheckpointReadError
        from loongforge.llm.layers.fp8_plan import FP8Plan

        try:
            self.fp8_plan = FP8Plan.from_dict(record)
        except ValueError as exc:
            raise CheckpointReadError(f"the checkpoint's manifest: {exc}") from exc

    def model_config_dict(self) -> dict:
        return self.cfg.model.architecture()

    def transformer_config_kwargs(self) -> dict:
        return self.cfg.model.transformer_config_kwargs()

    def build_kwargs(self) -> dict:
        """Keyword arguments of the family's ``build`` beyond the model config (none here; e.g.
        ``recompute_elementwise`` of the GPT families, which ``lf-llm bench`` sets)."""
        return {}

    def build_model(self, ctx, transformer_config, pre_process, post_process, load_initial_weights=True):
        if self.cfg.kernels.force_reference:
            from loongforge.core.kernels import KernelPolicy

            ctx = replace(ctx, kernels=KernelPolicy(force_reference=True))  # the modules resolve their ops by it
        model = self._build_with_fp8(ctx, transformer_config, pre_process, post_process)
        if self.cfg.model.init_from_hf and load_initial_weights:  # before any adapter: the HF weights are the base
            from loongforge.core.hf_mapping import MappingError
            from loongforge.core.hf_mapping.online import load_hf_weights

            try:
                load_hf_weights(model, self.cfg.model.init_from_hf, self.spec.hf_adapter, self.cfg.model)
            except MappingError as exc:  # missing or mismatched safetensors: one clear line, exit 2
                raise ConfigError(f"model.init_from_hf={self.cfg.model.init_from_hf}: {exc}") from exc
        lora = self.cfg.lora
        if lora.enabled:
            from loongforge.llm.lora import apply_lora, load_base_weights

            if lora.base and load_initial_weights:
                load_base_weights(model, lora.base, self.model_config_dict())
            apply_lora(model, lora, seed=self.cfg.train.seed)
        return model

    def _build_with_fp8(self, ctx, transformer_config, pre_process, post_process):
        """The family's model, its layer specs made in the ``fp8`` mode; an FP8 mode that the
        family's layers do not take is an error rather than a bf16 run. With ``fp8=adaptive`` the
        run's plan is made (or taken from the resumed checkpoint) and handed to every FP8 linear."""
        from loongforge.llm.layers.fp8_linear import apply_fp8_plan, count_fp8_linears, fp8_linears

        with fp8_linears(self.cfg.fp8):
            model = self.spec.build(self.cfg.model, ctx, transformer_config, pre_process, post_process,
                                    **self.build_kwargs())
        if self.cfg.fp8 != "none" and not count_fp8_linears(model):
            raise ValueError(
                f"fp8={self.cfg.fp8!r}: model.family={self.family!r} builds no FP8 linear; FP8 runs in the "
                "dense fast layer spec (llama, qwen2, qwen3, mistral) and the MoE layers (qwen3_moe, deepseek_v3 "
                "without DSA)"
            )
        if self.cfg.fp8 == "adaptive":
            self.fp8_plan = self._agreed_fp8_plan(ctx, model, transformer_config.params_dtype)
            apply_fp8_plan(model, self.fp8_plan)
        return model

    def _agreed_fp8_plan(self, ctx, model, dtype):
        """The run's FP8 plan for ``model``'s adaptive linears, the same on every rank: the plan
        restored from the checkpoint where it covers every rank's shapes (a resumed run measures
        nothing), else that plan with the shapes it lacks measured (``layers.fp8_measure``; every
        rank takes part, so every rank calls this)."""
        from loongforge.llm.layers.fp8_linear import adaptive_fp8_shapes
        from loongforge.llm.layers.fp8_measure import measure_fp8_plan, shapes_of_all_ranks
        from loongforge.llm.layers.fp8_plan import FP8Plan

        plan = self.fp8_plan or FP8Plan()
        missing = plan.missing(shapes_of_all_ranks(adaptive_fp8_shapes(model)))
        if missing:
            measured = measure_fp8_plan(missing, self.fp8_tokens_per_micro_batch(ctx), self.fp8_timer(ctx, dtype),
                                        ctx.device)
            plan = plan.merged(measured)
        return plan

    def fp8_tokens_per_micro_batch(self, ctx) -> int:
        """The tokens one linear takes per micro-batch (the ``M`` fp8=adaptive times its shapes at):
        micro-batch size x sequence length, over the context-parallel split."""
        train = self.cfg.train
        mbs = train.micro_batch_size or train.global_batch_size // ctx.dp_size
        return mbs * train.seq_length // ctx.layout.cp

    def fp8_timer(self, ctx, dtype):
        """How fp8=adaptive times a linear shape (``layers.fp8_measure.Timer``): the registry's
        ``fp8_linear`` as the run resolves it, on the run's device and in its parameter dtype; a
        ``ConfigError`` where it has no fused FP8 kernel. A subclass may time otherwise."""
        from loongforge.llm.layers.fp8_measure import registry_linear_timer

        return registry_linear_timer(ctx.kernels, dtype, ctx.device, ctx.accelerator.synchronize)

    def flops_per_token(self, seq_length: int) -> float:
        return self.cfg.model.flops_per_token(seq_length)

    def dataset(self):
        if self._dataset is None:
            from loongforge.llm.data import gpt, load_tokenizer, shipped
            from loongforge.llm.data.vocabulary import check_tokenizer_fits

            train = self.cfg.train
            num_samples = train.steps * train.global_batch_size
            tokenizer = load_tokenizer(self.tokenizer_ref())
            check_tokenizer_fits(self.tokenizer_ref(), tokenizer.vocab_size, self.cfg.model.vocab_size)
            if self.cfg.data.prefixes:
                self._dataset = gpt.build_gpt_dataset(
                    self._blend(), seq_length=train.seq_length, num_samples=num_samples, seed=train.seed,
                    tokenizer=tokenizer, cache_dir=self.cfg.data.resolved_cache_dir(),
                )
            else:
                self._dataset = shipped.bundled_dataset(  # tokenized here, with data.tokenizer when set
                    self.cfg.data.resolved_cache_dir(), seq_length=train.seq_length, num_samples=num_samples,
                    seed=train.seed, tokenizer=self.tokenizer_ref(),
                )
        return self._dataset

    def data_name(self) -> str:
        """The training data, as the error messages name it."""
        return f"data.prefixes={list(self.cfg.data.prefixes)}" if self.cfg.data.prefixes else "the bundled corpus"

    def _blend(self) -> list[tuple[float, str]]:
        weights = self.cfg.data.weights or [1.0] * len(self.cfg.data.prefixes)
        return list(zip(weights, self.cfg.data.prefixes))

    def tokenizer_ref(self) -> str:
        from loongforge.llm.data.bundled_files import bundled_tokenizer_path

        return str(self.cfg.data.tokenizer or bundled_tokenizer_path())

    def steps(self, ctx, start_step: int) -> Iterator[StepBatch]:
        from loongforge.llm.data.vocabulary import check_token_ids

        train = self.cfg.train
        mbs = train.micro_batch_size or train.global_batch_size // ctx.dp_size
        sampler = GlobalBatchSampler(train.global_batch_size, mbs, ctx.dp_rank, ctx.dp_size)
        data = self.dataset()
        step = start_step
        while True:
            indices = sampler.step_indices(step)
            micro = [collate([data[i] for i in mb]) for mb in indices]
            for batch, ids in zip(micro, indices):  # an id past the embedding table is a data error
                check_token_ids(batch, ids, self.cfg.model.vocab_size, self.data_name())
            tokens = sum(int(mb["tokens"].numel()) for mb in micro)  # the replica's, before the CP split
            micro = [{k: v.to(ctx.device) for k, v in cp_share_of_rows(mb, ctx.pgs.cp).items()} for mb in micro]
            yield StepBatch(micro_batches=micro, tokens=tokens)
            step += 1

    def schedule_plan(self, model, batch):
        # megatron's combined 1F1B schedule (model.moe_a2a_overlap): the model's plan
        output = model.build_schedule_plan(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
        return output, partial(masked_token_loss, batch["loss_mask"])

    def forward(self, model, batch):
        chunks = self.cfg.train.seq_chunks
        if chunks > 1:  # ChunkPipe
            from loongforge.llm.chunk_pipe import chunked_forward

            output = chunked_forward(model, batch, chunks)
        else:
            output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"],
                           loss_mask=batch["loss_mask"])
        return output, partial(masked_token_loss, batch["loss_mask"])


def cp_share_of_rows(batch: dict[str, torch.Tensor], cp_group) -> dict[str, torch.Tensor]:
    """This CP rank's share of ``[b, s]`` rows (``tokens``, ``labels``, ``loss_mask``,
    ``position_ids``): megatron-core's load-balanced split (``get_batch_on_this_cp_rank``: chunks
    ``r`` and ``2*cp-1-r`` of ``2*cp``); the batch itself without context parallelism."""
    if cp_group is None or cp_group.size() == 1:
        return batch
    from megatron.core.utils import get_batch_on_this_cp_rank

    return get_batch_on_this_cp_rank(dict(batch), is_hybrid_cp=False, cp_group=cp_group)


def masked_token_loss(loss_mask: torch.Tensor, per_token_loss: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sum of the per-token losses where loss_mask is set, number of those tokens)``: the loss of
    every token model (pre-training, SFT, VLM), normalised by the loop over the global batch."""
    mask = loss_mask.float()
    return (per_token_loss.float() * mask).sum(), mask.sum()

"""Logits of one fixed batch from an lf-llm checkpoint under several layouts, in one 2-process job:
``torchrun --nproc-per-node=2 reshard_logits.py CKPT OUT [key=value ...]`` (the run's overrides on
``train_debug``; ``model=NAME`` for another model).

For each layout the lf-llm trainer is built and resumed from the checkpoint (model and optimizer
read resharded), and the full-vocabulary logits of a fixed batch go to ``OUT/logits-<name>.pt``:
``tp2`` and ``tp1`` (DP=2) and ``pp2`` from CKPT; the PP=2 trainer then saves its state to
``OUT/from-pp2``, which ``back`` (TP=2 again) loads; ``tp1-init`` are the logits before the load.
At TP=2, the saved layout, each rank also writes its RNG states after the load
(``OUT/rng-tp2-rank<R>.pt``), having moved them on before it. Used by test_llm_resume.py and test_llm_qwen3_5.py.
"""

import sys
from pathlib import Path

import torch

from loongforge.core.config import to_dict
from loongforge.core.parallel import destroy_parallel, init_parallel
from loongforge.core.training import checkpointing
from loongforge.core.training.loop import Trainer
from loongforge.llm.recipe import LLMConfig, load_llm_config
from loongforge.llm.recipe_task import make_task


def fixed_batch(cfg: LLMConfig, device) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    shape = (cfg.train.micro_batch_size, cfg.train.seq_length)
    tokens = torch.randint(0, cfg.model.vocab_size, shape, generator=g)
    return {"tokens": tokens.to(device), "position_ids": torch.arange(shape[1]).expand(shape).to(device)}


def logits(trainer: Trainer, batch) -> torch.Tensor | None:
    """The full logits on the last pipeline stage (gathered over TP), None elsewhere."""
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    def forward_step(data_iterator, model):
        b = next(data_iterator)
        out = model(b["tokens"], b["position_ids"], None)
        return out, lambda output, non_loss_data=True: gather_from_tensor_model_parallel_region(output)

    with torch.no_grad():
        collected = get_forward_backward_func(pp_size=trainer.ctx.layout.pp)(
            forward_step_func=forward_step, data_iterator=iter([batch]), model=[trainer.model], num_microbatches=1,
            seq_length=trainer.train.seq_length, micro_batch_size=trainer.train.micro_batch_size,
            forward_only=True, collect_non_loss_data=True,
        )
    return collected[0] if trainer.ctx.is_last_stage else None


def main(ckpt: Path, out: Path, overrides: list[str]) -> None:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    cfg = load_llm_config("train_debug", overrides + [f"log.run_dir={out}"])  # any family: model=NAME
    for name, layout, source in [("tp2", dict(tp=2), ckpt), ("tp1", {}, ckpt), ("pp2", dict(pp=2), ckpt),
                                 ("back", dict(tp=2), out / "from-pp2")]:
        ctx = init_parallel(**layout, seed=cfg.train.seed)
        trainer = Trainer(make_task(cfg), ctx, cfg, config_record=to_dict(cfg))
        writes = ctx.is_last_stage and ctx.tp_rank == 0 and ctx.dp_rank == 0
        if name == "tp1":  # the freshly initialised model's logits, to show the load changes them
            result = logits(trainer, fixed_batch(cfg, ctx.device))
            if writes:
                torch.save(result.cpu(), out / "logits-tp1-init.pt")
        if name == "tp2":  # move the random streams on: the load must set them back (same layout)
            torch.rand(1)
            with get_cuda_rng_tracker().fork():
                torch.rand(1)
        checkpointing.resume(trainer, source)
        if name == "tp2":
            rng = {"torch": torch.get_rng_state(), "tracker": get_cuda_rng_tracker().get_states()}
            torch.save(rng, out / f"rng-tp2-rank{ctx.rank}.pt")
        result = logits(trainer, fixed_batch(cfg, ctx.device))
        if writes:
            torch.save(result.cpu(), out / f"logits-{name}.pt")
        if name == "pp2":
            checkpointing.save(trainer, out / "from-pp2")
    destroy_parallel()


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:])

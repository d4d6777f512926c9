"""Train an LLM config for ``train.steps`` and record the losses and the first step's gradients.

    python cp_probe.py OUT.pt CONFIG [key=value ...]                      # one process
    torchrun --nproc-per-node=2 cp_probe.py OUT.pt CONFIG [key=value ...]  # e.g. parallel.cp=2

The gradients are every parameter's ``main_grad`` just before the first optimizer step (after
megatron's reduction over the DP x CP group and the per-token scaling): whole on every rank when
TP and PP are 1. Rank 0 writes them with the per-step losses and grad norms, and the shape of
the tokens of its first micro-batch (this rank's share under context parallelism).
"""

import sys

import torch


def main(out: str, config: str, overrides: list[str]) -> None:
    from loongforge.core.config import to_dict
    from loongforge.core.parallel import destroy_parallel, init_parallel
    from loongforge.core.training.loop import Trainer
    from loongforge.llm.recipe import load_llm_config, make_task

    cfg = load_llm_config(config, overrides)
    task = make_task(cfg)
    p = cfg.parallel
    ctx = init_parallel(tp=p.tp, pp=p.pp, cp=p.cp, ep=p.ep, seed=cfg.train.seed)
    prepare = getattr(task, "prepare", None)
    if prepare is not None:
        prepare(ctx)
    trainer = Trainer(task, ctx, cfg, config_record=to_dict(cfg))
    module = trainer.inner_model
    captured = {}
    step = trainer.engine.optimizer.step_with_ready_grads

    def capture_then_step():
        if not captured:
            captured.update({name: p.main_grad.detach().float().clone()
                             for name, p in module.named_parameters() if getattr(p, "main_grad", None) is not None})
        return step()

    trainer.engine.optimizer.step_with_ready_grads = capture_then_step
    shapes = []
    forward = task.forward

    def recording_forward(model, batch):
        shapes.append(tuple(batch["tokens"].shape))
        return forward(model, batch)

    task.forward = recording_forward
    results = trainer.fit()
    if ctx.rank == 0:
        torch.save({"losses": [r.loss for r in results], "grad_norms": [r.grad_norm for r in results],
                    "grads": captured, "first_tokens_shape": shapes[0]}, out)
    destroy_parallel()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])

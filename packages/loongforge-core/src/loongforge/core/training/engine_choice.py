"""How the loop picks the engine of a task: the one ``task.engine`` names (``megatron`` or
``torch``), imported only when chosen (the megatron-core engine needs ``loongforge-core[megatron]``).
It lives apart from ``engine``, the interface both engines import, so that no module the engines
import imports them back."""

from __future__ import annotations

from loongforge.core.training.engine import ENGINES, Engine


def make_engine(task, ctx, cfg, resuming: bool) -> Engine:
    """The engine ``task.engine`` names, for the run config ``cfg`` (its ``train`` and ``parallel``)."""
    if task.engine == "megatron":
        from loongforge.core.training.megatron_engine import MegatronEngine

        return MegatronEngine(task, ctx, cfg.train, cfg.parallel, resuming=resuming)
    if task.engine == "torch":
        from loongforge.core.training.torch_engine import TorchEngine

        return TorchEngine(task, ctx, cfg.train, cfg.parallel, resuming=resuming, ema=getattr(cfg, "ema", None),
                           lora=getattr(cfg, "lora", None))
    raise ValueError(f"model family {task.family!r} names engine {task.engine!r}; one of {', '.join(ENGINES)}")

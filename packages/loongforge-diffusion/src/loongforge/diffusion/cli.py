"""``lf-diffusion``: the shared ``lf-*`` commands (train, info, convert, bench, plot, compare) for
the registered diffusion families (``model.family``: Wan, Qwen-Image, a plugin's DiT), plus
``preprocess`` (videos, images and captions -> latent shards) and ``sample``.

    lf-diffusion train [--config NAME|PATH] [key=value ...]
    lf-diffusion convert lf-to-diffusers CHECKPOINT OUT [--ema]   # CHECKPOINT: a run dir, root or step dir
    lf-diffusion convert lora-to-peft CHECKPOINT OUT [--ema]      # a LoRA run's adapters, for diffusers
    lf-diffusion sample [--run RUN_DIR] [--checkpoint CKPT] [--out DIR] [--image PATH] [key=value ...]
    lf-diffusion preprocess [--config NAME|PATH] [key=value ...]
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from loongforge.core.cli import add_config_arguments, normalise_overrides
from loongforge.diffusion.run_config import CONFIG_DIR, load_recipe

DEFAULT_TRAIN = "tiny"
DEFAULT_PREPROCESS = "preprocess"


def make_task(recipe):
    """The task of the config's ``model.family`` (``ModelSpec.task``), after the model's device checks."""
    from loongforge.core.accelerators import get_accelerator
    from loongforge.core.models import get_model_spec

    recipe.model.check_device(get_accelerator().device_type)
    return get_model_spec(recipe.model.family).make_task(recipe)


def cmd_info(args, recipe) -> None:
    import torch

    from loongforge.core.accelerators import get_accelerator
    from loongforge.core.config import to_yaml
    from loongforge.core.models import get_model_spec

    with torch.device("meta"):
        model = get_model_spec(recipe.model.family).build(recipe.model)
    parts = model.parts()
    per_part = sum(p.numel() for p in next(iter(parts.values())).parameters())
    print(to_yaml(recipe))
    print(f"{recipe.model.describe()}; parts: {', '.join(parts)}; parameters per part: {per_part / 1e6:.2f}M")
    print(f"accelerator: {get_accelerator()!r}")


def recipe_of(manifest: dict, overrides: Sequence[str] = ()):
    """The run config a checkpoint was trained with (its manifest), with ``key=value`` overrides."""
    from loongforge.core.config import load_config, load_saved_config
    from loongforge.diffusion.model.family import DEFAULT_FAMILY
    from loongforge.diffusion.schema import RENAMED_KEYS, recipe_schema

    family = (manifest["config"].get("model") or {}).get("family") or DEFAULT_FAMILY
    return load_saved_config(manifest["config"], lambda path, more: load_config(
        recipe_schema(family), path, more, renamed=RENAMED_KEYS), overrides)


def lf_to_diffusers_command(source: str, out: str, args) -> str:
    from loongforge.core.checkpoint import Checkpoint, checkpoint_root
    from loongforge.core.checkpoint_owner import check_checkpoint_command
    from loongforge.core.cli import convert_dtype
    from loongforge.core.config import ConfigError
    from loongforge.core.lora import lora_record, merge_state
    from loongforge.diffusion.model.family import diffusers_adapter

    ckpt = Checkpoint(checkpoint_root(source))
    check_checkpoint_command(ckpt.manifest, "lf-diffusion", ckpt.directory)
    tensors, manifest = ckpt.tensors(), ckpt.manifest
    prefix = "ema." if args.ema else "model."
    if args.ema and not manifest.get("ema"):
        raise ConfigError(f"{source}: the checkpoint has no EMA weights (trained with ema.decay=0)")
    state = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
    if args.ema:  # experts without EMA (not trained) export their model weights
        for k, v in tensors.items():
            if k.startswith("model.") and k[len("model."):] not in state:
                state[k[len("model."):]] = v
    lora = lora_record(manifest)
    if lora:  # a LoRA run: W + (alpha / rank) B A, an ordinary diffusers model
        state = merge_state(state, lora["alpha"] / lora["rank"])
    model = recipe_of(manifest).model
    written = diffusers_adapter(model.family).export_diffusers(state, model, out, dtype=convert_dtype(args.dtype))
    merged = f" (LoRA adapters merged, rank {lora['rank']})" if lora else ""
    return "\n".join(f"wrote {path}{merged}" for path in written)


def lora_layouts(manifest: dict, names: list[str]):
    """``convert lora-to-peft``: each part's adapters as diffusers names them
    (``transformer.blocks.0.attn1.to_q.lora_A.weight``, the DiTs' names being diffusers' own),
    with the LoRA config in the file's header where the transformer's ``load_lora_adapter`` and the
    pipeline's ``load_lora_weights`` read it; Wan 2.2's experts in ``transformer/`` and
    ``transformer_2/`` (``load_lora_weights(..., load_into_transformer_2=True)`` for the second)."""
    from loongforge.core.lora import AdapterLayout
    from loongforge.diffusion.model.family import DEFAULT_FAMILY, model_config_class

    model = (manifest.get("config") or {}).get("model") or {}
    cfg = model_config_class(model.get("family") or DEFAULT_FAMILY)
    parts = manifest.get("experts") or ["transformer"]
    layouts = []
    for name in parts:
        prefixed = any(k.startswith(f"{name}.") for k in names)  # a model of several parts names them
        if not prefixed and len(parts) > 1:
            continue
        layouts.append(AdapterLayout(prefix=f"{name}." if prefixed else "", rename=lambda weights: {w: w for w in weights},
                                     library=f"diffusers {cfg.diffusers_class}",
                                     directory=name if len(parts) > 1 else "", key_prefix="transformer.",
                                     metadata_prefix="transformer"))
    return layouts


def convert_options(parser) -> None:
    parser.add_argument("--ema", action="store_true", help="lf-to-diffusers, lora-to-peft: export the EMA weights")


def bench_options(parser) -> None:
    parser.add_argument("--batch-size", type=int, default=1)


def bench(args, config: str, overrides: list[str]) -> None:
    from loongforge.core.bench_protocol import repeat_in_processes
    from loongforge.core.benchmarking import parse_variant
    from loongforge.diffusion.bench import check_benchmarkable, run_bench, step_seconds_from_config, variant_recipe

    recipe = load_recipe(config, overrides)
    check_benchmarkable(recipe.model)
    variants: list[tuple[str, list[str]]] = []
    for spec in args.variant:
        variants.append(parse_variant(spec, ["diffusers", "loongforge", "loongforge_preset", *(n for n, _ in variants)]))
    for _, items in variants:
        variant_recipe(recipe, items)  # a bad variant fails before any run
    options = dict(steps=args.steps, warmup=args.warmup, batch_size=args.batch_size, variants=variants,
                   rounds=args.rounds)
    if args.processes > 1:
        return repeat_in_processes(step_seconds_from_config, dict(config=config, overrides=overrides, profile_rows=0,
                                                                  **options), args.processes, ["diffusers"])
    run_bench(recipe, **options, profile_rows=args.profile_rows, trace=args.trace,
              report=lambda line: print(line, flush=True))


def cmd_preprocess(args) -> int:
    import torch.distributed as dist

    from loongforge.core.config import load_config
    from loongforge.core.distributed import init_distributed
    from loongforge.diffusion.preprocess import PreprocessConfig, preprocess

    cfg = load_config(PreprocessConfig, args.config, normalise_overrides(args.overrides), config_dirs=[CONFIG_DIR])
    # under torchrun each rank encodes its shards on its own device; the job's group orders the
    # manifest after all of them (a bad config has failed above, before any group exists)
    owned = not dist.is_initialized()
    init_distributed(group_for_world_of_one=False)
    try:
        manifest = preprocess(cfg)
    finally:
        if owned and dist.is_initialized():
            dist.destroy_process_group()
    if manifest is not None:
        print(f"wrote {manifest}")
    return 0


def cmd_sample(args) -> int:
    from loongforge.core.checkpoint import Checkpoint, checkpoint_root
    from loongforge.core.checkpoint_owner import check_checkpoint_command
    from loongforge.diffusion.sampling import sample_run

    run_dir = Path(args.run)
    checkpoint = Checkpoint(args.checkpoint or checkpoint_root(run_dir))
    check_checkpoint_command(checkpoint.manifest, "lf-diffusion", checkpoint.directory)
    overrides = normalise_overrides(args.overrides) + ([f"sample.image={args.image}"] if args.image else [])
    recipe = recipe_of(checkpoint.manifest, overrides)
    for path in sample_run(recipe, checkpoint.directory, args.out or run_dir / "samples"):
        print(f"wrote {path}")
    return 0


def commands(sub) -> None:
    p = sub.add_parser("preprocess", help="encode videos/images + captions to latent shards", allow_abbrev=False)
    add_config_arguments(p, DEFAULT_PREPROCESS)
    p.set_defaults(fn=cmd_preprocess)

    p = sub.add_parser("sample", help="generate frames from a checkpoint into a PNG grid and GIF", allow_abbrev=False)
    p.add_argument("--run", default="runs/diffusion-tiny", help="run directory of `lf-diffusion train`")
    p.add_argument("--checkpoint", default=None, help="checkpoint dir or root (default: the run's latest)")
    p.add_argument("--out", default=None, help="output directory (default: RUN/samples)")
    p.add_argument("--image", default=None, help="image-to-video models: the image that starts every video (sample.image)")
    p.set_defaults(fn=cmd_sample, takes_overrides=True)


def describe_cli():
    """This package's ``ModalityCLI`` (``loongforge.core.cli``)."""
    from loongforge.core.cli import Converter, ModalityCLI

    return ModalityCLI(
        prog="lf-diffusion", module="loongforge.diffusion.cli", description="LoongForge video and image diffusion transformers",
        config_dirs=[CONFIG_DIR], default_config=DEFAULT_TRAIN, load_config=load_recipe, make_task=make_task,
        info=cmd_info, example="train.steps=100 parallel.data_parallel=fsdp train.recompute=selective",
        converters=[Converter("lf-to-diffusers", "a LoongForge checkpoint (or run dir) -> the family's diffusers "
                              "transformer directories (a LoRA run's adapters merged)", lf_to_diffusers_command)],
        lora_layouts=lora_layouts, lora_library="diffusers",
        convert_options=convert_options, bench_options=bench_options, bench=bench, commands=commands,
        packages=["loongforge-core", "loongforge-diffusion", "loongforge-kernels"],
        command_configs={DEFAULT_PREPROCESS: "preprocess"},
        libraries=("torch", "diffusers", "transformers"),
    )


def main(argv: list[str] | None = None) -> int:
    from loongforge.core.cli import build_cli

    return build_cli(describe_cli)(argv)


if __name__ == "__main__":
    sys.exit(main())

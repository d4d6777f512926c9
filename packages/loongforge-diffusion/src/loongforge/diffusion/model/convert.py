"""diffusers <-> LoongForge weights for the Wan DiT.

The mapping is the identity: ``WanDiT`` has ``WanTransformer3DModel``'s parameter names and
shapes, image-to-video variants included (Wan 2.1 I2V's ``condition_embedder.image_embedder.*`` and
``blocks.N.attn2.add_k_proj/add_v_proj/norm_added_k``). ``check_layout`` verifies that (both
directions, shapes included) before any copy, so a mismatching checkpoint fails with the
offending keys instead of loading half a model. The only keys read and not kept are those
diffusers itself drops on load (``IGNORED_KEYS``). Two-expert checkpoints are diffusers pipeline
directories with ``transformer/`` (high noise) and ``transformer_2/`` (low noise).

The image conditioning (``model.condition``) is an architecture key too: ``i2v`` wherever
``in_channels`` differs from ``out_channels`` (noisy, mask and condition latents on channels),
``ti2v`` where the pipeline's ``model_index.json`` says ``expand_timesteps: true`` (Wan 2.2 TI2V).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from loongforge.core.lora import strip_adapters
from loongforge.core.training.sharding import local, region
from loongforge.diffusion.model.config import WanConfig
from loongforge.diffusion.model.experts import WanExperts


# checkpoint keys diffusers' WanTransformer3DModel skips on load (its
# ``_keys_to_ignore_on_load_unexpected``: an unused query norm of early I2V checkpoints)
IGNORED_KEYS = (re.compile(r"(^|\.)norm_added_q\."),)


def kept_keys(keys, ignored=IGNORED_KEYS) -> list[str]:
    """The checkpoint keys that map to parameters (all but those matching ``ignored``)."""
    return [k for k in keys if not any(p.search(k) for p in ignored)]


def check_layout(ours: dict[str, tuple], theirs: dict[str, tuple], source: str) -> None:
    """Same keys and shapes (``{name: shape}``), or an error naming the differences."""
    missing = sorted(set(ours) - set(theirs))
    unexpected = sorted(set(theirs) - set(ours))
    shapes = [k for k in set(ours) & set(theirs) if tuple(ours[k]) != tuple(theirs[k])]
    if missing or unexpected or shapes:
        parts = []
        if missing:
            parts.append(f"missing {missing[:5]}{' ...' if len(missing) > 5 else ''}")
        if unexpected:
            parts.append(f"unexpected {unexpected[:5]}{' ...' if len(unexpected) > 5 else ''}")
        for k in sorted(shapes)[:5]:
            parts.append(f"{k}: {list(theirs[k])} vs model {list(ours[k])}")
        raise ValueError(f"{source}: weights do not match the model's layout: " + "; ".join(parts))


def shapes_of(state: dict[str, torch.Tensor]) -> dict[str, tuple]:
    return {k: tuple(v.shape) for k, v in state.items()}


def transformer_dirs(path: str | Path, names: list[str]) -> dict[str, Path]:
    """The diffusers transformer directory of each expert under ``path``."""
    root = Path(path).expanduser()
    if not root.is_dir():
        raise FileNotFoundError(f"model.pretrained={str(path)!r}: not a directory")
    if len(names) == 1 and (root / "config.json").is_file():
        return {names[0]: root}
    dirs = {name: root / name for name in names}
    for name, d in dirs.items():
        if not (d / "config.json").is_file():
            raise FileNotFoundError(f"model.pretrained={str(path)!r}: no {name}/config.json (diffusers layout expected)")
    return dirs


def pipeline_condition(transformer_dir: Path) -> str | None:
    """``ti2v`` or ``none`` from the ``expand_timesteps`` of the pipeline's ``model_index.json``
    (in the directory or, for a pipeline's ``transformer/``, above it); None without one."""
    for index in (transformer_dir / "model_index.json", transformer_dir.parent / "model_index.json"):
        if index.is_file():
            return "ti2v" if json.loads(index.read_text()).get("expand_timesteps") else "none"
    return None


def read_diffusers_config(directory: Path) -> dict:
    path = directory / "config.json"
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: cannot read diffusers config ({exc})") from exc


def pretrained_architecture(path: str | Path) -> tuple[dict, Path]:
    """``model.pretrained=DIR``: the architecture keys of the model in DIR (``WanConfig`` names and
    values) and the config.json they come from. A transformer directory gives one expert; a
    pipeline with ``transformer/`` and ``transformer_2/`` gives two, with the boundary from its
    ``boundary.json`` (our export) or ``model_index.json``."""
    root = Path(path).expanduser()
    if not root.is_dir():
        raise FileNotFoundError(f"model.pretrained={str(path)!r}: not a directory")
    source = root / "config.json" if (root / "config.json").is_file() else root / "transformer" / "config.json"
    if not source.is_file():
        raise FileNotFoundError(f"model.pretrained={str(path)!r}: no config.json or transformer/config.json "
                                f"(a diffusers WanTransformer3DModel or Wan pipeline directory expected)")
    cfg = WanConfig.from_diffusers(read_diffusers_config(source.parent), source=str(source))
    arch = {k: getattr(cfg, k) for k in cfg.diffusers_kwargs()}
    arch["patch_size"] = list(cfg.patch_size)
    condition = "i2v" if cfg.condition == "i2v" else pipeline_condition(root)
    if condition is not None:
        arch["condition"] = condition
    if source.parent.name == "transformer" and (root / "transformer_2" / "config.json").is_file():
        ratio = None
        for name in ("boundary.json", "model_index.json"):
            if (root / name).is_file():
                ratio = json.loads((root / name).read_text()).get("boundary_ratio", ratio)
        if ratio is None:
            raise FileNotFoundError(f"model.pretrained={str(path)!r}: two experts but no boundary_ratio in "
                                    f"boundary.json or model_index.json")
        arch["boundary_ratio"] = ratio
    else:
        arch["boundary_ratio"] = None
    return arch, source


def check_config(cfg: WanConfig, directory: Path) -> None:
    theirs = WanConfig.from_diffusers(read_diffusers_config(directory), source=str(directory / "config.json"))
    for key, value in cfg.diffusers_kwargs().items():
        other = theirs.diffusers_kwargs()[key]
        if value != other:
            raise ValueError(f"{directory / 'config.json'}: {key}={other!r} but model.{key}={value!r}")


WEIGHTS = "diffusion_pytorch_model.safetensors"


def weight_files(directory: Path) -> list[Path]:
    """The safetensors files of a diffusers model directory (single or sharded)."""
    index = directory / f"{WEIGHTS}.index.json"
    if index.is_file():
        return [directory / n for n in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    if (directory / WEIGHTS).is_file():
        return [directory / WEIGHTS]
    raise FileNotFoundError(f"{directory}: no {WEIGHTS} (or its .index.json); diffusers safetensors weights expected")


def read_diffusers_weights(directory: Path) -> dict[str, torch.Tensor]:
    """All tensors of a diffusers model directory."""
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for path in weight_files(directory):
        state.update(load_file(str(path)))
    return state


@torch.no_grad()
def load_pretrained(model: WanExperts, path: str | Path) -> None:
    """Copy diffusers ``WanTransformer3DModel`` weights from a local directory into ``model``.

    Tensor by tensor, and only the rows this rank holds: an FSDP2-sharded model (built on the
    meta device, then ``to_empty``) loads its shards without ever materialising a full copy. LoRA
    adapters (``loongforge.core.lora``) are left as they are.
    """
    for name, directory in transformer_dirs(path, model.names).items():
        check_config(model.config, directory)
        copy_diffusers_weights(model.expert(name), directory)


@torch.no_grad()
def copy_diffusers_weights(module: torch.nn.Module, directory: Path, ignored=IGNORED_KEYS) -> None:
    """Copy the weights of the diffusers model directory ``directory`` into ``module``, whose
    parameters have the diffusers names: tensor by tensor, only the rows this rank holds, LoRA
    adapters left as they are; the layouts are checked first. Checkpoint keys matching ``ignored``
    (patterns) are skipped, as the diffusers class skips them on load."""
    from safetensors import safe_open

    handles = [safe_open(str(p), framework="pt") for p in weight_files(directory)]
    where = {key: h for h in handles for key in h.keys()}
    theirs = {key: tuple(where[key].get_slice(key).get_shape()) for key in kept_keys(where, ignored)}
    ours = strip_adapters(module.state_dict())  # a LoRA model's adapters are not the checkpoint's
    check_layout(shapes_of(ours), theirs, str(directory))
    for key, target in ours.items():
        offset, shape = region(target)
        if shape and shape[0] == 0:
            continue
        rows = slice(offset[0], offset[0] + shape[0]) if shape else ()
        value = where[key].get_slice(key)[rows] if shape else where[key].get_tensor(key)
        local(target).copy_(value.to(local(target).dtype))


@torch.no_grad()
def export_diffusers(state: dict[str, torch.Tensor], cfg: WanConfig, out_dir: str | Path,
                     dtype: torch.dtype | None = None) -> list[Path]:
    """Write ``WanExperts`` weights (``transformer.*`` / ``transformer_2.*`` keys) as diffusers
    ``WanTransformer3DModel`` directories (every tensor cast to ``dtype`` when given); returns them."""
    from diffusers import WanTransformer3DModel

    out = Path(out_dir)
    names = [n for n in ("transformer", "transformer_2") if any(k.startswith(n + ".") for k in state)]
    if not names:
        raise ValueError("no transformer.* weights to export")
    written = []
    for name in names:
        prefix = name + "."
        weights = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
        reference = WanTransformer3DModel(**cfg.diffusers_kwargs())
        check_layout(shapes_of(reference.state_dict()), shapes_of(weights), f"export of {name}")
        reference.load_state_dict(weights, strict=True)
        if dtype is not None:
            reference.to(dtype)
        directory = out / name if cfg.boundary_ratio is not None else out
        reference.save_pretrained(str(directory))
        written.append(directory)
    if cfg.boundary_ratio is not None:
        (out / "boundary.json").write_text(json.dumps({"boundary_ratio": cfg.boundary_ratio}) + "\n")
    return written

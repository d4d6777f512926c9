"""diffusers <-> LoongForge weights for Qwen-Image (the ``qwen_image`` family's diffusers adapter).

The mapping is the identity: ``QwenImageTransformer`` has ``QwenImageTransformer2DModel``'s
parameter names and shapes; layouts are checked both ways before any copy
(``loongforge.diffusion.model.convert``). ``model.pretrained`` is a transformer directory or a
``QwenImagePipeline`` directory with ``transformer/``; the export writes one transformer directory.
"""

from __future__ import annotations

from pathlib import Path

import torch

from loongforge.diffusion.model.convert import check_layout, copy_diffusers_weights, read_diffusers_config, shapes_of
from loongforge.diffusion.qwen_image.config import QwenImageConfig


def transformer_dir(path: str | Path) -> Path:
    """The diffusers transformer directory at ``path`` (itself or its pipeline's ``transformer/``)."""
    root = Path(path).expanduser()
    if not root.is_dir():
        raise FileNotFoundError(f"model.pretrained={str(path)!r}: not a directory")
    for directory in (root, root / "transformer"):
        if (directory / "config.json").is_file():
            return directory
    raise FileNotFoundError(f"model.pretrained={str(path)!r}: no config.json or transformer/config.json "
                            f"(a diffusers QwenImageTransformer2DModel or QwenImagePipeline directory expected)")


def pretrained_architecture(path: str | Path) -> tuple[dict, Path]:
    """``model.pretrained=DIR``: the architecture keys of the transformer in DIR and the config.json read."""
    source = transformer_dir(path) / "config.json"
    cfg = QwenImageConfig.from_diffusers(read_diffusers_config(source.parent), source=str(source))
    arch = {k: getattr(cfg, k) for k in cfg.diffusers_kwargs()}
    arch["axes_dims_rope"] = list(cfg.axes_dims_rope)
    return arch, source


def check_config(cfg: QwenImageConfig, directory: Path) -> None:
    theirs = QwenImageConfig.from_diffusers(read_diffusers_config(directory), source=str(directory / "config.json"))
    for key, value in cfg.diffusers_kwargs().items():
        if value != theirs.diffusers_kwargs()[key]:
            raise ValueError(f"{directory / 'config.json'}: {key}={theirs.diffusers_kwargs()[key]!r} but "
                             f"model.{key}={value!r}")


@torch.no_grad()
def load_pretrained(model, path: str | Path) -> None:
    """Copy diffusers ``QwenImageTransformer2DModel`` weights into ``model`` (sharded models load
    their own rows; LoRA adapters are left as they are)."""
    directory = transformer_dir(path)
    check_config(model.config, directory)
    copy_diffusers_weights(model, directory, ignored=())


@torch.no_grad()
def export_diffusers(state: dict[str, torch.Tensor], cfg: QwenImageConfig, out_dir: str | Path,
                     dtype: torch.dtype | None = None) -> list[Path]:
    """Write the model's weights (its own keys, which are diffusers') as a diffusers
    ``QwenImageTransformer2DModel`` directory (cast to ``dtype`` when given); returns it."""
    from diffusers import QwenImageTransformer2DModel

    weights = dict(state)
    reference = QwenImageTransformer2DModel(**cfg.diffusers_kwargs())
    check_layout(shapes_of(reference.state_dict()), shapes_of(weights), "export of the transformer")
    reference.load_state_dict(weights, strict=True)
    if dtype is not None:
        reference.to(dtype)
    out = Path(out_dir)
    reference.save_pretrained(str(out))
    return [out]

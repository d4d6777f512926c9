"""Which ``lf-*`` command a checkpoint belongs to: the one of the package that registers its model
family (the manifest's ``family``), found from the ``loongforge.models`` entry points without
importing that package.

A command that reads checkpoints of its own modality (``lf-diffusion sample``, ``convert
lf-to-diffusers``, ``lf-embodied convert lf-to-lerobot``, ``eval``, ``lf-llm convert lf-to-hf``...)
refuses another modality's with one line that names the command it is for
(``check_checkpoint_command``), instead of failing on the first config key the two do not share.
"""

from __future__ import annotations

from importlib.metadata import entry_points
from pathlib import Path

from loongforge.core.checkpoint import CheckpointReadError
from loongforge.core.models import ENTRY_POINT_GROUP


def family_command(family: str) -> str | None:
    """The console script (``lf-llm``) of the installed package registering model family
    ``family``, or None when no installed package registers it."""
    for ep in entry_points(group=ENTRY_POINT_GROUP, name=family):
        dist = ep.dist
        if dist is None:
            return None
        scripts = sorted(e.name for e in dist.entry_points if e.group == "console_scripts")
        return scripts[0] if scripts else dist.name
    return None


def check_checkpoint_command(manifest: dict, command: str, where: str | Path) -> None:
    """Refuse (``CheckpointReadError``) a checkpoint at ``where`` whose family belongs to another
    command than ``command``. A manifest without a family is left to the reader's own checks."""
    family = manifest.get("family")
    if not family:
        return
    owner = family_command(str(family))
    if owner == command:
        return
    what = (f"an {owner} checkpoint (model family {family!r})" if owner
            else f"a checkpoint of model family {family!r}, which no installed package registers")
    use = f"; use `{owner}` for it" if owner else ""
    raise CheckpointReadError(f"{where}: {what}, not one of {command}'s{use}")

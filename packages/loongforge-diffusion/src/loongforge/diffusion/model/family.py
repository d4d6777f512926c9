"""What a diffusion family's ``model`` config tells the shared flow-matching task, and how
``model.family`` finds that config class.

Every DiT ``lf-diffusion`` trains is a ``loongforge.models`` entry point whose ``ModelSpec`` has a
``DiTConfig`` subclass as its ``config_class``: the ``model`` section of a run is validated by the
class its ``family`` names. The spec's ``build(model_config)`` returns a ``TorchModel`` whose
parts (``part_names``) each take a ``loongforge.diffusion.packing.PackedBatch`` (and the
context-parallel group, or None) and return the velocity of every token in ``patchify_output``
order ``(pt, ph, pw, C)``. Its ``hf_adapter`` (``DiffusersAdapter``) reads and writes the
diffusers layout.

The properties ``condition``, ``image_dim``, ``boundary_ratio`` and ``train_expert`` are the neutral
answers of a family without image conditioning or experts; a family that has them declares them as
fields.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, ClassVar, Protocol

from loongforge.core.balance import CostModel

DEFAULT_FAMILY = "wan"


@dataclass
class DiTConfig:
    family: str = DEFAULT_FAMILY  # the registered diffusion family (loongforge.models)
    # a local diffusers directory of the family's transformer (or a pipeline with transformer/) to
    # start from; None: random init
    pretrained: str | None = None
    # prompt embeddings are zero-padded to this many tokens (the pipeline's max_sequence_length)
    text_len: int = 16

    # what the family's class says of itself
    context_parallel: ClassVar[bool] = False  # the model implements parallel.cp > 1 (Ulysses)
    diffusers_class: ClassVar[str] = "transformer"  # the diffusers model class of its layout, for messages
    compile_on_cuda: ClassVar[bool] = False  # train.compile=null compiles its blocks on CUDA (verified there)

    # neutral answers of a text-to-image/video family with one part (fields in families that have them)
    @property
    def condition(self) -> str:
        """How samples are conditioned on an image: none (a family with image conditioning has the field)."""
        return "none"

    @property
    def image_dim(self) -> int | None:
        """Width of CLIP image tokens the model reads: none here."""
        return None

    @property
    def boundary_ratio(self) -> float | None:
        """The timestep boundary between two experts: none here (one part)."""
        return None

    @property
    def train_expert(self) -> str:
        """Which expert(s) train: all (its one part)."""
        return "all"

    @property
    def patch(self) -> tuple[int, int, int]:
        """The (t, h, w) patch of the packed tokens."""
        raise NotImplementedError(f"{type(self).__name__}: a DiTConfig says its patch")

    @property
    def latent_channels(self) -> int:
        """Channels of the VAE latents the model denoises (a dataset's ``latent_channels``)."""
        raise NotImplementedError(f"{type(self).__name__}: a DiTConfig says its latent channels")

    @property
    def text_width(self) -> int:
        """Width of the prompt embeddings it reads (a dataset's ``text_dim``)."""
        raise NotImplementedError(f"{type(self).__name__}: a DiTConfig says its prompt width")

    @property
    def mask_channels(self) -> int:
        return 0

    @property
    def patch_volume(self) -> int:
        pt, ph, pw = self.patch
        return pt * ph * pw

    def part_names(self) -> list[str]:
        """Names of the model's parts (``TorchModel.parts``), the first trained when there is one."""
        return ["model"]

    def cost_model(self) -> CostModel:
        """Training FLOPs of one sample of ``l`` tokens, ``a l^2 + b l + c``: the balancer's cost and MFU."""
        raise NotImplementedError(f"{type(self).__name__}: a DiTConfig gives its FLOPs model")

    def model_config_dict(self) -> dict:
        """The architecture, recorded in manifests and checked on resume."""
        return {k: v for k, v in asdict(self).items() if k != "pretrained"}

    def describe(self) -> str:
        return f"{self.family} DiT"

    def check_device(self, device_type: str) -> None:
        """Settings the device cannot run, as a ``ValueError`` (called before any process group)."""

    def check_recipe(self, recipe) -> None:
        """Checks of the model against the rest of the run config (``DiffusionRecipe``)."""
        if recipe.parallel.cp > 1 and not self.context_parallel:
            raise ValueError(f"parallel.cp={recipe.parallel.cp}: the {self.family!r} family does not implement "
                             f"context parallelism")
        if recipe.sample.image is not None and self.condition == "none":
            raise ValueError(f"sample.image={recipe.sample.image!r} needs an image-conditioned model "
                             f"(this {self.family!r} model is text-to-image/video)")


class DiffusersAdapter(Protocol):
    """A family's ``ModelSpec.hf_adapter``: its model to and from diffusers' layout."""

    def pretrained_architecture(self, path: str | Path) -> tuple[dict, Path]:
        """``model.pretrained=DIR``: the architecture keys of the model in DIR and the file read."""

    def load_pretrained(self, model: Any, path: str | Path) -> None:
        """Fill ``model`` from the diffusers directory ``path``."""

    def export_diffusers(self, state: dict, cfg: DiTConfig, out_dir: str | Path, dtype=None) -> list[Path]:
        """Write the model's weights (``state``: the model's own keys) as diffusers directories."""


def model_config_class(family: str) -> type[DiTConfig]:
    """The ``DiTConfig`` subclass the family ``family`` registers (a config error otherwise)."""
    from loongforge.core.config import ConfigError
    from loongforge.core.models import ModelRegistryError, get_model_spec

    try:
        config_class = get_model_spec(family).config_class
    except ModelRegistryError as exc:
        raise ConfigError(f"model.family={family!r}: {exc}") from exc
    if not (isinstance(config_class, type) and issubclass(config_class, DiTConfig)):
        raise ConfigError(f"model.family={family!r} is not a diffusion model (its config is {config_class.__name__})")
    return config_class


def diffusers_adapter(family: str) -> DiffusersAdapter:
    """The family's diffusers adapter (its ``ModelSpec.hf_adapter``)."""
    from loongforge.core.models import get_model_spec

    adapter = get_model_spec(family).hf_adapter
    if adapter is None:
        from loongforge.core.config import ConfigError

        raise ConfigError(f"model.family={family!r} registers no diffusers adapter (model.pretrained, "
                          f"convert lf-to-diffusers)")
    return adapter

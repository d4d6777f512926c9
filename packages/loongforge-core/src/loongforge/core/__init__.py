"""LoongForge core runtime: what every modality shares, and what a downstream tool may depend on alone.

Its public modules (importing this package imports none of them, nor torch):

- ``loongforge.core.parallel``: the process groups of one layout (``init_parallel``, ``ParallelLayout``)
- ``loongforge.core.balance``: the DP load balancer (a plain function over sample lengths)
- ``loongforge.core.checkpoint``: the layout-independent checkpoint format
- ``loongforge.core.config``: YAML composition validated into dataclasses (``load_config``)
- ``loongforge.core.models``: the model-family registry (``ModelSpec``, ``get_model_spec``)
- ``loongforge.core.accelerators``: the accelerator plugins (``get_accelerator``)
- ``loongforge.core.hub``: Hugging Face Hub ids where a config takes a path
- ``loongforge.core.errors``: the error contract of the ``lf-*`` commands (``UserError``)
- ``loongforge.core.cli``: the one CLI builder every ``lf-*`` command uses
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("loongforge-core")
except PackageNotFoundError:  # a source tree that is not installed
    __version__ = "0+unknown"

__all__ = ["__version__"]

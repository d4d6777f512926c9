"""LoongForge LLM training.

The names of ``loongforge.llm.api``, the package's public API, are attributes of this package
too (``from loongforge.llm import GPTConfig``), looked up on first use.
"""

from loongforge.llm import api


def __getattr__(name: str):
    if name in api.__all__:
        return getattr(api, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *api.__all__})

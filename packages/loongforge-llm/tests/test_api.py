"""The public API (``loongforge.llm.api``, re-exported by ``loongforge.llm``): every name is the
object of the module that defines it, and importing the package stays cheap."""

import importlib
import subprocess
import sys

import pytest

import loongforge.llm
from loongforge.llm import api


def test_every_name_is_the_defining_modules_object():
    assert api.__all__ and sorted(api.__all__) == sorted(api._EXPORTS)
    for name, (module, attribute, line) in api._EXPORTS.items():
        defined = getattr(importlib.import_module(module), attribute)
        assert getattr(api, name) is defined and getattr(loongforge.llm, name) is defined, name
        assert line and "\n" not in line and f"``{name}``" in api.__doc__, name
    assert set(api.__all__) <= set(dir(loongforge.llm))


def test_unknown_names_and_submodules():
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        loongforge.llm.nothing
    with pytest.raises(ImportError):
        from loongforge.llm.api import nothing  # noqa: F401
    from loongforge.llm import shipped_configs  # a submodule still imports as one

    assert api.CONFIG_DIR == shipped_configs.CONFIG_DIR and (api.CONFIG_DIR / "model" / "qwen2_debug.yaml").is_file()


def test_importing_the_package_imports_no_framework():
    code = ("import sys, loongforge.llm, loongforge.llm.api\n"
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'megatron', 'transformers', 'numpy'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"

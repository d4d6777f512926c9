"""Where the YAML configs that ship inside the package are: recipes in ``configs/``, model
flavours in its ``model/`` config group (``configs/model/<name>.yaml``)."""

from __future__ import annotations

from pathlib import Path

CONFIG_DIR = Path(__file__).resolve().parent / "configs"
MODEL_CONFIG_DIR = CONFIG_DIR / "model"

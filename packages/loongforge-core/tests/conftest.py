"""The loongforge-core tests (helpers live in core_helpers.py)."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # core_helpers

"""The parser tests share one harness, ``parse_runs.py`` beside this file: the suite imports test
files with ``--import-mode=importlib`` (no folder on ``sys.path``), so this folder is put there."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

"""bench/torchft_diloco.py: our DiLoCo against torchft's, when torchft is installed (it is not a dependency).

Without torchft the script must say so in one line and exit 2 (CI's case); with it (a venv of its own, see
docs/local-updates.md) the two must agree after every sync.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "torchft_diloco.py"


def test_torchft_comparison_matches_or_says_torchft_is_missing():
    result = subprocess.run(
        [sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=300, check=False
    )
    if importlib.util.find_spec("torchft") is None:
        assert result.returncode == 2, result.stderr
        lines = (result.stdout + result.stderr).strip().splitlines()
        assert lines == [
            "torchft_diloco: torchft is not importable (ModuleNotFoundError: No module named 'torchft')"
        ]
    else:
        assert result.returncode == 0, result.stdout + result.stderr
        assert "verdict: MATCH" in result.stdout

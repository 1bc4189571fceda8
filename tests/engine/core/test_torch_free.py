"""engine/core and engine/runtime are the torch-free half of the engine: what the daemon
process may import."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def test_every_core_module_imports_without_torch_or_numpy() -> None:
    code = """
import importlib, pkgutil, sys
import engine.core, engine.runtime
names = [m.name for m in pkgutil.walk_packages(engine.core.__path__, "engine.core.")]
names += [m.name for m in pkgutil.walk_packages(engine.runtime.__path__, "engine.runtime.")]
assert len(names) >= 12, names
for name in names:
    importlib.import_module(name)
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "numpy", "transformers"))
assert not heavy, heavy
print(len(names))
"""
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr

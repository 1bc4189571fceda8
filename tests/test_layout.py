"""The shape of the repository: which package may import which, and what the wheel holds.

The rules are those of docs/architecture.md ("Folder map"): engine/core is the bottom
layer, torch-free, and the only part of the engine the daemon imports; models, storage,
loading and executor build on it in that order; policy imports nothing of ours.
Lazy imports inside functions count too: a cycle is a cycle, however late it closes.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import tomllib
from setuptools import find_packages

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("server", "engine", "policy")

ALLOWED: dict[str, set[str]] = {
    "policy": set(),
    "engine.core": {"policy"},
    "engine.models": {"engine.core", "policy"},
    "engine.storage": {"engine.models", "engine.core", "policy"},
    "engine.loading": {"engine.models", "engine.core", "policy"},
    "engine.executor": {
        "engine.storage",
        "engine.models",
        "engine.loading",
        "engine.core",
        "policy",
    },
    "engine": {
        "engine.executor",
        "engine.storage",
        "engine.models",
        "engine.loading",
        "engine.core",
        "policy",
    },
    "server": {"engine.core", "policy"},
}
"""Layer -> the layers it may import besides itself (`engine` is its top-level modules)."""


def layer_of(module: str) -> str | None:
    """The layer a dotted module name belongs to (most specific first), or None if not ours."""
    parts = module.split(".")
    if parts[0] not in PACKAGES:
        return None
    if parts[0] == "engine" and len(parts) > 1 and (REPO / "engine" / parts[1]).is_dir():
        return ".".join(parts[:2])
    return parts[0]


def our_modules() -> list[tuple[str, Path]]:
    out = []
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            parts = path.relative_to(REPO).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            out.append((name, path))
    return out


def imported_names(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


@pytest.mark.parametrize("module,path", our_modules(), ids=[m for m, _ in our_modules()])
def test_imports_follow_the_layers(module: str, path: Path) -> None:
    own = layer_of(module)
    assert own is not None and own in ALLOWED, f"{module} is in no layer of ALLOWED"
    bad = set()
    for name in imported_names(path):
        layer = layer_of(name)
        if layer is not None and layer != own and layer not in ALLOWED[own]:
            bad.add(name)
    assert not bad, f"{module} ({own}) may not import {sorted(bad)}"


def test_the_wheel_finds_every_package_in_the_tree() -> None:
    """pyproject discovers packages by pattern; every folder holding Python must be one."""
    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    include = config["tool"]["setuptools"]["packages"]["find"]["include"]
    found = set(find_packages(where=str(REPO), include=include))
    folders = {
        ".".join(path.parent.relative_to(REPO).parts)
        for package in PACKAGES
        for path in (REPO / package).rglob("*.py")
    }
    assert folders <= found, f"not in the wheel (no __init__.py?): {sorted(folders - found)}"
    assert {p.split(".")[0] for p in found} == set(PACKAGES)


def test_every_test_folder_is_a_package() -> None:
    folders = {p.parent for p in (REPO / "tests").rglob("*.py")}
    missing = sorted(str(f.relative_to(REPO)) for f in folders if not (f / "__init__.py").is_file())
    assert not missing, f"test folders without __init__.py: {missing}"

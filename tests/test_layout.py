"""The shape of the repository: which package may import which, and what the wheel holds.

The rules are those of docs/architecture.md ("Folder map"): engine/core is the bottom
layer, torch-free; engine/runtime (torch-free too) runs an engine for the daemon, which
imports nothing else of the engine; models, storage, loading, executor and profiling build
on core in that order; inside server, openai is below batch, and batch below offline and
http; policy imports nothing of ours but base, which is below every layer and imports nothing
but the standard library. Lazy imports inside functions count too, and no
module may import itself through others (a cycle is a cycle, however late it closes).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest
import tomllib
from setuptools import find_packages

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("server", "engine", "policy", "base")

LAYERS: dict[str, set[str]] = {
    "base": set(),
    "policy": set(),
    "engine.core": {"policy"},
    "engine.kernels": set(),
    "engine.models": {"engine.kernels", "engine.core", "policy"},
    "engine.storage": {"engine.models", "engine.core", "policy"},
    "engine.loading": {"engine.models", "engine.core", "policy"},
    "engine.executor": {
        "engine.storage",
        "engine.models",
        "engine.kernels",
        "engine.loading",
        "engine.core",
        "policy",
    },
    "engine.profiling": {
        "engine.executor",
        "engine.storage",
        "engine.models",
        "engine.kernels",
        "engine.loading",
        "engine.core",
        "policy",
    },
    "engine": {
        "engine.profiling",
        "engine.executor",
        "engine.storage",
        "engine.models",
        "engine.kernels",
        "engine.loading",
        "engine.core",
        "policy",
    },
    "engine.runtime": {"engine.core", "policy"},
    "server.openai": {"engine.runtime", "engine.core", "policy"},
    "server.batch": {"server.openai", "engine.runtime", "engine.core", "policy"},
    "server.offline": {"server.batch", "server.openai", "engine.runtime", "engine.core", "policy"},
    "server.http": {"server.batch", "server.openai", "engine.runtime", "engine.core", "policy"},
    "server": {"policy"},
}
ALLOWED = {
    layer: allowed if layer == "base" else allowed | {"base"} for layer, allowed in LAYERS.items()
}
"""Layer -> the layers it may import besides itself (`engine` and `server` are their top-level
modules: `server.cli` finds each command's module by name, it imports none of them); every
layer but base may import base."""


def layer_of(module: str) -> str | None:
    """The layer a dotted module name belongs to (most specific first), or None if not ours."""
    parts = module.split(".")
    if parts[0] not in PACKAGES:
        return None
    if len(parts) > 1 and (REPO / parts[0] / parts[1]).is_dir():
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


@pytest.mark.parametrize(
    "module,path",
    [(m, p) for m, p in our_modules() if layer_of(m) == "base"],
    ids=[m for m, _ in our_modules() if layer_of(m) == "base"],
)
def test_base_imports_only_the_standard_library(module: str, path: Path) -> None:
    """base is below every layer: a module of it imports no package of ours nor any other
    (no torch, no numpy), so every process, the torch-free daemon included, may import it."""
    outside = {n for n in imported_names(path) if n.split(".")[0] not in sys.stdlib_module_names}
    assert not outside, f"{module} imports {sorted(outside)}"


SCALE_OUT = "server.offline.scale_out"
"""The only folder whose modules import ray (docs/scale-out.md)."""
SCALE_OUT_IMPORTERS = {"server.offline.run_batch"}
"""The modules outside it that may import it, inside a function (`run-batch --ray`)."""


def module_level_imports(path: Path) -> set[str]:
    """The names `path` imports when it is imported (not those inside functions)."""
    names: set[str] = set()
    tree = ast.parse(path.read_text())
    body = [n for n in tree.body if not isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]
    for node in (child for top in body for child in ast.walk(top)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def is_under(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


@pytest.mark.parametrize("module,path", our_modules(), ids=[m for m, _ in our_modules()])
def test_only_scale_out_imports_ray_and_only_run_batch_imports_it_lazily(
    module: str, path: Path
) -> None:
    """The daemon and the local paths never import ray: it is an optional dependency."""
    if is_under(module, SCALE_OUT):
        return
    names = imported_names(path)
    assert not any(is_under(n, "ray") for n in names), f"{module} imports ray"
    if module not in SCALE_OUT_IMPORTERS:
        assert not any(is_under(n, SCALE_OUT) for n in names), f"{module} imports {SCALE_OUT}"
    assert not any(is_under(n, SCALE_OUT) for n in module_level_imports(path)), (
        f"{module} imports {SCALE_OUT} when it is imported; import it inside the function "
        "that needs it"
    )


def module_graph() -> dict[str, set[str]]:
    """Our module -> the modules of ours it imports (lazily, or for type checking only, too;
    `from package import module` is an edge to the module)."""
    modules = {name for name, _ in our_modules()}
    graph: dict[str, set[str]] = {}
    for module, path in our_modules():
        targets = set()
        for name in imported_names(path):
            while name and name not in modules:  # 'a.b.func' -> 'a.b'
                name = name.rpartition(".")[0]
            if name and name != module:
                targets.add(name)
        graph[module] = targets
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return cycles


def test_no_module_imports_itself_through_others() -> None:
    """No import cycle anywhere, between layers or inside one: a module that needs another's
    record and is needed by it means the record belongs in a third module, or in one of them."""
    cycles = import_cycles(module_graph())
    assert not cycles, f"import cycles: {cycles}"


def test_the_cycle_finder_finds_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert import_cycles(graph) == [["a", "b", "c"]]


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

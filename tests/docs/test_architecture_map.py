"""docs/architecture.md names every module of base/, engine/, server/, policy/ and bench/.

A package is named by its folder (`engine/core/`) or its dotted name; a module by its path
(`engine/core/sequence.py`), its dotted name (`engine.core.sequence`), or its file name in
backticks (`sequence.py`) in a table row or paragraph that also names its folder (the folder
map's rows, the module index's items). A new module fails this test until the map names it:
the message lists every missing one.
"""

from __future__ import annotations

import re
from pathlib import Path

from tests.docs.doc_examples import ROOT

LAYERS = ("base", "engine", "server", "policy", "bench")
DOC = ROOT / "docs" / "architecture.md"


def modules() -> list[Path]:
    """Every package folder and module file of the layers, relative to the repository."""
    found = []
    for layer in LAYERS:
        for path in sorted((ROOT / layer).rglob("*")):
            relative = path.relative_to(ROOT)
            if "__pycache__" in relative.parts or "results" in relative.parts:
                continue
            is_package = path.is_dir() and (path / "__init__.py").is_file()
            is_module = path.suffix == ".py" and path.name not in ("__init__.py", "__main__.py")
            if is_package or is_module:
                found.append(relative)
    return found


def blocks(text: str) -> list[str]:
    """The doc cut into table rows, list items and paragraphs."""
    out: list[str] = []
    current: list[str] = []
    for line in text.splitlines():
        starts = not line.strip() or line.startswith(("|", "- ", "#"))
        if starts and current:
            out.append("\n".join(current))
            current = []
        if line.strip():
            current.append(line)
    return [*out, "\n".join(current)]


def is_named(module: Path, text: str, chunks: list[str]) -> bool:
    dotted = ".".join(module.with_suffix("").parts)
    if module.suffix != ".py":  # a package
        return f"{module}/" in text or re.search(rf"\b{re.escape(dotted)}\b", text) is not None
    if str(module) in text or re.search(rf"\b{re.escape(dotted)}\b", text):
        return True
    folder = f"{module.parent}/"
    return any(f"`{module.name}`" in chunk and folder in chunk for chunk in chunks)


def test_every_module_is_named_in_the_architecture_map() -> None:
    text = DOC.read_text()
    chunks = blocks(text)
    missing = [str(m) for m in modules() if not is_named(m, text, chunks)]
    assert not missing, (
        f"docs/architecture.md does not name {len(missing)} module(s); add each to the folder "
        f"map or the module index: {', '.join(missing)}"
    )


def test_a_module_named_only_in_another_folder_is_missing() -> None:
    chunks = blocks("- `engine/core/`: `sequence.py` (requests)\n- `server/http/`: `app.py`\n")
    text = "\n".join(chunks)
    assert is_named(Path("engine/core/sequence.py"), text, chunks)
    assert not is_named(Path("server/http/sequence.py"), text, chunks)
    assert not is_named(Path("engine/core/app.py"), text, chunks)

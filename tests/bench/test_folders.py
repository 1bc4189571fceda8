"""bench/ keeps its scripts in folders by purpose (bench/README.md): at its top only the shared
helpers and the folders, at most twelve entries (scripts, shell files and folders; `__init__.py`,
README.md and results/ aside), and every folder a package."""

from __future__ import annotations

from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"
ASIDE = {"__init__.py", "README.md", "results", "__pycache__"}


def test_the_top_of_bench_holds_at_most_twelve_entries() -> None:
    entries = sorted(p.name for p in BENCH.iterdir() if p.name not in ASIDE)
    assert len(entries) <= 12, f"bench/ has {len(entries)} entries at its top: {entries}"


def test_every_folder_is_a_package() -> None:
    folders = [p for p in BENCH.iterdir() if p.is_dir() and p.name not in ASIDE]
    assert folders, "bench/ has no folders"
    assert all((p / "__init__.py").is_file() for p in folders), folders

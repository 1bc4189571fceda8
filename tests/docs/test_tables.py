"""The docs' figure tables are what `python -m bench.tables` generates from bench/results."""

from __future__ import annotations

from pathlib import Path

from bench.tables import stale, write
from tests.docs.doc_examples import docs


def test_every_table_is_what_its_results_file_generates() -> None:
    differ = {str(path.name): stale(path) for path in docs()}
    assert not any(differ.values()), (
        f"run `python -m bench.tables --write`: { ({k: v for k, v in differ.items() if v}) }"
    )


def test_a_hand_edited_figure_is_caught_and_rewritten(tmp_path: Path) -> None:
    source = "bench/results/bf16-agreement-cpu.json"
    doc = tmp_path / "doc.md"
    doc.write_text(
        f"Before.\n\n<!-- source: {source} -->\n"
        "| positions | argmax agrees | margin |\n| ---: | ---: | ---: |\n| 1 | 2 | 3 |\n\nAfter.\n"
    )
    assert stale(doc) == [source]
    assert write(doc) == [source]
    assert stale(doc) == []
    text = doc.read_text()
    assert "| ---: | ---: | ---: |" in text  # the alignment kept
    assert text.startswith("Before.") and text.endswith("After.\n")

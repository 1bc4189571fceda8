"""`bench.features.page_images`: its pages are seeded, its Batch API lines carry each page and
the schema, and (slow: a daemon and transformers) the whole script runs on one page."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest

from bench.features.page_images import SCHEMA, job_lines, main, valid
from bench.features.pages import render_pages


def test_pages_are_seeded_and_every_line_carries_its_page(tmp_path: Path) -> None:
    first = render_pages(tmp_path / "a", 4, seed=3)
    again = render_pages(tmp_path / "b", 4, seed=3)
    other = render_pages(tmp_path / "c", 4, seed=4)
    assert [p.name for p in first][:3] == [
        "page-000-letter.png",
        "page-001-table.png",
        "page-002-receipt.png",
    ]
    assert [p.read_bytes() for p in first] == [p.read_bytes() for p in again]
    assert first[0].read_bytes() != other[0].read_bytes()
    lines = [json.loads(line) for line in job_lines(first, "m", 32).splitlines()]
    assert [line["custom_id"] for line in lines] == [p.stem for p in first]
    for line, page in zip(lines, first, strict=True):
        image, _ = line["body"]["messages"][0]["content"]
        data = image["image_url"]["url"].removeprefix("data:image/png;base64,")
        assert base64.b64decode(data) == page.read_bytes()
        assert line["body"]["response_format"]["json_schema"]["schema"] == SCHEMA
    assert valid('{"kind":"table","title":"x","total":3}')
    assert not valid('{"kind":"memo","title":"x","total":3}') and not valid('{"kind":')


@pytest.mark.slow
def test_the_script_runs_one_page(tmp_path: Path) -> None:
    """A daemon on the tiny checkpoint and transformers agree on a page, within the schema."""
    out = tmp_path / "page-images.json"
    assert main(["--pages", "1", "--max-tokens", "96", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["results"]
    assert [row["system"] for row in rows] == ["nanoflex, Batch API", "transformers generate"]
    assert all(row["valid"] == 1 and row["same_as_transformers"] == 1 for row in rows)

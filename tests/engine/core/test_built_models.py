"""A built reference (the demo model, a GGUF file) whose directory is complete in the cache is
found without its builder (the daemon's builder is a child process that imports torch:
seconds at every start)."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.core.gguf_cache import MANIFEST, file_digest
from engine.core.model_files import DEMO_DIR_NAME, DEMO_MODEL, resolve_model_dir


def test_the_built_demo_model_is_found_without_its_builder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NANOFLEX_CACHE", str(tmp_path))
    builds: list[str] = []

    def build(model: str) -> Path:  # what engine.loading does for the demo: publish config.json
        builds.append(model)
        final = tmp_path / DEMO_DIR_NAME
        final.mkdir()
        (final / "config.json").write_text("{}")
        return final

    first = resolve_model_dir(DEMO_MODEL, build=build)
    assert builds == [DEMO_MODEL]  # an empty cache: built
    assert resolve_model_dir(DEMO_MODEL, build=build) == first
    assert builds == [DEMO_MODEL]  # complete: found, not built again


def test_a_half_built_demo_directory_goes_to_the_builder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NANOFLEX_CACHE", str(tmp_path))
    (tmp_path / DEMO_DIR_NAME).mkdir()  # no config.json: not published
    built = tmp_path / "built"
    assert resolve_model_dir(DEMO_MODEL, build=lambda model: built) == built


def test_a_converted_gguf_file_is_found_without_its_builder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cache entry is keyed by the file's content (a copy under another name finds it)."""
    monkeypatch.setenv("NANOFLEX_CACHE", str(tmp_path / "cache"))
    checkpoint = tmp_path / "Tiny-Q4.gguf"
    checkpoint.write_bytes(b"GGUF" + bytes(range(256)))
    builds: list[str] = []

    def build(model: str) -> Path:  # what the converter publishes, MANIFEST last
        builds.append(model)
        final = tmp_path / "cache" / "gguf" / f"tiny-q4-{file_digest(Path(model))[:16]}"
        final.mkdir(parents=True)
        (final / MANIFEST).write_text("{}")
        return final

    converted = resolve_model_dir(str(checkpoint), build=build)
    assert builds == [str(checkpoint)]
    copy = tmp_path / "copy.gguf"
    copy.write_bytes(checkpoint.read_bytes())
    assert resolve_model_dir(str(checkpoint), build=build) == converted
    assert resolve_model_dir(str(copy), build=build) == converted
    assert builds == [str(checkpoint)]

"""A model reference that can only be a local path is refused as "no such directory" at
once, before any hub lookup; one that looks like a hub id is asked about once, without the
hub client's retries (issue 12, item 7)."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import huggingface_hub
import pytest

from engine.core import model_files
from engine.core.model_files import ModelLoadError, looks_local, resolve_model_dir


@pytest.fixture
def hub_calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, dict[str, Any]]]:
    """(function, keyword arguments) of every call to the hub client, which still runs."""
    calls: list[tuple[str, dict[str, Any]]] = []
    for name in ("model_info", "snapshot_download"):
        real = getattr(huggingface_hub, name)

        def spy(*args: Any, _name: str = name, _real: Any = real, **kwargs: Any) -> Any:
            calls.append((_name, kwargs))
            return _real(*args, **kwargs)

        monkeypatch.setattr(huggingface_hub, name, spy)
    return calls


@pytest.mark.parametrize(
    "model",
    ["./modles/smollm", "/no/such/model", "~/no-such-model", "a/b/c", "bad name!", "x--y"],
)
def test_a_mistyped_local_path_is_no_such_directory(
    model: str, hub_calls: list[tuple[str, dict[str, Any]]]
) -> None:
    assert looks_local(model)
    with pytest.raises(ModelLoadError, match="no such directory") as caught:
        resolve_model_dir(model)
    assert "hub" not in str(caught.value)
    assert hub_calls == []  # the hub is never asked


def test_a_path_under_an_existing_folder_is_local(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "models").mkdir()
    monkeypatch.chdir(tmp_path)
    assert looks_local("models/smollm")
    with pytest.raises(ModelLoadError, match="no such directory: 'models/smollm'"):
        resolve_model_dir("models/smollm")
    assert not looks_local("someone/some-model")  # no `someone/` here: a hub id


def test_a_hub_id_that_cannot_be_served_fails_once_without_retries(
    tmp_path: Path, hub_calls: list[tuple[str, dict[str, Any]]]
) -> None:
    """Offline (as in CI) the hub cannot be reached; online the repository does not exist:
    either way the local cache, one bounded question, then the error (the download path,
    with huggingface_hub's retries, took 25 s)."""
    with (
        pytest.raises(ModelLoadError, match="no such directory") as caught,
        contextlib.chdir(tmp_path),
    ):
        resolve_model_dir("nanoflex-tests/no-such-model-7f3a")
    assert "Hugging Face hub" in str(caught.value)
    assert hub_calls == [
        ("snapshot_download", {"local_files_only": True}),
        ("model_info", {"timeout": model_files._HUB_TIMEOUT_S}),
    ]


def test_default_dtype_is_bfloat16_only_for_half_checkpoints_on_bf16_cpus(monkeypatch) -> None:
    """As vLLM's CPU backend: a half checkpoint computes in bfloat16 where the CPU has
    bfloat16 dot products; a float32 checkpoint, or a CPU without them, stays float32."""
    from policy import dtypes  # the rule engine/core/dtypes.py re-exports

    monkeypatch.setattr(dtypes, "cpu_has_native_bf16", lambda: True)
    assert dtypes.default_dtype("cpu", "bfloat16") == "bfloat16"
    assert dtypes.default_dtype("cpu", "float16") == "bfloat16"
    assert dtypes.default_dtype("cpu", "float32") == "float32"
    assert dtypes.default_dtype("cpu", None) == "float32"
    monkeypatch.setattr(dtypes, "cpu_has_native_bf16", lambda: False)
    assert dtypes.default_dtype("cpu", "bfloat16") == "float32"
    assert dtypes.default_dtype("cuda", "bfloat16") == "bfloat16"
    assert dtypes.default_dtype("cuda", "float32") == "float16"


def test_this_cpus_bf16_flag_is_read_from_cpuinfo() -> None:
    from pathlib import Path

    from engine.core.dtypes import cpu_has_native_bf16

    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.is_file():
        pytest.skip("no /proc/cpuinfo on this system")
    flags = next(
        (
            line.split(":", 1)[1].split()
            for line in cpuinfo.read_text().splitlines()
            if line.split(":")[0].strip() in ("flags", "Features")
        ),
        [],
    )
    assert cpu_has_native_bf16() == bool({"avx512_bf16", "amx_bf16", "bf16"} & set(flags))

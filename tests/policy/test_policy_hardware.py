"""HardwareSpec JSON, cache location and derived constants."""

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import pytest

from base.errors import UserError
from policy.hardware import (
    FLEXGEN_T4,
    REQUIRED_KEYS,
    HardwareSpec,
    default_cache_path,
    load_cached,
)

MINIMAL: dict[str, Any] = {
    "gpu_mem_bytes": 16 * 2**30,
    "cpu_mem_bytes": 64 * 2**30,
    "disk_mem_bytes": 2**40,
    "ctog_bw": 12e9,
    "gtoc_bw": 12e9,
    "dtoc_bw": 2e9,
    "ctod_bw": 1e9,
    "gpu_flops": 50e12,
    "gpu_bmm_flops": 20e12,
    "cpu_flops": 1e12,
}


DOCS = Path(__file__).resolve().parents[2] / "docs" / "policy.md"


def documented_required_keys() -> set[str]:
    """The keys in the first column of docs/policy.md's table of required profile keys."""
    lines = DOCS.read_text().splitlines()
    start = lines.index("**Hardware.** The profile JSON has these required keys:")
    keys: set[str] = set()
    for line in lines[start + 4 :]:
        if not line.startswith("|"):
            break
        keys.update(re.findall(r"`(\w+)`", line.split("|")[1]))
    return keys


def test_required_keys_are_exactly_the_documented_ones() -> None:
    """The loader's required keys are those docs/policy.md lists, no more and no fewer."""
    assert set(REQUIRED_KEYS) == documented_required_keys()
    for key in REQUIRED_KEYS:  # and each one really is required
        with pytest.raises(UserError, match=key):
            HardwareSpec.from_dict({k: v for k, v in MINIMAL.items() if k != key})


def test_file_with_only_required_keys_loads(tmp_path: Path) -> None:
    path = tmp_path / "hw.json"
    path.write_text(json.dumps(MINIMAL))
    spec = HardwareSpec.load(path)
    assert spec.ctog_bw == 12e9 and spec.num_cpu_cores == 0 and spec.compute_device == "cuda"
    assert spec.gpu_mem_bw_estimate > 0 and spec.dequant_throughput_estimate(2) > 0


def test_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "hardware.json"
    FLEXGEN_T4.save(path)
    assert HardwareSpec.load(path) == FLEXGEN_T4
    assert HardwareSpec.from_json(FLEXGEN_T4.to_json()) == FLEXGEN_T4


def test_saves_at_once_each_write_a_whole_file(tmp_path: Path) -> None:
    """Writers saving one profile at once (the test workers, each at its start) all succeed
    and leave it whole: each writes a temporary file of its own (one shared name before: a
    writer's rename found its file gone and raised)."""
    from concurrent.futures import ThreadPoolExecutor

    path = tmp_path / "hardware.json"

    def save_often(_: int) -> None:
        for _ in range(100):
            FLEXGEN_T4.save(path)

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(save_often, range(4)))
    assert HardwareSpec.load(path) == FLEXGEN_T4
    assert [p.name for p in tmp_path.iterdir()] == ["hardware.json"]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"ctog_bw": None}, "lacks ctog_bw"),
        ({"typo_bw": 1.0}, "unknown hardware field"),
        ({"gpu_flops": -1.0}, "gpu_flops"),
        ({"compute_device": "tpu"}, "compute_device"),
    ],
)
def test_bad_profiles_are_user_errors(change: dict[str, object], message: str) -> None:
    data: dict[str, object] = {**MINIMAL, **change}
    data = {k: v for k, v in data.items() if v is not None}
    with pytest.raises(UserError, match=message):
        HardwareSpec.from_dict(data)


def test_cache_path_and_missing_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("NANOFLEX_CACHE", str(tmp_path))
    assert default_cache_path() == tmp_path / "hardware.json"
    with pytest.raises(UserError, match="nanoflex profile"):
        load_cached()
    FLEXGEN_T4.save(default_cache_path())
    assert load_cached() == FLEXGEN_T4
    monkeypatch.delenv("NANOFLEX_CACHE")
    assert default_cache_path() == Path.home() / ".cache" / "nanoflex" / "hardware.json"


def test_cpu_attention_throughput_table_interpolates_and_saturates() -> None:
    spec = HardwareSpec(**MINIMAL, cpu_attention_throughput=((8, 8e9), (1, 1e9)))
    assert spec.cpu_attention_throughput == ((1, 1e9), (8, 8e9))  # sorted
    assert spec.cpu_attention_bw(4, 1.0) == pytest.approx(4e9)
    assert spec.cpu_attention_bw(32, 1.0) == pytest.approx(8e9)
    derived = HardwareSpec(**MINIMAL, num_cpu_cores=32)
    assert derived.cpu_attention_bw(16, 1.0) == derived.cpu_attention_bw(8, 1.0)
    assert derived.cpu_attention_bw(4, 1.0) < derived.cpu_attention_bw(8, 1.0)


def test_a_profile_from_another_machine_is_stale_a_noisy_one_is_noisy() -> None:
    here = "cpu=AMD EPYC; cores=2; mem=23GiB; gpu=none; torch=2.13.0+cpu"
    quiet = HardwareSpec(**MINIMAL, machine=here, spread={"gpu_flops": 0.05})
    assert quiet.staleness(here) is None
    other = quiet.staleness(here.replace("cores=2", "cores=64"))
    assert other is not None and "another machine" in other
    unrecorded = HardwareSpec(**MINIMAL).staleness(here)  # profiles from before keys existed
    assert unrecorded is not None and "unrecorded" in unrecorded
    spread = {"gpu_flops": 0.05, "dtoc_bw": 0.6}
    noisy = HardwareSpec(**MINIMAL, machine=here, spread=spread, quick=True)
    assert noisy.max_spread == ("dtoc_bw", 0.6)
    assert noisy.staleness(here) is None  # planned from; measured again in the background
    reason = noisy.noise()
    assert reason is not None and "dtoc_bw" in reason and "60%" in reason
    assert quiet.noise() is None
    # a busy machine stays busy: after MAX_ATTEMPTS profiles the least noisy one is kept
    assert dataclasses.replace(noisy, attempts=3).noise() is None
    # `nanoflex profile` retook its noisy measurements itself: only another machine replaces it
    assert dataclasses.replace(noisy, quick=False).noise() is None


def test_machine_and_spread_survive_json(tmp_path: Path) -> None:
    spec = HardwareSpec(**MINIMAL, machine="cpu=x; cores=1", spread={"ctog_bw": 0.1}, attempts=2)
    spec.save(tmp_path / "hw.json")
    assert HardwareSpec.load(tmp_path / "hw.json") == spec
    with pytest.raises(UserError, match="spread"):
        HardwareSpec(**MINIMAL, spread={"ctog_bw": -1.0})


def test_dense_seconds_follow_the_measured_table() -> None:
    """The reference layer's time at as many rows, scaled by the layer's size."""
    table = ((1, 1e-3), (8, 2e-3), (64, 8e-3))
    spec = HardwareSpec(**MINIMAL, dense_step_table=table, dense_step_params=1000)
    assert spec.dense_seconds(2 * 8 * 2000, 2000) == pytest.approx(4e-3)  # 8 rows, 2x the size
    assert spec.dense_seconds(2 * 36 * 1000, 1000) == pytest.approx(5e-3)  # halfway 8..64
    assert spec.dense_seconds(2 * 0.5 * 1000, 1000) == pytest.approx(1e-3)  # below: as 1 row
    assert spec.dense_seconds(2 * 128 * 1000, 1000) == pytest.approx(16e-3)  # beyond: linear
    assert HardwareSpec(**MINIMAL, dense_step_table=table).dense_seconds(1e6, 1e3) is None


def test_a_spike_in_the_dense_table_does_not_make_fewer_rows_slower() -> None:
    table = ((1, 1e-3), (2, 9e-3), (4, 2e-3))  # 2 rows measured while descheduled
    spec = HardwareSpec(**MINIMAL, dense_step_table=table, dense_step_params=1000)
    assert spec.dense_seconds(2 * 2 * 1000, 1000) == pytest.approx(2e-3)

"""The offload directory under faults, on the real executor (the demo model, KV on disk):
a write or read the disk refuses is a recompute, never a crash or a wrong token; a cached
page is verified when it is used; any damage to the disk-cache index or its pages costs
misses, never the start. Every answer is compared with a cold run (prefix cache off)."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from engine.core.model_files import DEMO_MODEL
from engine.core.offload_dir import OffloadDirError, lock_offload_dir
from engine.core.sampling_params import SamplingParams
from engine.llm import LLM
from engine.storage.disk_cache import INDEX_NAME
from policy import Policy
from tests.engine.storage.disk_faults import EIO, ENOSPC, DiskFaults
from tests.engine.storage.disk_faults import disk_faults as disk_faults  # a fixture

GREEDY = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
PROMPTS = [[(11 * i + 7 * t) % 2000 + 8 for t in range(40)] for i in range(4)]
"""Four 40-token prompts: with 20 tokens generated, 3 full pages (of 16) each."""
ON_DISK = Policy(kv_frac=(0.0, 0.0, 1.0))
Tokens = list[list[int]]


@pytest.fixture(scope="module")
def cold() -> Tokens:
    """What every run must answer: the demo model with no prefix cache and no disk."""
    with LLM(DEMO_MODEL, policy=Policy(), device="cpu", enable_prefix_caching=False) as llm:
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]


def engine(offload_dir: Path, policy: Policy = ON_DISK, **kwargs: Any) -> LLM:
    return LLM(
        DEMO_MODEL,
        policy=policy,
        device="cpu",
        offload_dir=offload_dir,
        offload_retry_s=0.05,
        **kwargs,
    )


def tokens(llm: LLM, prompts: Tokens = PROMPTS) -> Tokens:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]


# -- a full or failing disk mid-step ----------------------------------------------------------


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_full_disk_mid_step_is_a_recompute_not_a_wrong_answer(
    tmp_path: Path, disk_faults: DiskFaults, cold: Tokens, async_scheduling: bool
) -> None:
    """Half the sequences' KV on disk; three KV page writes in the middle of the run get
    ENOSPC: the steps they were in are recomputed and every answer equals the cold run."""
    policy = Policy(kv_frac=(0.5, 0.0, 0.5))
    with engine(tmp_path, policy, async_scheduling=async_scheduling) as llm:
        disk_faults.fail("write", "kv-", ENOSPC, times=3, skip=4)
        assert tokens(llm) == cold
        assert disk_faults.injected == 3
        scheduler = llm.scheduler
        assert 1 <= scheduler.rest.num_faults <= 3
        assert "No space left on device" in scheduler.rest.last_fault
        assert all(scheduler.page_manager.num_used_pages(t) == 0 for t in ("gpu", "disk"))
        assert tokens(llm) == cold  # and it goes on serving


def test_a_disk_that_stays_full_fails_requests_retryably_then_recovers(
    tmp_path: Path, disk_faults: DiskFaults, cold: Tokens
) -> None:
    """All KV on disk and every KV write refused: each request is tried twice (the disk
    rests 0.05 s in between), then ends with a retryable error naming the cause; once the
    disk takes writes again the same engine answers as the cold run."""
    with engine(tmp_path) as llm:
        disk_faults.fail("write", "kv-", ENOSPC)
        failed = llm.generate(PROMPTS[:2], GREEDY)
        for out in failed:
            choice = out.outputs[0]
            assert choice.finish_reason == "error" and not choice.token_ids
            assert "offload storage failed" in (choice.error or "")
            assert "No space left on device" in (choice.error or "")
        assert llm.scheduler.rest.num_faults == 2
        disk_faults.clear()
        assert tokens(llm) == cold


def test_an_unreadable_cached_page_is_a_miss(
    tmp_path: Path, disk_faults: DiskFaults, cold: Tokens
) -> None:
    """The first read of a cached disk page (its check before a hit uses it) gets EIO: the
    page is dropped, the prompt recomputed, the answer right, no storage fault counted."""
    with engine(tmp_path) as llm:
        assert tokens(llm, PROMPTS[:1]) == cold[:1]
        disk_faults.fail("read", "kv-", EIO, times=1)
        out = llm.generate(PROMPTS[:1], GREEDY)[0]
        assert out.outputs[0].token_ids == cold[0]
        assert disk_faults.injected == 1
        assert llm.scheduler.page_manager.stats.failed_pages >= 1
        assert llm.scheduler.rest.num_faults == 0


def test_a_cached_page_changed_on_disk_is_verified_when_used(tmp_path: Path, cold: Tokens) -> None:
    """A cached page's bytes change on disk while the engine runs (what a second engine on
    the directory did): the next hit verifies it, finds it wrong, and recomputes."""
    with engine(tmp_path) as llm:
        assert tokens(llm, PROMPTS[:1]) == cold[:1]
        index = llm.executor.disk_cache
        page = min(p for p in index._pages if index._pages[p][0] in _hashes(llm, PROMPTS[0]))
        _scribble(tmp_path, page, layer=3)
        out = llm.generate(PROMPTS[:1], GREEDY)[0]
        assert out.outputs[0].token_ids == cold[0]
        assert llm.scheduler.page_manager.stats.failed_pages == 1
        assert out.num_cached_tokens < 32  # the page was not used


def _hashes(llm: LLM, prompt: list[int]) -> set[str]:
    from engine.core.prefix_cache import page_hashes

    return set(page_hashes(prompt, 16, llm.scheduler.config.cache_salt))


def _scribble(offload_dir: Path, page: int, layer: int) -> None:
    with open(offload_dir / f"kv-{layer:04d}.bin", "r+b") as f:
        f.seek(page * 16 * 1024 + 100)
        f.write(b"\x7f\x00\x7f\x00")


# -- damage to the index and the pages between runs ---------------------------------------------


@pytest.fixture(scope="module")
def seeded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An offload directory a first engine left: 12 cached pages on disk and their index."""
    root = tmp_path_factory.mktemp("seed")
    with engine(root) as llm:
        tokens(llm)
    return root


def _index(d: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((d / INDEX_NAME).read_text())
    return data


def _write(d: Path, data: Any) -> None:
    (d / INDEX_NAME).write_text(json.dumps(data))


def _swap_hashes(d: Path) -> None:
    data = _index(d)
    a, b = sorted(data["pages"], key=int)[:2]
    pages = data["pages"]
    pages[a][0], pages[b][0] = pages[b][0], pages[a][0]
    _write(d, data)


def _swap_entries(d: Path) -> None:
    data = _index(d)
    a, b = sorted(data["pages"], key=int)[:2]
    data["pages"][a], data["pages"][b] = data["pages"][b], data["pages"][a]
    _write(d, data)


def _malformed_entries(d: Path) -> None:
    data = _index(d)
    pages = data["pages"]
    keys = sorted(pages, key=int)
    pages[keys[0]] = 5
    pages[keys[1]] = [pages[keys[1]][0], [1, 2]]
    pages[keys[2]] = [None, pages[keys[2]][1]]
    pages["x"] = pages[keys[3]]
    pages["999999999"] = pages[keys[3]]
    pages[keys[3]][1][0] = True
    _write(d, data)


def _truncate_a_layer(d: Path) -> None:
    os.truncate(d / "kv-0002.bin", 16 * 1024 * 2)  # the first 2 pages stay whole


Damage = Callable[[Path], None]
DAMAGE: dict[str, tuple[Damage, int, bool]] = {
    # name: (damage, pages still found, a warning)
    "intact": (lambda d: None, 12, False),
    "index missing": (lambda d: (d / INDEX_NAME).unlink(), 0, False),
    "index []": (lambda d: _write(d, []), 0, True),
    "index pages []": (lambda d: _write(d, {**_index(d), "pages": []}), 0, True),
    "index garbage": (lambda d: (d / INDEX_NAME).write_bytes(b"\x00\xff{not json"), 0, True),
    "index version 1": (lambda d: _write(d, {**_index(d), "version": 1}), 0, True),
    "hashes swapped": (_swap_hashes, 10, True),
    "entries swapped": (_swap_entries, 10, True),
    "malformed entries": (_malformed_entries, 8, True),
    "a layer file cut short": (_truncate_a_layer, 2, True),
    "a layer file missing": (lambda d: (d / "kv-0004.bin").unlink(), 0, True),
    "page bytes changed": (lambda d: _scribble(d, 0, layer=1), 11, True),
}


@pytest.fixture
def damaged(request: pytest.FixtureRequest, seeded: Path, tmp_path: Path) -> Iterator[Path]:
    d = tmp_path / "offload"
    shutil.copytree(seeded, d)
    (d / "nanoflex.lock").unlink(missing_ok=True)
    yield d


@pytest.mark.parametrize("case", list(DAMAGE))
def test_damage_to_the_index_or_pages_costs_misses_never_the_start(
    case: str, damaged: Path, cold: Tokens, caplog: pytest.LogCaptureFixture
) -> None:
    damage, kept, warns = DAMAGE[case]
    damage(damaged)
    with engine(damaged) as llm:
        info = llm.executor.describe()
        assert len(info.disk_cache) == kept
        assert bool(info.warnings) == warns == (info.disk_cache_dropped > 0)
        if warns:
            assert len(info.warnings) == 1 and "dropped" in info.warnings[0]
        assert tokens(llm) == cold
        assert llm.scheduler.page_manager.stats.failed_pages == 0  # nothing bad got through


# -- one owner per offload directory -------------------------------------------------------------


def test_a_second_owner_of_the_offload_directory_is_refused(tmp_path: Path) -> None:
    """An engine holds the directory; another process's engine on it gets one clear error;
    once the first is closed, the directory is free again (its lock file left behind, with
    a dead owner's pid, is taken over)."""
    import subprocess
    import sys

    code = (
        "import sys, time\n"
        "from pathlib import Path\n"
        "from engine.core.offload_dir import lock_offload_dir\n"
        "lock_offload_dir(Path(sys.argv[1]))\n"
        "print('held', flush=True)\n"
        "time.sleep(60)\n"
    )
    holder = subprocess.Popen(
        [sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        with pytest.raises(
            OffloadDirError, match=f"in use by another nanoflex process .pid {holder.pid}"
        ):
            lock_offload_dir(tmp_path, wait_s=0)
    finally:
        holder.kill()
        holder.wait()
    assert (tmp_path / "nanoflex.lock").read_text().strip() == str(holder.pid)  # stale
    lock = lock_offload_dir(tmp_path, wait_s=5)
    assert (tmp_path / "nanoflex.lock").read_text().strip() == str(os.getpid())
    lock.release()

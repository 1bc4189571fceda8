"""Overlap proven from the trace of what ran when, not from equal tokens alone.

With overlap on, the loads for layer j+1 run while layer j computes (weights from disk;
with one GPU batch also past KV from disk, which never waits for this step's stores);
with overlap off no load intersects any compute. A no-op "overlap" fails the first test.
With nano-batches, the attention of one nano-batch runs on another thread while the dense
ops of another run on the compute thread; split but not overlapped, nothing intersects.
"""

from __future__ import annotations

import functools
import itertools
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from engine import LLM, SamplingParams
from engine.core.model_files import DEMO_MODEL
from policy import Policy

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def prompts(num: int = 8, length: int = 300) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(10, 2000, (length,), generator=g).tolist() for _ in range(num)]


def traced_run(
    policy: Policy, path: Path, **engine: Any
) -> tuple[list[list[int]], list[dict[str, Any]]]:
    with LLM(DEMO_MODEL, policy=policy, device="cpu", trace=str(path), **engine) as llm:
        outputs = llm.generate(prompts(), GREEDY)
    trace = json.loads(path.read_text())
    return [o.outputs[0].token_ids for o in outputs], trace["traceEvents"]


Run = tuple[list[list[int]], list[dict[str, Any]]]


@pytest.fixture(scope="module")
def traced(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Run]:
    """`traced_run` of a policy and engine settings, run once per module: several tests
    read the same run (the resident one, overlap on and off; weights on disk). Callers only
    read the tokens and events they get."""
    root = tmp_path_factory.mktemp("traces")
    names = itertools.count()

    @functools.cache
    def get(policy: Policy, **engine: Any) -> Run:
        return traced_run(policy, root / f"run-{next(names)}.json", **engine)

    return get


def overlapping(events: list[dict[str, Any]], load_name: str) -> tuple[int, int]:
    """(compute events of layer j that some `load_name` of layer j+1 intersects, all
    compute events with such a load)."""
    complete = [e for e in events if e["ph"] == "X"]
    computes = [e for e in complete if e["cat"] == "compute"]
    loads = [e for e in complete if e["name"] == load_name]
    hits = total = 0
    for c in computes:
        nxt = [e for e in loads if e["args"]["layer"] == c["args"]["layer"] + 1]
        if nxt:
            total += 1
            hits += any(e["ts"] < c["ts"] + c["dur"] and c["ts"] < e["ts"] + e["dur"] for e in nxt)
    return hits, total


@pytest.mark.parametrize(
    "placement,load_name",
    [
        (dict(weights_frac=(0.0, 0.0, 1.0)), "load_weight"),
        (dict(kv_frac=(0.0, 0.0, 1.0)), "load_cache"),  # one GPU batch: KV does not wait
    ],
    ids=["weights-on-disk", "kv-on-disk"],
)
def test_loads_of_the_next_layer_run_while_this_layer_computes(
    placement: dict[str, Any], load_name: str, traced: Callable[..., Run]
) -> None:
    on, on_events = traced(Policy(**placement, overlap=True))
    off, off_events = traced(Policy(**placement, overlap=False))
    assert on == off
    hits, total = overlapping(on_events, load_name)
    assert total > 10 and hits >= total // 3, (hits, total)
    assert overlapping(off_events, load_name)[0] == 0


def test_a_step_that_moves_nothing_runs_in_order(traced: Callable[..., Run]) -> None:
    """Everything resident, overlap on: no load has bytes to move, so the step runs layer
    after layer (each weight load after the previous layer's compute), not through the
    overlapped loop's look-ahead, which would start layer j+1's load before layer j computes.
    With weights on disk the look-ahead stays."""
    resident, events = traced(Policy(overlap=True))
    assert resident == traced(Policy(overlap=False))[0]
    complete = sorted((e for e in events if e["ph"] == "X"), key=lambda e: e["ts"])
    last_compute, checked = None, 0
    for e in complete:
        if e["cat"] == "compute":
            last_compute = e["args"]["layer"]
        elif e["name"] == "load_weight" and e["args"]["layer"] > 0:
            assert last_compute == e["args"]["layer"] - 1, e  # the previous layer computed
            checked += 1
    assert checked > 10
    _, disk = traced(Policy(weights_frac=(0.0, 0.0, 1.0)))
    assert overlapping(disk, "load_weight")[0] > 0


def test_trace_is_chrome_trace_event_json(traced: Callable[..., Run]) -> None:
    policy = Policy(weights_frac=(0.0, 0.5, 0.5), kv_frac=(0.0, 0.5, 0.5), act_frac=(0, 1, 0))
    _, events = traced(policy)
    complete = [e for e in events if e["ph"] == "X"]
    assert {e["cat"] for e in complete} == {"load", "store", "compute"}
    names = {e["name"] for e in complete}
    assert names >= {"load_weight", "load_cache", "load_activation", "compute"}
    assert names >= {"store_cache", "store_activation"}
    for e in complete:
        assert set(e["args"]) == {"layer", "gpu_batch", "nano_batch"}
        assert e["dur"] >= 0 and isinstance(e["tid"], int)
    thread = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M"}
    by_cat = {
        cat: {thread[e["tid"]] for e in complete if e["cat"] == cat}
        for cat in ("load", "store", "compute")
    }
    assert all(t.startswith("nanoflex-load") for t in by_cat["load"] - by_cat["compute"])
    assert all(t.startswith("nanoflex-store") for t in by_cat["store"] - by_cat["compute"])
    assert len(by_cat["compute"]) == 1 and not by_cat["compute"] & (
        by_cat["load"] | by_cat["store"]
    )


def test_cpu_attention_attends_over_disk_kv_on_the_cpu(traced: Callable[..., Run]) -> None:
    """FlexGen reads disk-homed KV into host memory and attends there; so do we."""
    reference, _ = traced(Policy())
    policy = Policy(kv_frac=(0.0, 0.0, 1.0), cpu_attention=True)
    tokens, events = traced(policy)
    assert tokens == reference
    on_cpu = [e for e in events if e.get("cat") == "cpu_attention"]
    assert len(on_cpu) >= 3 * 6  # every decode step, every decoder layer


NANO_DENSE = ("attention_inputs", "attention_output")
NANO_ATTENTION = ("attention", "cpu_attention")


def nano_overlaps(events: list[dict[str, Any]]) -> tuple[int, int]:
    """(attention events of a nano-batch that some dense op of another nano-batch of the same
    layer and GPU batch intersects in time on another thread, all attention events)."""
    complete = [e for e in events if e["ph"] == "X"]
    dense = [e for e in complete if e["name"] in NANO_DENSE]
    hits = total = 0
    for a in (e for e in complete if e["name"] in NANO_ATTENTION):
        total += 1
        hits += any(
            d["tid"] != a["tid"]
            and d["args"]["nano_batch"] != a["args"]["nano_batch"]
            and (d["args"]["layer"], d["args"]["gpu_batch"])
            == (a["args"]["layer"], a["args"]["gpu_batch"])
            and d["ts"] < a["ts"] + a["dur"]
            and a["ts"] < d["ts"] + d["dur"]
            for d in dense
        )
    return hits, total


@pytest.mark.parametrize(
    "placement",
    [dict(kv_frac=(0.0, 1.0, 0.0), cpu_attention=True), {}],
    ids=["cpu-attention", "resident"],
)
def test_attention_of_one_nano_batch_runs_beside_the_dense_ops_of_another(
    placement: dict[str, Any], traced: Callable[..., Run]
) -> None:
    reference, _ = traced(Policy(**placement))
    policy = Policy(**placement, num_nano_batches=2)
    on, on_events = traced(policy)
    off, off_events = traced(policy, nano_batch_overlap=False)
    assert on == off == reference
    hits, total = nano_overlaps(on_events)
    assert total >= 2 * 4 * 6 and hits >= total // 2, (hits, total)  # 2 nano x 4 steps x 6 layers
    attention = "cpu_attention" if placement else "attention"
    threads = {e["tid"] for e in on_events if e.get("name") == attention}
    dense_threads = {e["tid"] for e in on_events if e.get("name") in NANO_DENSE}
    assert len(threads) == len(dense_threads) == 1 and threads != dense_threads
    assert nano_overlaps(off_events) == (0, total)


def test_paged_attention_gathers_no_packed_past(traced: Callable[..., Run]) -> None:
    """KV on the compute device is read in place by attention: no load_cache copies of the
    past, where the packed path has one per layer and step; the same tokens either way."""
    paged, paged_events = traced(Policy())
    packed, packed_events = traced(Policy(), paged_attention=False)
    assert paged == packed

    def loads(events: list[dict[str, Any]]) -> int:
        return sum(e["ph"] == "X" and e["name"] == "load_cache" for e in events)

    assert loads(paged_events) == 0
    assert loads(packed_events) > 10


def test_resident_work_is_not_handed_to_copy_threads(traced: Callable[..., Run]) -> None:
    """With weights, KV and activations all on the compute device, the overlapped loop has
    nothing to move: its loads and stores run inline, none on a copy thread (a hand-off
    costs more than the nothing it would do), and the tokens are the sequential loop's."""
    on, events = traced(Policy(overlap=True))
    off, _ = traced(Policy(overlap=False))
    assert on == off
    thread = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M"}
    used = {thread[e["tid"]] for e in events if e["ph"] == "X"}
    assert not any(name.startswith(("nanoflex-load", "nanoflex-store")) for name in used), used

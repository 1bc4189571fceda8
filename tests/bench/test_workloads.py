"""The named workloads nanoflex and vLLM run side by side are the same on both sides."""

from __future__ import annotations

from bench.peers.workloads import FIRST_ID, build, num_tokens


def test_mixed_is_the_efficiency_workload_and_deterministic() -> None:
    workload = build("mixed", 49152)
    assert workload == build("mixed", 49152)  # what a peer's process builds too
    assert len(workload) == 64
    assert all(32 <= len(ids) <= 256 for ids, _ in workload)
    assert [n for i, (_, n) in enumerate(workload) if i % 4 == 3] == [128] * 16
    assert all(8 <= n <= 32 for i, (_, n) in enumerate(workload) if i % 4 != 3)
    assert all(FIRST_ID <= t < 49152 for ids, _ in workload for t in ids)


def test_fixed_length_variants() -> None:
    assert num_tokens(build("prefill-heavy", 1000)) == (16 * 1024, 16 * 16)
    assert num_tokens(build("decode-heavy", 1000)) == (32 * 64, 32 * 512)
    assert build("mixed-32", 1000) == build("mixed", 1000)[:32]

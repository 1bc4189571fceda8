"""Where every layer shares one sliding window (Mistral, Phi-3), a sequence's attention reads
only its last window - 1 past tokens: the pages before them are never gathered, read from
the pool or loaded from the cpu and disk tiers again. Where global layers sit beside local
ones (Gemma), every past token is read."""

from __future__ import annotations

import pytest
import torch

from engine.core.protocol import SeqChunk
from engine.core.sampling_params import SamplingParams
from engine.executor.batch_builder import BatchBuilder
from engine.executor.gpu_batch import SeqState
from engine.storage.kv_store import KVRows, KVStore
from policy import Policy
from tests.engine.executor.test_correctness import PLACEMENTS, run
from tests.engine.tiny_models import MAX_TOKENS, random_prompts, vocab_size

PAGE = 16
PAGE_IDS = [5, 9, 4]
"""The page table of each sequence below: token t lives in slot PAGE_IDS[t // 16] * 16 + t % 16."""


def _batch(windows: tuple[int, ...], tier: str) -> tuple[BatchBuilder, KVRows]:
    """A decode after 40 tokens and a 4-token prompt chunk after 30, KV homed on `tier`: the
    builder and the slots of the past its device's attention group gathers."""
    cpu = torch.device("cpu")
    builder = BatchBuilder(
        cpu, PAGE, cpu_attention=False, windows=windows, pool_device=lambda tier: cpu
    )
    chunks = []
    for seq_id, (q_len, past) in enumerate([(1, 40), (4, 30)]):
        state = SeqState(tier, "gpu", SamplingParams(max_tokens=1))
        state.pages = [(tier, page) for page in PAGE_IDS]
        chunk = SeqChunk(seq_id, [5] * q_len, past, 0, [], tier, "gpu", do_sample=True)
        chunks.append((chunk, state))
    group = builder.build(0, chunks).device_group
    assert group is not None
    ((read_tier, rows),) = group.past.items()
    assert read_tier == tier
    return builder, rows


def _slots(tokens: range) -> list[int]:
    return [PAGE_IDS[t // PAGE] * PAGE + t % PAGE for t in tokens]


@pytest.mark.parametrize("tier", ["gpu", "cpu", "disk"])
def test_a_window_every_layer_shares_gathers_only_its_last_tokens(tier: str) -> None:
    builder, rows = _batch((8,), tier)
    # the decode sees tokens 33..39; the prompt chunk's first query (position 30) sees 23..29
    assert rows.slots == _slots(range(33, 40)) + _slots(range(23, 30))
    assert rows.rows.tolist() == list(range(14))  # packed in sequence order
    assert builder.shared_window == 8


def test_global_layers_beside_local_ones_gather_every_past_token() -> None:
    builder, rows = _batch((0, 8), "disk")
    assert rows.slots == _slots(range(40)) + _slots(range(30))
    assert builder.shared_window == 0


@pytest.mark.parametrize(("kind", "most_read"), [("phi3", 19), ("gemma3", 40 + MAX_TOKENS - 2)])
def test_kv_loaded_from_disk_per_step_is_the_window(
    tiny_model, tmp_path, monkeypatch, kind: str, most_read: int
) -> None:
    """A 40-token prompt whose KV lives on disk: each decode of the tiny Phi-3 (window 20 on
    every layer) loads 19 past tokens per layer, not the 40 to 46 the sequence holds; the tiny
    Gemma 3 (a global layer among local ones) loads them all."""
    reads: list[tuple[str, int]] = []
    real_read = KVStore.read

    def spy(
        self: KVStore, tier: str, layer: int, kv_rows: KVRows, staged: bool = False
    ) -> torch.Tensor:
        reads.append((tier, len(kv_rows.slots)))
        return real_read(self, tier, layer, kv_rows, staged)

    monkeypatch.setattr(KVStore, "read", spy)
    prompts = random_prompts(1, vocab_size(kind), 40, 40, seed=1)
    policy = Policy(**PLACEMENTS["kv-act-disk"])  # type: ignore[arg-type]
    run(tiny_model(kind), prompts, policy, tmp_path)
    assert {tier for tier, _ in reads} == {"disk"}
    assert max(n for _, n in reads) == most_read

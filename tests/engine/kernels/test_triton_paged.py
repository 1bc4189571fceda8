"""The one paged attention kernel (engine/kernels/triton_paged.py), proved on the CPU.

Triton's interpreter runs it on CPU tensors here (the compiled kernel on a GPU where there is
one), against a float64 reference, on small ragged steps of each kind: prefill chunks only
(a first chunk, chunks over a past, one longer than a query block), decodes only (one split
and several), and both mixed in one call; grouped-query ratios 1, 4 and 8 over head dims 64
and 128 (and 96, padded); sliding windows, chunked attention and sinks. Keys lie on shuffled
pages of a pool whose unused rows are NaN (`paged_pool`), so a read of a wrong slot shows.
Through `paged_attention` (the engine's call), a mixed step is one launch for its decodes and
one for its chunks, equal to the gather-and-SDPA path. The compile test for sm_90 (no
spills) covers it with the others (tests/engine/kernels/test_triton_attention.py).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch

triton = pytest.importorskip("triton")
pytest.importorskip("numpy")

from engine.executor.attention import AttentionSpec, RaggedLayout, paged_attention  # noqa: E402
from engine.kernels import PagedKernels  # noqa: E402
from engine.kernels import triton_attention as ta  # noqa: E402
from engine.kernels import triton_paged as tp  # noqa: E402
from engine.models.config import KVShape  # noqa: E402
from tests.engine.kernels.test_triton_attention import (  # noqa: E402
    DEVICE,
    TOLERANCE,
    paged_pool,
    reference,
    relative_error,
)

STEPS = {
    # (new rows, past rows) per sequence
    "prefill": [(5, 0), (17, 40), (45, 70)],
    "decode": [(1, 0), (1, 16), (1, 129), (1, 63)],
    "mixed": [(1, 30), (9, 0), (1, 70), (36, 25), (1, 3)],
}


def run_step(
    shapes: list[tuple[int, int]],
    heads: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    window: int = 0,
    sinks: torch.Tensor | None = None,
    split_len: int | None = None,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the kernel's output, the float64 reference) for one step of `shapes`."""
    q_lens = [n for n, _ in shapes]
    lens = [n + p for n, p in shapes]
    pool, seq_slots = paged_pool(lens, kv_heads, head_dim, dtype, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(sum(q_lens), heads, head_dim, generator=g).to(dtype)
    scale = head_dim**-0.5
    want = reference(q, pool, seq_slots, q_lens, kv_heads, scale, window, sinks)
    width = max(lens) + 5  # a table wider than the longest sequence: its tail is never read
    table = torch.tensor([s + [s[0]] * (width - len(s)) for s in seq_slots])
    q_starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()])
    on = [t.to(DEVICE) for t in (q, pool, table, q_starts, torch.tensor(lens))]
    got = tp.paged_attention(
        *on, kv_heads, scale, window, max(q_lens), max(lens),
        sinks=None if sinks is None else sinks.to(DEVICE), split_len=split_len,
    ).cpu()  # fmt: skip
    assert got.dtype == dtype and got.shape == q.shape
    return got, want


@pytest.mark.parametrize("kind", list(STEPS))
@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,dtype",
    [(2, 2, 64, torch.float32), (8, 2, 128, torch.bfloat16), (8, 1, 64, torch.float16)],
    ids=["mha-64-fp32", "gqa4-128-bf16", "gqa8-64-fp16"],
)
def test_one_kernel_equals_the_reference(kind, heads, kv_heads, head_dim, dtype):
    got, want = run_step(STEPS[kind], heads, kv_heads, head_dim, dtype, seed=head_dim)
    assert relative_error(got, want) < TOLERANCE[dtype]


@pytest.mark.parametrize(
    "window,with_sinks",
    [(24, False), (-16, False), (0, True), (40, True)],
    ids=["window", "chunks", "sinks", "window-sinks"],
)
def test_windows_chunks_and_sinks(window, with_sinks):
    """A mixed step with a sliding window shorter than a query block, Llama 4's chunks, and
    gpt-oss's sinks (some far above the scores, some below), with and without a window."""
    sinks = torch.linspace(-3.0, 6.0, 8) if with_sinks else None
    got, want = run_step(STEPS["mixed"], 8, 2, 64, torch.float32, window, sinks, seed=5)
    assert relative_error(got, want) < TOLERANCE[torch.float32]


@pytest.mark.parametrize("window", [80, -80], ids=["window", "chunks"])
def test_whole_tiles_within_a_long_window(window):
    """A window (or chunk) longer than a key tile: a block's first rows see whole tiles its
    last rows must not (past their window, or before their chunk), which only the masked
    runs may read."""
    shapes = [(1, 200), (40, 150), (3, 10)]
    got, want = run_step(shapes, 8, 2, 64, torch.float32, window, seed=6)
    assert relative_error(got, want) < TOLERANCE[torch.float32]


@pytest.mark.parametrize("window", [0, 40, -48], ids=["full", "window", "chunks"])
def test_decode_splits_merge(window):
    """A decode-only step cut into splits of 64 keys (and the default cut), merged with the
    sinks: the same as the reference; a window or a chunk shortens what is split."""
    sinks = torch.linspace(-2.0, 4.0, 8)
    shapes = [(1, 0), (1, 200), (1, 130)]
    for split_len in (None, 64):
        got, want = run_step(shapes, 8, 2, 64, torch.bfloat16, window, sinks, split_len, seed=9)
        assert relative_error(got, want) < TOLERANCE[torch.bfloat16], split_len


def test_odd_groups_and_keys_that_are_the_values():
    """Three query heads a kv head over head_dim 96 (padded to 128), and rows of keys alone
    (MLA's latent: one kv head of 40 under 16 query heads), read as the values too."""
    shapes = [(1, 30), (9, 0), (20, 25)]
    got, want = run_step(shapes, 12, 4, 96, torch.float16, seed=3)
    assert relative_error(got, want) < TOLERANCE[torch.float16]
    q_lens, lens = [n for n, _ in shapes], [n + p for n, p in shapes]
    pool, seq_slots = paged_pool(lens, 1, 40, torch.float32, seed=4, values_are_keys=True)
    q = torch.randn(sum(q_lens), 16, 40, generator=torch.Generator().manual_seed(4))
    want = reference(q, pool, seq_slots, q_lens, 1, 0.125, 0)
    table = torch.tensor([s + [s[0]] * (max(lens) - len(s)) for s in seq_slots])
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()])
    on = [t.to(DEVICE) for t in (q, pool, table, starts, torch.tensor(lens))]
    got = tp.paged_attention(*on, 1, 0.125, 0, max(q_lens), max(lens)).cpu()
    assert relative_error(got, want) < TOLERANCE[torch.float32]


def test_the_engine_call_launches_it_once_per_group():
    """The engine's call (`paged_attention`) on a layout of decodes and prefill chunks runs the
    kernel once for the decodes (decode tiles: q_max 1) and once for the chunks, every row
    once, and equals the same call without kernels (gather + SDPA) and the reference."""
    heads, kv_heads, head_dim, dtype = 8, 2, 64, torch.float32
    shapes = STEPS["mixed"]
    q_lens, past = [n for n, _ in shapes], [p for _, p in shapes]
    lens = [n + p for n, p in shapes]
    pool, seq_slots = paged_pool(lens, kv_heads, head_dim, dtype, seed=11)
    q = torch.randn(sum(q_lens), heads, head_dim, generator=torch.Generator().manual_seed(3))
    layout = RaggedLayout.build(q_lens, past, DEVICE, None, seq_slots)
    assert len(layout.groups) == 2 and all(g.paged is not None for g in layout.groups)
    calls = []

    def counted(*args, **kwargs):
        calls.append((args[0].shape[0], args[8]))  # (rows, q_max)
        return tp.paged_attention(*args, **kwargs)

    one = PagedKernels(ta.paged_decode, None, counted)
    encoded, q_on, shape = pool.view(torch.uint8).to(DEVICE), q.to(DEVICE), KVShape(2, 64)

    def plain(rows: torch.Tensor) -> torch.Tensor:
        return rows.view(dtype)

    got = paged_attention(q_on, encoded, plain, layout, shape, one, AttentionSpec()).cpu()
    decodes, chunks = [n for n in q_lens if n == 1], [n for n in q_lens if n > 1]
    assert sorted(calls) == sorted([(len(decodes), 1), (sum(chunks), max(chunks))])
    gathered = paged_attention(q_on, encoded, plain, layout, shape, None, AttentionSpec()).cpu()
    want = reference(q, pool, seq_slots, q_lens, kv_heads, head_dim**-0.5, 0)
    assert relative_error(got, want) < TOLERANCE[dtype]
    assert relative_error(gathered, want) < TOLERANCE[dtype]
    capped = AttentionSpec(softcap=30.0)  # soft-capped scores stay on the gather path
    paged_attention(q_on, encoded, plain, layout, shape, one, capped)
    assert len(calls) == 2


@pytest.mark.slow  # 20-40 s each under the interpreter: every layer of every step
@pytest.mark.skipif(DEVICE.type == "cuda", reason="on a GPU the CUDA suite runs the engine so")
@pytest.mark.parametrize("kind", ["llama", "gpt_oss", "llama4_text"])
def test_engine_through_the_one_kernel_matches_transformers(tiny_model, references, kind):
    """A whole model's greedy tokens with every attention of every step through the one kernel
    (interpreted here, as `cuda_paged_kernels()` gives it on CUDA): transformers' tokens.
    Llama brings three query heads a kv head, gpt-oss sinks and sliding windows, Llama 4
    chunked attention beside full layers."""
    from engine import LLM, SamplingParams
    from engine.kernels import cuda_paged_kernels
    from policy import Policy
    from tests.engine.tiny_models import MAX_TOKENS

    prompts, expected = references(kind)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    kernels = cuda_paged_kernels()
    assert kernels is not None and kernels.attention is not None
    one, steps = kernels.attention, []

    def counted(*args: Any, **kwargs: Any) -> torch.Tensor:
        steps.append(args[8])  # q_max: 1 for a decode-only step
        return one(*args, **kwargs)

    with LLM(
        str(tiny_model(kind)),
        policy=Policy(),
        device="cpu",
        dtype="float32",
        native_kernels=False,
        prepack_weights=False,
    ) as llm:
        llm.executor.pipeline.kernels = replace(kernels, attention=counted)
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert got == expected
    assert 1 in steps and max(steps) > 1, steps  # decode steps and prefill steps ran through it

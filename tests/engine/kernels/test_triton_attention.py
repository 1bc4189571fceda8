"""The CUDA decode kernel (engine/kernels/triton_attention.py), proved on the CPU.

Triton's interpreter runs it on CPU tensors here (on a machine with a GPU, the compiled
kernel on the GPU); it is compared with a float64 reference and with the CPU's
gather-and-SDPA path on small ragged shapes: keys on shuffled pages of a pool whose unused
rows are NaN, a sequence of one token, sequences longer than a split, grouped-query heads, a
sliding window, chunked attention (Llama 4), a head_dim that is not a power of two. The one
step kernel (triton_paged.py) has its own tests (test_triton_paged.py), which share this
file's pool and reference. And every CUDA kernel is compiled for sm_90 (the H100 and H200)
with no GPU present: one that does not compile for Hopper, or spills, fails here.

Tolerances, relative (|out - ref| / |ref| over the whole output against float64): float32
1e-5 (the products in IEEE float32); float16 and bfloat16 2e-3 and 1e-2 (tiles multiplied
in the type, probabilities rounded to it, as flash attention does; bfloat16 keeps 8 bits).
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")
pytest.importorskip("numpy")

from engine.executor.attention import AttentionSpec, RaggedLayout, paged_attention  # noqa: E402
from engine.kernels import PagedKernels  # noqa: E402
from engine.kernels import triton_attention as ta  # noqa: E402
from engine.models.config import KVShape  # noqa: E402

PAGE = 16
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
"""Where the kernels run: compiled on a GPU (`pytest -m gpu` machines run this file too),
interpreted on CPU tensors elsewhere."""
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def paged_pool(
    lens: list[int],
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    seed: int,
    values_are_keys: bool = False,
) -> tuple[torch.Tensor, list[list[int]]]:
    """(pool rows (slots, 2 * kv_dim), or (slots, kv_dim) keys that are the values too
    (`values_are_keys`), with NaN in every row no sequence uses, per sequence the slots of
    its keys on shuffled pages)."""
    g = torch.Generator().manual_seed(seed)
    num_pages = sum(-(-n // PAGE) for n in lens) + 3
    pages = torch.randperm(num_pages, generator=g).tolist()
    row_dim = KVShape(kv_heads, head_dim, values_are_keys).row_dim
    pool = torch.full((num_pages * PAGE, row_dim), float("nan"), dtype=dtype)
    seq_slots = []
    for n in lens:
        mine = [pages.pop() for _ in range(-(-n // PAGE))]
        slots = [mine[t // PAGE] * PAGE + t % PAGE for t in range(n)]
        pool[slots] = torch.randn(n, pool.shape[1], generator=g).to(dtype)
        seq_slots.append(slots)
    return pool, seq_slots


def reference(
    q: torch.Tensor,
    pool: torch.Tensor,
    seq_slots: list[list[int]],
    q_lens: list[int],
    kv_heads: int,
    scale: float,
    window: int,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Float64 attention, sequence by sequence: row t of a sequence with q_len new rows and
    kv_len keys sees keys [0, kv_len - q_len + t] (the last `window`; with window < 0 those
    of its own chunk); `sinks` (heads,): gpt-oss's sink logits. A pool of kv_dim-wide rows
    holds keys that are the values too."""
    heads, head_dim = q.shape[1], q.shape[2]
    kv_dim = kv_heads * head_dim
    v_at = 0 if pool.shape[1] == kv_dim else kv_dim
    out, row = [], 0
    for slots, q_len in zip(seq_slots, q_lens, strict=True):
        kv = pool[slots].double()
        k = kv[:, :kv_dim].view(-1, kv_heads, head_dim).repeat_interleave(heads // kv_heads, 1)
        v = kv[:, v_at : v_at + kv_dim].view(-1, kv_heads, head_dim)
        v = v.repeat_interleave(heads // kv_heads, 1)
        qs = q[row : row + q_len].double()
        scores = torch.einsum("thd,khd->htk", qs, k) * scale
        pos = torch.arange(len(slots) - q_len, len(slots))[:, None]
        keys = torch.arange(len(slots))[None, :]
        seen = keys <= pos
        if window > 0:
            seen &= keys > pos - window
        if window < 0:  # chunked attention: the query's own chunk of -window positions
            seen &= keys >= pos - pos % -window
        scores = scores.masked_fill(~seen, float("-inf"))
        if sinks is not None:  # each head's sink: one more column, without a value
            column = sinks.double()[:, None, None].expand(-1, scores.shape[1], 1)
            scores = torch.cat([scores, column], dim=-1)
        probs = scores.softmax(-1)[..., : len(slots)]
        out.append(torch.einsum("htk,khd->thd", probs, v))
        row += q_len
    return torch.cat(out)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    assert not torch.isnan(got).any(), "NaN in the output: an unused or masked row was read"
    return float((got.double() - want).norm() / want.norm())


TRITON = PagedKernels(ta.paged_decode, None)
"""The decode kernel, as `cuda_paged_kernels(one_kernel=False)` gives it."""


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,window",
    [(8, 2, 64, 0), (6, 6, 32, 0), (12, 4, 96, 0), (8, 2, 64, 20), (8, 2, 64, -48)],
    ids=["gqa", "mha", "head96", "window", "chunks"],
)
def test_decode_kernel_equals_the_reference(dtype, heads, kv_heads, head_dim, window):
    lens = [1, 17, 64, 130, 200, 3]  # one token; past a split (64 keys) and a tile
    pool, seq_slots = paged_pool(lens, kv_heads, head_dim, dtype, seed=head_dim + abs(window))
    g = torch.Generator().manual_seed(1)
    q = torch.randn(len(lens), heads, head_dim, generator=g).to(dtype)
    scale = head_dim**-0.5
    want = reference(q, pool, seq_slots, [1] * len(lens), kv_heads, scale, window)
    kv_max = max(lens)
    table = torch.tensor([s + [s[0]] * (kv_max - len(s)) for s in seq_slots]).reshape(-1)
    on = [t.to(DEVICE) for t in (q, pool, table, torch.tensor(lens))]
    default_len = ta.decode_splits(len(lens), kv_heads, kv_max, ta.multiprocessors(on[0]))[1]
    # the default cut, then one to four splits but the one the default cut already ran (one
    # split here, four on a GPU)
    for split_len in (None, *(n for n in (64, 128, 256) if n != default_len)):
        got = ta.paged_decode(*on, kv_heads, scale, window, split_len).cpu()
        assert got.dtype == dtype and got.shape == q.shape
        assert relative_error(got, want) < TOLERANCE[dtype], split_len


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("values_are_keys", [False, True], ids=["kv", "values-are-keys"])
def test_kernels_through_paged_attention_equal_the_gather_path(dtype, values_are_keys):
    """The decode kernel as the engine calls it (`paged_attention` with a layout of decodes
    and prefill chunks in one step, the chunks gathered for SDPA) against the same call
    without kernels (gather + SDPA); with
    rows of keys that are the values too (MLA's latent, stored once: 8 query heads over one
    kv head of 40, padded to 64), both read the values from the keys."""
    heads, kv_heads, head_dim = (8, 1, 40) if values_are_keys else (8, 2, 32)
    q_lens, past = [1, 1, 6, 1, 20], [30, 4, 0, 70, 12]
    lens = [q + p for q, p in zip(q_lens, past, strict=True)]
    pool, seq_slots = paged_pool(lens, kv_heads, head_dim, dtype, 11, values_are_keys)
    g = torch.Generator().manual_seed(3)
    q = torch.randn(sum(q_lens), heads, head_dim, generator=g).to(dtype)
    layout = RaggedLayout.build(q_lens, past, DEVICE, None, seq_slots)
    spec = AttentionSpec()

    def plain(rows: torch.Tensor) -> torch.Tensor:
        return rows.view(dtype)

    encoded, q_on = pool.view(torch.uint8).to(DEVICE), q.to(DEVICE)
    shape = KVShape(kv_heads, head_dim, values_are_keys)
    got = paged_attention(q_on, encoded, plain, layout, shape, TRITON, spec).cpu()
    gathered = paged_attention(q_on, encoded, plain, layout, shape, None, spec).cpu()
    want = reference(q, pool, seq_slots, q_lens, kv_heads, head_dim**-0.5, 0)
    assert relative_error(got, want) < TOLERANCE[dtype]
    assert relative_error(gathered, want) < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernels_read_values_from_keys_that_are_the_values(dtype):
    """Rows of keys alone (MLA's latent, stored once: one kv head of 40 under 16 query heads)
    in decode, with one split and several: the values are the keys."""
    heads, kv_heads, head_dim = 16, 1, 40
    lens = [1, 17, 130, 3]
    pool, seq_slots = paged_pool(lens, kv_heads, head_dim, dtype, 8, values_are_keys=True)
    assert pool.shape[1] == head_dim
    g = torch.Generator().manual_seed(9)
    q = torch.randn(len(lens), heads, head_dim, generator=g).to(dtype)
    want = reference(q, pool, seq_slots, [1] * len(lens), kv_heads, 0.125, 0)
    table = torch.tensor([s + [s[0]] * (max(lens) - len(s)) for s in seq_slots]).reshape(-1)
    on = [t.to(DEVICE) for t in (q, pool, table, torch.tensor(lens))]
    for split_len in (None, 64):
        got = ta.paged_decode(*on, kv_heads, 0.125, 0, split_len).cpu()
        assert relative_error(got, want) < TOLERANCE[dtype], split_len
    with pytest.raises(ValueError, match="KV rows of 40 values: expected 80 or 160"):
        ta.paged_decode(*on[:2], table, torch.tensor(lens), 2, 0.125, 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernels_take_sinks(dtype):
    """gpt-oss's sink logits (some far above the scores, some below), in decode with one
    split and several (merged with the sinks), with a sliding window."""
    heads, kv_heads, head_dim, window = 8, 2, 64, 40
    sinks = torch.linspace(-3.0, 6.0, heads)
    lens = [1, 17, 130, 3]
    pool, seq_slots = paged_pool(lens, kv_heads, head_dim, dtype, seed=5)
    g = torch.Generator().manual_seed(4)
    q = torch.randn(len(lens), heads, head_dim, generator=g).to(dtype)
    want = reference(q, pool, seq_slots, [1] * len(lens), kv_heads, 0.125, window, sinks)
    table = torch.tensor([s + [s[0]] * (max(lens) - len(s)) for s in seq_slots]).reshape(-1)
    on = [t.to(DEVICE) for t in (q, pool, table, torch.tensor(lens), sinks)]
    for split_len in (None, 64):
        got = ta.paged_decode(*on[:4], kv_heads, 0.125, window, split_len, sinks=on[4]).cpu()
        assert relative_error(got, want) < TOLERANCE[dtype], split_len


def test_decode_splits_fill_the_gpu():
    """A short batch of long sequences is cut into splits (132 multiprocessors, 2 programs
    each); a large batch is not; a split is whole tiles."""
    splits, split_len = ta.decode_splits(batch=2, kv_heads=8, kv_max=4096, sms=132)
    assert splits * 2 * 8 >= 2 * 132 and split_len % ta.DECODE_BLOCK_N == 0
    assert splits * split_len >= 4096
    assert ta.decode_splits(batch=256, kv_heads=8, kv_max=4096, sms=132)[0] == 1
    assert ta.decode_splits(batch=1, kv_heads=1, kv_max=1, sms=132) == (1, ta.DECODE_BLOCK_N)


def test_kernels_compile_for_hopper():
    """Every CUDA kernel (attention, the one paged kernel's two configurations, and the
    fused dense ops) compiled for sm_90 from its source, here, without a GPU (in a process
    of its own: this one runs Triton's interpreter): a cubin each, and no register spills."""
    from engine.kernels import triton_dense, triton_paged
    from engine.kernels.triton_compile import report_in_own_process

    report = report_in_own_process("--arch", "90")
    kernels = {*ta.COMPILE_CASES, *triton_paged.COMPILE_CASES, *triton_dense.COMPILE_CASES}
    assert {(r["kernel"], r["dtype"]) for r in report} == {
        (k, t) for k in kernels for t in ("fp16", "bf16")
    }
    for row in report:
        assert row["cubin_bytes"] > 0 and row["arch"] == "sm_90"
        assert row["local_bytes"] == 0 and row["stack_bytes"] == 0, row  # no spills

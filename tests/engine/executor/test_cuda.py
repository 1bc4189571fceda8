"""The correctness suite on a CUDA device: run with `pytest -m gpu` on a machine with a GPU.

float32 must match transformers token for token under every placement. In
float16 the reference itself depends on kernel choices; we hold float16 to the
same exact equality and record any divergence in docs/benchmarks.md.
"""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from policy import Policy
from tests.engine.executor.test_correctness import MAX_TOKENS, PLACEMENTS
from tests.engine.tiny_models import (
    DENSE_2025,
    GPT_OSS,
    GROUPED_MOE_FAMILIES,
    LLAMA4,
    NEW_FAMILIES,
    TINY_CONFIGS,
    hf_reference,
    random_prompts,
    vocab_size,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def hf_greedy_cuda(model_dir, prompts, dtype):
    model = hf_reference(model_dir, dtype).cuda()
    model.generation_config.eos_token_id = None
    out = []
    for prompt in prompts:
        ids = torch.tensor([prompt], device="cuda")
        gen = model.generate(
            ids,
            max_new_tokens=MAX_TOKENS,
            min_new_tokens=MAX_TOKENS,
            do_sample=False,
            pad_token_id=0,
        )
        out.append(gen[0, len(prompt) :].tolist())
    return out


def cuda_greedy(model_dir, prompts, policy, tmp_path, dtype, check=None, **options):
    """nanoflex's greedy MAX_TOKENS tokens for each prompt on CUDA, EOS ignored; `check(llm)`
    runs after the generation, before the engine closes."""
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    with LLM(
        str(model_dir),
        policy=policy,
        offload_dir=tmp_path / "off",
        device="cuda",
        dtype=dtype,
        **options,
    ) as llm:
        tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        if check is not None:
            check(llm)
        return tokens


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("overlap", [False, True], ids=["sequential", "overlap"])
@pytest.mark.parametrize("placement", list(PLACEMENTS))
@pytest.mark.parametrize("kind", ["llama", "opt"])
def test_cuda_matches_transformers(tiny_model, tmp_path, kind, placement, overlap, dtype):
    vocab = vocab_size(kind)
    prompts = random_prompts(6, vocab, 2, 40, seed=len(kind))
    expected = hf_greedy_cuda(tiny_model(kind), prompts, getattr(torch, dtype))
    policy = Policy(overlap=overlap, **PLACEMENTS[placement])  # type: ignore[arg-type]
    assert cuda_greedy(tiny_model(kind), prompts, policy, tmp_path, dtype) == expected


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "cuda-graphs"])
@pytest.mark.parametrize("placement", ["all-on-device", "kv-act-mixed", "three-gpu-batches"])
@pytest.mark.parametrize("kind", NEW_FAMILIES)
def test_cuda_newer_families_match_transformers(tiny_model, tmp_path, kind, placement, graphs):
    """Qwen 3, Gemma 2/3, Phi-3 and OLMo 2 in float32 on CUDA (windows, soft-caps, q/k norms,
    partial rotary), with the decode steps' dense ops replayed as CUDA graphs or not."""
    vocab = vocab_size(kind)
    prompts = random_prompts(6, vocab, 2, 40, seed=len(kind))
    expected = hf_greedy_cuda(tiny_model(kind), prompts, torch.float32)
    policy = Policy(**PLACEMENTS[placement])  # type: ignore[arg-type]
    got = cuda_greedy(tiny_model(kind), prompts, policy, tmp_path, "float32", cuda_graphs=graphs)
    assert got == expected


GPU_ONLY_PATHS = (
    *DENSE_2025,
    *GROUPED_MOE_FAMILIES,
    GPT_OSS,
    LLAMA4,
    "qwen3_next",
    "nemotron_h",
    "granite4",
    "falcon_h1",
)
"""What only a GPU can check of issues 37 and 38: DeepSeek-V3's latent stored once (the
Triton kernels reading values from the keys), gpt-oss's sinks (in the kernels, and in host
memory for CPU attention: `HostSinks`), Llama 4's chunks, NoPE layers, and the hybrids'
state store on the device and in pinned host memory."""


@pytest.mark.parametrize(
    "placement", ["all-on-device", "kv-cpu-cpu-attention", "kv-act-mixed", "three-gpu-batches"]
)
@pytest.mark.parametrize("kind", GPU_ONLY_PATHS)
def test_cuda_giants_and_hybrids_match_transformers(tiny_model, tmp_path, kind, placement):
    vocab = vocab_size(kind)
    prompts = random_prompts(6, vocab, 2, 40, seed=len(kind))
    expected = hf_greedy_cuda(tiny_model(kind), prompts, torch.float32)
    policy = Policy(**PLACEMENTS[placement])  # type: ignore[arg-type]
    assert cuda_greedy(tiny_model(kind), prompts, policy, tmp_path, "float32") == expected


def test_cuda_compresses_weights_on_the_device(tiny_model, tmp_path, monkeypatch):
    """4-bit weights are quantized on the GPU, then homed on every tier from there (the host
    took the H200 pass's whole 131 s for OPT-6.7B): every `quantize` call gets a CUDA tensor,
    and the tokens are the same wherever the weights live, the device's quantization being
    the CPU's bit for bit (tests/engine/storage/test_quant.py::test_cuda_matches_cpu)."""
    from engine.storage import weight_store

    devices: list[str] = []
    quantize = weight_store.quantize

    def seen(x, *args, **kwargs):
        devices.append(x.device.type)
        return quantize(x, *args, **kwargs)

    monkeypatch.setattr(weight_store, "quantize", seen)
    prompts = random_prompts(5, vocab_size("llama"), 4, 30, seed=3)
    tokens = []
    for weights in ((1.0, 0.0, 0.0), (0.3, 0.4, 0.3)):
        policy = Policy(compress_weights=True, weights_frac=weights)
        tokens.append(cuda_greedy(tiny_model("llama"), prompts, policy, tmp_path, "float32"))
    assert devices and set(devices) == {"cuda"}
    assert tokens[0] == tokens[1]


def test_cuda_stores_to_host_memory_run_at_most_a_window_ahead(tiny_model, tmp_path):
    """KV rows bound for the cpu tier are copied at most STORE_WINDOW ahead of the layer loop
    (`CopyWindow`: the loop waited for older copies), and the tokens are transformers'."""
    from policy.reserves import STORE_WINDOW

    prompts = random_prompts(6, vocab_size("llama"), 2, 40, seed=5)
    expected = hf_greedy_cuda(tiny_model("llama"), prompts, torch.float32)
    policy = Policy(gpu_batch_size=2, num_gpu_batches=3, kv_frac=(0.0, 1.0, 0.0))

    def waited(llm):
        window = llm.executor.pipeline.store_window
        assert window.depth == STORE_WINDOW and window.waits > 0

    got = cuda_greedy(tiny_model("llama"), prompts, policy, tmp_path, "float32", check=waited)
    assert got == expected


def test_gpu_mem_budget_is_enforced(tiny_model):
    with pytest.raises(Exception, match="budget"):
        LLM(str(tiny_model("llama")), policy=Policy(), device="cuda", gpu_mem=1024)


GRAPH_PLACEMENTS = {
    "resident": dict(gpu_batch_size=4),
    "offloaded-slots": dict(gpu_batch_size=4, weights_frac=(0.0, 0.5, 0.5)),
    "three-gpu-batches-disk": dict(gpu_batch_size=2, num_gpu_batches=3, weights_frac=(0, 0, 1)),
    "nano-batches": dict(gpu_batch_size=8, num_nano_batches=2),
}


@pytest.mark.parametrize("placement", list(GRAPH_PLACEMENTS))
@pytest.mark.parametrize("kind", ["llama", "opt"])
def test_cuda_graphs_replay_decode_steps_with_identical_tokens(
    tiny_model, tmp_path, kind, placement
):
    """Discrete sizes + piecewise CUDA graphs, over resident weights or offloaded layers
    loaded into their fixed slots, one GPU batch or three, or nano-batches with graphs of
    their own: the decode steps go through the graphs (with one GPU batch the prefill and
    mixed steps too) and the tokens equal the eager path's."""
    vocab = vocab_size(kind)
    prompts = random_prompts(10, vocab, 2, 40, seed=5)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    outputs = {}
    for graphs in (False, True):
        with LLM(
            str(tiny_model(kind)),
            policy=Policy(**GRAPH_PLACEMENTS[placement]),  # type: ignore[arg-type]
            device="cuda",
            dtype="float32",
            offload_dir=tmp_path / f"off-{graphs}",
            cuda_graphs=graphs,
        ) as llm:
            outputs[graphs] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
            runner = llm.executor.pipeline.graphs
            assert (runner is not None) == graphs
            offloaded = "weights_frac" in GRAPH_PLACEMENTS[placement]
            assert (llm.executor.weights.slots is not None) == offloaded
            if runner is not None:
                assert runner.num_replays >= MAX_TOKENS - 1
                # one GPU batch: its prefill steps replay the warm-up's piecewise graphs (a
                # batch cut into nano-batches does not; several GPU batches never do)
                if placement in ("resident", "offloaded-slots"):
                    assert runner.num_piecewise_replays > 0
                elif placement == "three-gpu-batches-disk":
                    assert runner.num_piecewise_replays == 0
    assert outputs[True] == outputs[False]


@pytest.mark.parametrize("warmup", [True, False], ids=["warmed", "cold"])
def test_cuda_warm_up_leaves_nothing_to_capture_or_compile(tiny_model, tmp_path, warmup):
    """After the engine's warm-up, prefill, decode (prompts past one 64-key tile: split
    decodes) and mixed steps capture no graph and make Triton compile nothing (its own
    post-compile hook counts); the tokens equal the cold engine's, which captures and
    compiles as it goes (unless an earlier test of this process compiled the same)."""
    from engine.kernels.triton_launch import compiled_count

    prompts = random_prompts(10, vocab_size("llama"), 2, 90, seed=7)
    max_tokens = [1 + i % MAX_TOKENS for i in range(len(prompts))]  # ragged: mixed steps
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in max_tokens]
    with LLM(
        str(tiny_model("llama")),
        policy=Policy(gpu_batch_size=4),
        device="cuda",
        dtype="float16",
        offload_dir=tmp_path / "off",
        warmup=warmup,
    ) as llm:
        info = llm.executor.describe().warm_up
        runner = llm.executor.pipeline.graphs
        assert runner is not None
        before = (runner.num_captures, compiled_count())
        tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        after = (runner.num_captures, compiled_count())
    assert [len(t) for t in tokens] == max_tokens
    if warmup:
        assert info is not None and info.graphs_captured > 0, info
        print(f"warm-up: {info}")
        assert after == before, f"(captures, compiles) grew from {before} to {after}"
    else:
        assert info is None and after[0] > before[0]


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "cuda-graphs"])
@pytest.mark.parametrize("placement", ["all-on-device", "kv-act-mixed"])
def test_cuda_paged_attention_equals_packed(tiny_model, tmp_path, placement, graphs):
    """On CUDA, KV read in place from the device pool (the new rows written first, on the
    compute stream) gives the packed path's tokens, with and without CUDA graphs."""
    vocab = int(TINY_CONFIGS["llama"]["vocab_size"])  # type: ignore[call-overload]
    prompts = random_prompts(8, vocab, 2, 40, seed=7)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    policy = Policy(**PLACEMENTS[placement])  # type: ignore[arg-type]
    outputs = {}
    for paged in (False, True):
        with LLM(
            str(tiny_model("llama")),
            policy=policy,
            offload_dir=tmp_path / f"off-{paged}",
            device="cuda",
            dtype="float32",
            cuda_graphs=graphs,
            paged_attention=paged,
        ) as llm:
            outputs[paged] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert outputs[True] == outputs[False]


@pytest.mark.parametrize("num_nano", [2, 4])
@pytest.mark.parametrize("placement", ["all-on-device", "kv-cpu-cpu-attention", "kv-act-mixed"])
def test_cuda_nano_batches_match_transformers(tiny_model, tmp_path, placement, num_nano):
    """Nano-batches on two CUDA streams (and CPU attention beside them): the same tokens."""
    vocab = int(TINY_CONFIGS["llama"]["vocab_size"])  # type: ignore[call-overload]
    prompts = random_prompts(7, vocab, 2, 40, seed=4)
    expected = hf_greedy_cuda(tiny_model("llama"), prompts, torch.float32)
    policy = Policy(
        gpu_batch_size=5,
        num_gpu_batches=2,
        num_nano_batches=num_nano,
        **PLACEMENTS[placement],  # type: ignore[arg-type]
    )

    def ran_nano_batches(llm):
        nano = llm.executor.pipeline.nano
        assert nano is not None and nano.num_layers_run > 0

    got = cuda_greedy(
        tiny_model("llama"), prompts, policy, tmp_path, "float32", check=ran_nano_batches
    )
    assert got == expected


def _wide_llama(path, layers=2):
    """A Llama of `layers` layers wide enough (hidden 2048) that one nano-batch's operations
    outlast the host's kernel launches: with tiny models a GPU finishes each kernel before the
    next is issued, and nothing can overlap."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "llama",
        vocab_size=512,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=layers,
        num_attention_heads=16,
        num_key_value_heads=4,
        max_position_embeddings=2048,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float16).save_pretrained(path)
    return path


@pytest.mark.parametrize(
    "placement,attention,max_tokens",
    [
        ({}, "attention", 1),  # prefill: attention and GEMMs both long enough to overlap
        (dict(kv_frac=(0.0, 1.0, 0.0), cpu_attention=True), "cpu_attention", 4),  # decodes
    ],
    ids=["resident-two-streams", "cpu-attention"],
)
def test_cuda_trace_shows_nano_batches_overlapping(tmp_path, placement, attention, max_tokens):
    """The trace of the CUDA path (device spans timed with CUDA events): the attention of one
    nano-batch, on the attention stream or the CPU thread, intersects dense ops of another on
    the compute stream."""
    import json

    from tests.engine.executor.test_trace_overlap import NANO_DENSE, nano_overlaps

    model = _wide_llama(tmp_path / "wide")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 512, (1024,), generator=g).tolist() for _ in range(8)]
    path = tmp_path / "trace.json"
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    policy = Policy(num_nano_batches=2, **placement)  # type: ignore[arg-type]
    # every prefill in one step: a step that holds one sequence's prefill chunk alone is not
    # cut into nano-batches, and its CPU attention runs on the step thread (seen on the
    # first H100 run; reproduced on the CPU with planning ahead)
    steps = {"max_step_tokens": 16384} if attention == "cpu_attention" else {}
    with LLM(str(model), policy=policy, device="cuda", trace=str(path), **steps) as llm:
        llm.generate(prompts, params)
    events = json.loads(path.read_text())["traceEvents"]
    tracks = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M"}
    dense = {tracks[e["tid"]] for e in events if e.get("name") in NANO_DENSE}
    attending = {tracks[e["tid"]] for e in events if e.get("name") == attention}
    assert len(dense) == len(attending) == 1 and dense != attending
    prefix = "nanoflex-cpu-attention" if attention == "cpu_attention" else "cuda stream"
    assert next(iter(dense)).startswith("cuda stream")
    assert next(iter(attending)).startswith(prefix)
    hits, total = nano_overlaps(events)
    assert total > 0 and hits >= total // 2, (hits, total)


def test_cuda_trace_shows_the_next_layers_load_beside_this_layers_compute(tmp_path):
    """The engine's own offloaded steps on the CUDA path (device spans timed with CUDA
    events): with overlap on, the copy of layer j+1's weights from host memory runs while
    layer j computes, in at least half of the layers that have one. Each layer's 120 MB of
    float16 weights copy in about as long as 8 x 1,024 prompt tokens take through it, so a
    load issued after the compute cannot hide. With overlap off the tokens are the same; its
    spans are not asserted apart: the host waits for each load in turn, but a copy enqueued on
    the copy stream while the compute stream still runs may still meet it on the device."""
    import json

    from tests.engine.executor.test_trace_overlap import overlapping

    model = _wide_llama(tmp_path / "wide", layers=6)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 512, (1024,), generator=g).tolist() for _ in range(8)]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    runs = {}
    for overlap in (True, False):
        path = tmp_path / f"trace-{overlap}.json"
        policy = Policy(overlap=overlap, weights_frac=(0.0, 1.0, 0.0))
        with LLM(str(model), policy=policy, device="cuda", trace=str(path)) as llm:
            tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        runs[overlap] = tokens, json.loads(path.read_text())["traceEvents"]
    assert runs[True][0] == runs[False][0]
    hits, total = overlapping(runs[True][1], "load_weight")
    off = overlapping(runs[False][1], "load_weight")
    assert total >= 5 and hits >= total // 2, (hits, total, "off:", off)


@pytest.mark.parametrize("kind", ["qwen3_next", "nemotron_h"])
def test_cuda_hybrid_prefix_cache_restores_saved_states(tiny_model, tmp_path, kind):
    """A hybrid's prefix cache on CUDA (the CPU test: test_hybrids.py): six prompts of one
    40-token prefix sent one after another, KV and states split between the GPU and host
    memory; one state saved, four restored, tokens equal transformers' on CUDA."""
    from tests.engine.executor.test_hybrids import PREFIX_TOKENS

    vocab = vocab_size(kind)
    prefix = random_prompts(1, vocab, PREFIX_TOKENS, PREFIX_TOKENS, seed=7)[0]
    prompts = [prefix + tail for tail in random_prompts(6, vocab, 3, 9, seed=8)]
    expected = hf_greedy_cuda(tiny_model(kind), prompts, torch.float32)
    policy = Policy(gpu_batch_size=2, num_gpu_batches=2, kv_frac=(0.5, 0.5, 0.0))
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    with LLM(
        str(tiny_model(kind)), policy=policy, offload_dir=tmp_path / "off", device="cuda"
    ) as llm:
        got = [llm.generate([p], params)[0].outputs[0].token_ids for p in prompts]
        stats = llm.scheduler.page_manager.stats
    assert got == expected
    assert (stats.state_saves, stats.state_hits) == (1, 4)

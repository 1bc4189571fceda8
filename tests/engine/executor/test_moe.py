"""Mixture-of-experts models (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE): greedy tokens equal
transformers' under every weight placement, nano-batches and the prefix cache; logits equal its
full forward pass; 4-bit experts within a stated tolerance; the router's top-k and
renormalisation as transformers computes them, ties included; both checkpoint layouts of the
experts (one tensor set per expert, transformers 5's stacked tensors)."""

from __future__ import annotations

import json
import shutil
import time
from collections import Counter

import pytest
import torch

from engine.core.engine_args import EngineArgs
from engine.executor.executor import Executor
from engine.models.moe import route
from engine.storage.quant import QuantizedTensor
from policy import Policy
from tests.engine.executor.test_correctness import PLACEMENTS, run
from tests.engine.executor.test_family_features import (
    _prompts,
    _score,
    assert_four_bit_within_tolerance,
)
from tests.engine.executor.test_nano_batches import SHAPE
from tests.engine.executor.test_nano_batches import run as run_nano
from tests.engine.executor.test_prefix_caching import (
    assert_cached_prefixes_give_transformers_tokens,
)
from tests.engine.tiny_models import (
    MAX_TOKENS,
    MOE_FAMILIES,
    TINY_CONFIGS,
    build_from_spec,
    hf_greedy,
    random_prompts,
)

MOE_PLACEMENTS = {
    "all-on-device": {},
    "weights-cpu": dict(weights_frac=(0.0, 1.0, 0.0), experts_frac=(0.0, 1.0, 0.0)),
    "weights-disk": dict(weights_frac=(0.0, 0.0, 1.0), experts_frac=(0.0, 0.0, 1.0)),
    "experts-cpu": dict(experts_frac=(0.0, 1.0, 0.0)),  # the policy's expert split
    "experts-disk": dict(experts_frac=(0.0, 0.0, 1.0)),
    "experts-split-3": dict(weights_frac=(0.0, 1.0, 0.0), experts_frac=(0.4, 0.3, 0.3)),
}
SLOW_PLACEMENTS = ("weights-split-3", "three-gpu-batches", "kv-act-mixed")
"""Placements of the dense families' tests also run here under `-m slow` (the MoE layer reads
nothing of the KV or the batch shape: it sees each GPU batch's rows)."""


def _placements() -> list[object]:
    slow = [pytest.param(p, marks=pytest.mark.slow) for p in SLOW_PLACEMENTS]
    return [*MOE_PLACEMENTS, *slow]


@pytest.mark.parametrize("placement", _placements())
@pytest.mark.parametrize("kind", MOE_FAMILIES)
def test_moe_matches_transformers(tiny_model, references, tmp_path, kind, placement):
    prompts, expected = references(kind)
    policy = Policy(**{**MOE_PLACEMENTS, **PLACEMENTS}[placement])  # type: ignore[arg-type]
    assert run(tiny_model(kind), prompts, policy, tmp_path) == expected


@pytest.mark.parametrize("kind", MOE_FAMILIES)
def test_moe_with_nano_batches(tiny_model, references, tmp_path, kind):
    prompts, expected = references(kind)
    policy = Policy(**SHAPE, weights_frac=(0.0, 0.5, 0.5), num_nano_batches=4)
    tokens, layers_run = run_nano(tiny_model(kind), prompts, policy, tmp_path)
    assert tokens == expected and layers_run > 0


@pytest.mark.parametrize("kind", MOE_FAMILIES)
def test_moe_with_prefix_cache(tiny_model, kind):
    assert_cached_prefixes_give_transformers_tokens(tiny_model(kind), kind, Policy())


@pytest.mark.parametrize("kind", MOE_FAMILIES)
def test_routing_varies_and_logits_equal_transformers(tiny_model, kind):
    """Teacher-forced: transformers' forward pass over each sequence against our prefill of 12
    tokens and one decode per token after. In every MoE layer the tokens of each prompt pick at
    least 4 different expert sets (13-29 in the first layers; later ones of a random model route
    more alike), so the test would see a wrong expert, order or weight."""
    from transformers import AutoModelForCausalLM

    prompts = _prompts(kind)
    model = AutoModelForCausalLM.from_pretrained(tiny_model(kind), dtype=torch.float32)
    top_k = model.config.num_experts_per_tok
    ours = _score(tiny_model(kind), prompts)
    for prompt, got in zip(prompts, ours, strict=True):
        with torch.no_grad():
            out = model(torch.tensor([prompt]), output_router_logits=True)
        torch.testing.assert_close(got, out.logits[0], rtol=0, atol=2e-5)
        for logits in out.router_logits:  # (T, num_experts) per MoE layer
            chosen = {tuple(sorted(row)) for row in logits.topk(top_k).indices.tolist()}
            assert len(chosen) >= 4


@pytest.mark.parametrize(
    "compressed", ["weights", pytest.param("kv", marks=pytest.mark.slow)]
)  # 4-bit KV is the dense families' code path, tested there
@pytest.mark.parametrize("kind", MOE_FAMILIES)
def test_four_bit_within_tolerance(tiny_model, kind, compressed):
    """4-bit weights (every expert's matrices; the router's kept) or KV: the mean KL divergence
    of the next-token distribution from the float32 path per position stays within the dense
    families' bounds (docs/compression.md gives the measured figures)."""
    assert_four_bit_within_tolerance(tiny_model(kind), kind, compressed)


def test_each_expert_is_its_own_tensor_set_and_compressed(tiny_model):
    """A MoE layer's weights: the router (full precision), then per expert a fused gate_up and
    a down matrix of its own (a unit of storage of its own), each 4-bit under compression;
    Qwen2-MoE's shared expert beside them and its dense layer (mlp_only_layers) without a
    router."""
    policy = Policy(compress_weights=True)
    executor = Executor(EngineArgs(model=str(tiny_model("qwen2_moe")), device="cpu"), policy)
    try:
        layers = executor.weights.layers
        sparse, dense = layers[1].values, layers[2].values
        assert isinstance(sparse["router.weight"], torch.Tensor)
        assert isinstance(sparse["shared_gate.weight"], torch.Tensor)
        assert sorted(layers[1].experts) == list(range(8)) and not layers[2].experts
        for e in range(8):
            expert = layers[1].experts[e].values
            assert sorted(expert) == [f"experts.{e}.down.weight", f"experts.{e}.gate_up.weight"]
            gate_up = expert[f"experts.{e}.gate_up.weight"]
            down = expert[f"experts.{e}.down.weight"]
            assert isinstance(gate_up, QuantizedTensor) and gate_up.shape == (64, 64)
            assert isinstance(down, QuantizedTensor) and down.shape == (64, 32)
        assert isinstance(sparse["shared.gate_up.weight"], QuantizedTensor)
        assert "router.weight" not in dense and "gate_up.weight" in dense
        assert not executor.model.can_capture  # routing picks each step's shapes: no CUDA graphs
    finally:
        executor.close()


def test_stacked_experts_checkpoint(tiny_model, references, tmp_path):
    """transformers 5 holds experts stacked (`mlp.experts.gate_up_proj` (E, 2I, H)); a checkpoint
    saved that way loads to the same tokens as the one saved per expert."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    source = tiny_model("qwen3_moe")
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    stacked = tmp_path / "stacked"
    stacked.mkdir()
    shutil.copy(source / "config.json", stacked / "config.json")
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in state)
    save_file(state, str(stacked / "model.safetensors"))
    prompts, expected = references("qwen3_moe")
    assert run(stacked, prompts, Policy(weights_frac=(0.0, 0.5, 0.5)), tmp_path) == expected


def test_router_top_k_and_ties_match_transformers():
    """Near-ties: experts 1 and 5 have the same router row (equal logits, topk keeps the order
    torch gives), experts 2 and 6 rows one float32 step apart; our weights and ids equal
    transformers' routers' (Mixtral: always renormalised; Qwen3-MoE with and without)."""
    from transformers import AutoConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    torch.manual_seed(0)
    hidden, num_experts = 16, 8
    weight = torch.randn(num_experts, hidden)
    weight[5] = weight[1]
    weight[6] = torch.nextafter(weight[2], weight[2] + 1)
    x = torch.randn(64, hidden)
    x[:32] = weight[1] * 3  # rows that favour the tied pair
    logits = torch.nn.functional.linear(x, weight)
    assert torch.equal(logits[:, 1], logits[:, 5])
    routers = [("mixtral", 2, True), ("qwen3_moe", 3, True), ("qwen3_moe", 2, False)]
    for name, top_k, norm in routers:
        config = AutoConfig.for_model(
            name,
            hidden_size=hidden,
            num_local_experts=num_experts,
            num_experts=num_experts,
            num_experts_per_tok=top_k,
            norm_topk_prob=norm,
        )
        router = (MixtralTopKRouter if name == "mixtral" else Qwen3MoeTopKRouter)(config)
        with torch.no_grad():
            router.weight.copy_(weight)
            _, want_weights, want_ids = router(x)
        got_weights, got_ids = route(logits, top_k, norm)
        assert torch.equal(got_ids, want_ids)
        assert torch.equal(got_weights, want_weights)
        assert torch.allclose(got_weights.sum(-1), torch.ones(64)) == norm


@pytest.mark.parametrize(
    ("kind", "field", "value"),
    [
        ("mixtral", "num_experts_per_tok", 1),
        ("qwen2_moe", "norm_topk_prob", True),
        ("qwen3_moe", "norm_topk_prob", False),
        ("olmoe", "num_experts_per_tok", 3),
    ],
)
def test_each_routing_setting_changes_transformers_tokens(
    tiny_model, references, tmp_path, kind, field, value
):
    """The settings the model reads change transformers' own tokens on the test prompts, so the
    greedy tests above would catch one ignored."""
    prompts, expected = references(kind)
    changed = tmp_path / "changed"
    shutil.copytree(tiny_model(kind), changed)
    config = json.loads((changed / "config.json").read_text())
    config[field] = value
    (changed / "config.json").write_text(json.dumps(config))
    theirs = [hf_greedy(changed, p, MAX_TOKENS) for p in prompts]
    assert theirs != expected
    assert run(changed, prompts, Policy(), tmp_path) == theirs


@pytest.mark.parametrize("kind", MOE_FAMILIES)
def test_moe_gguf_generates_what_transformers_generates(tmp_path, monkeypatch, kind):
    """A float GGUF written as llama.cpp writes each family (experts stacked per layer; Mixtral
    as a `llama` file, its q/k rows permuted) converts back to the checkpoint it came from:
    greedy tokens equal transformers' on that checkpoint. Every layer sparse: llama.cpp's
    Qwen-MoE files have no dense layers."""
    from engine import LLM, SamplingParams
    from tests.engine.loading.gguf_files import write_gguf

    monkeypatch.setenv("NANOFLEX_CACHE", str(tmp_path / "cache"))
    spec = dict(TINY_CONFIGS[kind])
    if kind.startswith("qwen"):
        spec.update(mlp_only_layers=[], decoder_sparse_step=1)
    checkpoint = build_from_spec(spec, tmp_path / "hf")
    path = write_gguf(checkpoint, tmp_path / f"{kind}.gguf")
    prompts = random_prompts(2, int(spec["vocab_size"]), 6, 20, seed=3)  # type: ignore[call-overload]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    policy = Policy(weights_frac=(0.0, 0.5, 0.5))
    with LLM(str(path), policy=policy, device="cpu", offload_dir=tmp_path / "off") as llm:
        got = [out.outputs[0].token_ids for out in llm.generate(prompts, params)]
    assert got == [hf_greedy(checkpoint, p, MAX_TOKENS) for p in prompts]


def test_each_active_expert_runs_once_over_all_its_rows(monkeypatch):
    """Grouped, not per token: a MoE layer runs one SwiGLU (a gate_up and a down GEMM) per
    expert that has rows, over all of them at once, and none for the others; the result is
    each row's weighted sum over its experts, as a loop over rows computes it."""
    from transformers import AutoConfig

    from engine.models import build_model, moe
    from engine.models.config import ModelConfig

    spec = dict(TINY_CONFIGS["qwen3_moe"])
    config = ModelConfig.from_hf(AutoConfig.for_model(spec.pop("model_type"), **spec))
    model = build_model(config)
    hidden, width = config.hidden_size, config.moe_intermediate_size
    torch.manual_seed(0)
    picks = torch.zeros(config.num_experts, dtype=torch.int64)
    w = {"router.weight": torch.randn(config.num_experts, hidden), moe.PICKS: picks}
    for e in range(config.num_experts):
        w[f"experts.{e}.gate_up.weight"] = torch.randn(2 * width, hidden) * 0.1
        w[f"experts.{e}.down.weight"] = torch.randn(hidden, width) * 0.1
    x = torch.randn(10, hidden)
    runs: list[tuple[str, int]] = []
    real = moe.swiglu

    def counted(ops, weights, rows, prefix=""):
        runs.append((prefix, rows.shape[0]))
        return real(ops, weights, rows, prefix)

    monkeypatch.setattr(moe, "swiglu", counted)
    got = model.mlp(w, x)
    weights, ids = route(torch.nn.functional.linear(x, w["router.weight"]), 4, True)
    per_expert = torch.bincount(ids.flatten(), minlength=config.num_experts).tolist()
    assert runs == [(f"experts.{e}.", n) for e, n in enumerate(per_expert) if n]
    assert picks.tolist() == per_expert  # the router's counts, for placing hot experts
    assert len(runs) < x.shape[0] * 4  # experts shared by rows ran once for all of them
    want = torch.stack(
        [
            sum(
                weights[t, j] * real(model.ops, w, x[t : t + 1], f"experts.{int(e)}.")[0]
                for j, e in enumerate(ids[t])
            )
            for t in range(x.shape[0])
        ]
    )
    torch.testing.assert_close(got, want)


def test_each_expert_is_homed_on_its_own_tier_as_the_policy_splits_them(
    tiny_model, references, tmp_path
):
    """Experts are units of placement: with weights_frac all on the device and experts_frac
    split in quarters, the layers' other tensors stay on the device and the experts are
    homed a half, a quarter and a quarter, expert by expert (the byte split exact); a
    layer's experts on disk share its file; tokens as transformers'."""
    prompts, expected = references("mixtral")
    policy = Policy(weights_frac=(1.0, 0.0, 0.0), experts_frac=(0.5, 0.25, 0.25))
    args = EngineArgs(  # the disk cache not kept, as before the args were passed whole
        model=str(tiny_model("mixtral")),
        device="cpu",
        offload_dir=str(tmp_path / "o"),
        enable_prefix_caching=False,
    )
    executor = Executor(args, policy)
    try:
        store = executor.weights
        assert set(store.tiers) == {"gpu"}
        homes = [tier for layer in store.expert_tiers for tier in layer.values()]
        assert len(homes) == 8 * executor.config.num_layers
        assert [homes.count(t) / len(homes) for t in ("gpu", "cpu", "disk")] == [0.5, 0.25, 0.25]
        units = [u for layer in store.layers for u in layer.experts.values()]
        expert_bytes = {
            t: sum(u.nbytes for u in units if u.tier == t) for t in ("gpu", "cpu", "disk")
        }
        assert expert_bytes["gpu"] == 2 * expert_bytes["cpu"] == 2 * expert_bytes["disk"]
        on_disk = [
            (j, u)
            for j, layer in enumerate(store.layers)
            for u in layer.experts.values()
            if u.tier == "disk"
        ]
        for j, unit in on_disk:
            assert unit.file is not None and unit.file.path.name == f"weights-{j:04d}.bin"
        assert len({(j, u.start) for j, u in on_disk}) == len(on_disk)  # one region each
    finally:
        executor.close()
    assert run(tiny_model("mixtral"), prompts, policy, tmp_path) == expected


def test_the_most_picked_experts_are_homed_on_the_device_first(
    tiny_model, references, tmp_path, monkeypatch
):
    """The router's counts are kept with the model's cache when the engine closes (the rows
    routed to each expert, every layer's summing to top-k per row it computed); the next
    load homes the most-picked experts on the device (6 of the 24, a quarter, by experts_frac),
    and with hot_experts off the first ones by index. Tokens as transformers' each time."""
    from engine import LLM, SamplingParams
    from engine.storage.expert_picks import picks_path

    monkeypatch.setenv("NANOFLEX_CACHE", str(tmp_path / "cache"))
    model = tiny_model("mixtral")
    prompts, expected = references("mixtral")
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    with LLM(str(model), policy=Policy(), device="cpu") as llm:
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == expected
    saved = json.loads(picks_path(model).read_text())["counts"]
    counts = {int(j): row for j, row in saved.items()}
    assert sorted(counts) == [1, 2, 3] and all(
        sum(r) > 0 and sum(r) % 2 == 0 for r in counts.values()
    )
    assert len({sum(r) for r in counts.values()}) == 1  # every layer saw the same rows, top-2
    ranked = sorted(((j, e) for j in counts for e in range(8)), key=lambda u: -counts[u[0]][u[1]])
    assert set(ranked[:6]) != {(1, e) for e in range(6)}  # hot is not simply the first ones
    policy = Policy(experts_frac=(0.25, 0.75, 0.0))
    for hot, want in [(True, set(ranked[:6])), (False, {(1, e) for e in range(6)})]:
        executor = Executor(EngineArgs(model=str(model), device="cpu", hot_experts=hot), policy)
        try:
            homes = executor.weights.expert_tiers
            on_device = {
                (j, e) for j, row in enumerate(homes) for e, t in row.items() if t == "gpu"
            }
            assert on_device == want, hot
        finally:
            executor.close()
    assert run(model, prompts, policy, tmp_path) == expected


def test_the_block_runs_each_expert_once_loading_only_the_routed_ones(
    tiny_model, references, tmp_path, monkeypatch
):
    """Weights and experts on disk, three GPU batches: each layer's other weights load once
    per step for the whole block and each batch's attention runs on them; then each expert
    the block routes to runs once, over all the block's rows routed to it (never per GPU
    batch). A decode block (6 rows) loads each such expert once, after routing, and an
    expert no row routes to not at all; a prefill block, which routes to nearly every
    expert, loads them all with the layer. With overlap on, the next layer's weights load
    while this layer computes, and an expert's load runs while another expert computes
    (disk reads slowed so that a load outlasts a tiny expert's GEMMs); with it off, neither.
    Tokens as transformers'."""
    from engine import LLM, SamplingParams
    from engine.storage.disk import DiskIO
    from tests.engine.executor.test_trace_overlap import overlapping

    read = DiskIO.read

    def slow_read(self, f, offset, out):  # type: ignore[no-untyped-def]
        time.sleep(0.004)
        return read(self, f, offset, out)

    monkeypatch.setattr(DiskIO, "read", slow_read)
    prompts, expected = references("mixtral")
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    hits = {}
    for overlap in (True, False):
        path = tmp_path / f"trace-{overlap}.json"
        policy = Policy(
            weights_frac=(0.0, 0.0, 1.0),
            experts_frac=(0.0, 0.0, 1.0),
            gpu_batch_size=2,
            num_gpu_batches=3,
            overlap=overlap,
        )
        with LLM(str(tiny_model("mixtral")), policy=policy, device="cpu", trace=str(path)) as llm:
            assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == expected
        events = [e for e in json.loads(path.read_text())["traceEvents"] if e["ph"] == "X"]
        starts = sorted(
            e["ts"] for e in events if e["name"] == "load_weight" and e["args"]["layer"] == 0
        )
        kinds: Counter[str] = Counter()
        routed: list[int] = []
        for step, (begin, end) in enumerate(zip(starts, [*starts[1:], float("inf")])):
            in_step = [e for e in events if begin <= e["ts"] < end]
            for j in range(1, 4):  # the MoE layers
                mine = [e for e in in_step if e["args"]["layer"] == j]
                assert sum(e["name"] == "load_weight" for e in mine) == 1, step
                assert sum(e["name"] == "compute" for e in mine) == 3  # attention per batch
                loads = Counter(e["args"]["expert"] for e in mine if e["name"] == "load_expert")
                runs = Counter(e["args"]["expert"] for e in mine if e["name"] == "expert")
                assert max(runs.values()) == 1  # each expert once for the whole block
                if loads:  # loaded once routed: exactly the experts with rows
                    assert loads == runs, (step, j)
                    routed.append(len(runs))
                kinds["routed" if loads else "with the layer"] += 1
        # decode blocks route to few experts; prefill ones to nearly all: loaded with the layer
        assert kinds["routed"] > 0 and kinds["with the layer"] > 0, kinds
        assert min(routed) < 8  # some block left experts out, and they were not loaded
        overlap_hits = 0
        for run_ in (e for e in events if e["name"] == "expert"):
            overlap_hits += any(
                e["name"] == "load_expert"
                and e["args"]["layer"] == run_["args"]["layer"]
                and e["args"]["expert"] != run_["args"]["expert"]
                and e["ts"] < run_["ts"] + run_["dur"]
                and run_["ts"] < e["ts"] + e["dur"]
                for e in events
            )
        hits[overlap] = (overlapping(events, "load_weight")[0], overlap_hits)
    assert hits[True][0] > 0 and hits[True][1] > 0 and hits[False] == (0, 0), hits


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe"])
def test_experts_homed_on_the_cpu_run_there_when_few_rows_reach_them(
    tiny_model, references, tmp_path, kind
):
    """Experts homed in host memory, cpu_experts on: an expert that at most `cpu_expert_rows`
    rows of a block route to runs on the CPU where it lies (a cpu_expert span, no load); one
    with more is loaded and run on the compute device. Every expert on the CPU, none, and a
    threshold between (both kinds in one run), and cpu_experts off (the switch: never, however
    high the threshold) all give transformers' tokens."""
    from engine import LLM, SamplingParams

    prompts, expected = references(kind)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    cases = [(True, 10**6), (True, 0), (True, 2), (False, 10**6)]
    for cpu_experts, rows in cases:
        path = tmp_path / f"trace-{cpu_experts}-{rows}.json"
        policy = Policy(
            experts_frac=(0.0, 1.0, 0.0),
            cpu_experts=cpu_experts,
            gpu_batch_size=2,
            num_gpu_batches=3,
        )
        with LLM(
            str(tiny_model(kind)),
            policy=policy,
            device="cpu",
            trace=str(path),
            cpu_expert_rows=rows,
        ) as llm:
            got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        assert got == expected, (cpu_experts, rows)
        events = [e for e in json.loads(path.read_text())["traceEvents"] if e["ph"] == "X"]
        on_cpu = sum(e["name"] == "cpu_expert" for e in events)
        on_device = sum(e["name"] == "expert" for e in events)
        loaded = sum(e["name"] == "load_expert" for e in events)
        if not cpu_experts or rows == 0:
            assert on_cpu == 0 and on_device > 0, (cpu_experts, rows)
        elif rows == 10**6:
            assert on_cpu > 0 and on_device == loaded == 0
        else:
            assert on_cpu > 0 and on_device > 0 and loaded > 0


def test_grouping_per_expert_off_routes_each_gpu_batch_alone(tiny_model, references, tmp_path):
    """The ablation's switch: group_experts off, each GPU batch's rows are routed and grouped
    alone, the layer's experts loaded with it (no expert loads or expert spans of their own
    in the trace); tokens as transformers'."""
    from engine import LLM, SamplingParams

    prompts, expected = references("mixtral")
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    path = tmp_path / "trace.json"
    policy = Policy(experts_frac=(0.0, 0.0, 1.0), gpu_batch_size=2, num_gpu_batches=3)
    with LLM(
        str(tiny_model("mixtral")),
        policy=policy,
        device="cpu",
        trace=str(path),
        group_experts=False,
    ) as llm:
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == expected
    names = {e["name"] for e in json.loads(path.read_text())["traceEvents"] if e["ph"] == "X"}
    assert "load_weight" in names and not names & {"expert", "load_expert", "cpu_expert"}

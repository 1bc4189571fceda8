"""GLM-4.5 and DeepSeek-V3 (its latent attention: engine/models/deepseek.py): sigmoid scores
with a load-balancing correction, top-k within the best groups of experts, weights
renormalised and scaled, a shared expert beside the routed ones and dense first layers.
Greedy tokens equal transformers' with experts and KV on every tier, logits equal its full
forward pass, the router equals transformers' bit for bit (ties included), MLA's pages hold
the latent once (its value is its key) on every tier, through the prefix cache's spill,
nano-batches and preemption, and the multi-token prediction layer the checkpoints carry is
not read."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace

import pytest
import torch

from engine import LLM, SamplingParams
from engine.models.moe import route_grouped
from policy import Policy
from tests.engine.executor.test_correctness import PLACEMENTS, run
from tests.engine.executor.test_family_features import _prompts, _score, _with_config
from tests.engine.executor.test_moe import MOE_PLACEMENTS
from tests.engine.executor.test_prefix_caching import (
    assert_cached_prefixes_give_transformers_tokens,
    assert_spilled_to_disk_and_loaded_back,
)
from tests.engine.tiny_models import GROUPED_MOE_FAMILIES, MAX_TOKENS, hf_greedy, random_prompts

DEFAULT_PLACEMENTS = (
    "all-on-device",
    "experts-cpu",
    "experts-disk",
    "experts-split-3",
    "kv-act-mixed",
)


def _placements() -> list[object]:
    slow = [
        "weights-cpu",
        "weights-disk",
        "three-gpu-batches",
        "kv-act-disk",
        "kv-cpu-cpu-attention",
    ]
    return [*DEFAULT_PLACEMENTS, *(pytest.param(p, marks=pytest.mark.slow) for p in slow)]


@pytest.mark.parametrize("placement", _placements())
@pytest.mark.parametrize("kind", GROUPED_MOE_FAMILIES)
def test_matches_transformers(tiny_model, references, tmp_path, kind, placement):
    prompts, expected = references(kind)
    policy = Policy(**{**MOE_PLACEMENTS, **PLACEMENTS}[placement])  # type: ignore[arg-type]
    assert run(tiny_model(kind), prompts, policy, tmp_path) == expected


@pytest.mark.parametrize("kind", GROUPED_MOE_FAMILIES)
def test_logits_equal_transformers_and_routing_varies(tiny_model, kind):
    """Teacher-forced against transformers' full forward pass; in every MoE layer the tokens of
    each prompt pick several different expert sets, so a wrong group, correction or order
    would show."""
    from transformers import AutoModelForCausalLM

    prompts = _prompts(kind)
    model = AutoModelForCausalLM.from_pretrained(tiny_model(kind), dtype=torch.float32)
    routers = [layer.mlp.gate for layer in model.model.layers if hasattr(layer.mlp, "gate")]
    assert routers
    picked: list[set[tuple[int, ...]]] = []  # per router call, the expert sets its rows chose
    hooks = [
        r.register_forward_hook(
            lambda _m, _i, out: picked.append({tuple(sorted(x)) for x in out[2].tolist()})
        )
        for r in routers
    ]
    for prompt, got in zip(prompts, _score(tiny_model(kind), prompts), strict=True):
        picked.clear()
        with torch.no_grad():
            want = model(torch.tensor([prompt])).logits[0]
        torch.testing.assert_close(got, want, rtol=0, atol=2e-5)
        assert len(picked) == len(routers) and all(len(sets) >= 4 for sets in picked)
    for hook in hooks:
        hook.remove()


@pytest.mark.parametrize("kind", GROUPED_MOE_FAMILIES)
def test_cached_prefixes_give_transformers_tokens(tiny_model, kind):
    policy = Policy(experts_frac=(0.0, 1.0, 0.0))
    assert_cached_prefixes_give_transformers_tokens(tiny_model(kind), kind, policy)


@pytest.mark.parametrize("family", ["glm4_moe", "deepseek_v3"])
def test_router_equals_transformers(family):
    """route_grouped against transformers' router module of each family: 32 experts in 8
    groups, top-6 from the best 3 groups, a random correction, renormalised or not, scaled;
    near-ties (two experts with the same router row, so equal scores) included. Ids and
    weights bit for bit (both take top-k with sorted=False, in the same order on one
    device); the groups change some rows' choice against a plain top-k."""
    from transformers import AutoConfig

    if family == "glm4_moe":
        from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter as Router
    else:
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
            DeepseekV3TopkRouter as Router,
        )
    torch.manual_seed(0)
    hidden, num_experts = 16, 32
    weight = torch.randn(num_experts, hidden)
    weight[9] = weight[3]
    correction = torch.randn(num_experts) * 0.1
    x = torch.randn(64, hidden)
    for norm in (True, False):
        config = AutoConfig.for_model(
            family,
            hidden_size=hidden,
            n_routed_experts=num_experts,
            num_experts_per_tok=6,
            n_group=8,
            topk_group=3,
            norm_topk_prob=norm,
            routed_scaling_factor=2.5,
        )
        router = Router(config)
        with torch.no_grad():
            router.weight.copy_(weight)
            router.e_score_correction_bias.copy_(correction)
            _, want_weights, want_ids = router(x)
        logits = torch.nn.functional.linear(x, weight)
        got_weights, got_ids = route_grouped(logits, correction, 6, 8, 3, norm, 2.5)
        assert torch.equal(got_ids, want_ids)
        assert torch.equal(got_weights, want_weights)
        groups = (got_ids // 4).tolist()  # every row's experts come from at most 3 groups
        assert all(len(set(row)) <= 3 for row in groups)
        ungrouped = (logits.sigmoid() + correction).topk(6).indices  # what groups changed
        assert any(set(a) != set(b) for a, b in zip(got_ids.tolist(), ungrouped.tolist()))


def test_mla_pages_hold_the_latent_once(tiny_model, references, tmp_path):
    """DeepSeek-V3's KV row is the latent and the rotary key, kv_lora_rank + qk_rope_head_dim
    wide, stored once (its value is its key: `values_are_keys`): 40 float32 values per token
    and layer here, where key and value would take 2 x 40 and per-head keys and values 4
    heads x (16 + 8 + 12) = 144. The pools of every tier (gpu, cpu and the disk files) hold
    rows of that width and count those bytes; the cost model prices the same row, half what
    it priced as key and value."""
    from policy.catalog import resolve_model_spec

    model_dir = tiny_model("deepseek_v3")
    row_bytes = (32 + 8) * 4  # float32
    policy = Policy(**{**MOE_PLACEMENTS, **PLACEMENTS}["kv-act-mixed"])  # type: ignore[arg-type]
    prompts, expected = references("deepseek_v3")
    with LLM(str(model_dir), policy=policy, device="cpu", offload_dir=tmp_path) as llm:
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == expected
        kv = llm.executor.kv
        assert kv.codec.row_dim == 32 + 8 and kv.row_bytes == row_bytes
        assert kv.num_pages["gpu"] and kv.num_pages["cpu"] and kv.num_pages["disk"]
        for tier in ("gpu", "cpu"):
            pool = kv.pool(tier, 0)
            assert pool.shape == (kv.num_pages[tier] * kv.page_tokens, row_bytes)
        assert kv.disk_pool.row_bytes == row_bytes
        written = sorted(tmp_path.glob("kv-*.bin"))
        assert len(written) == len(llm.executor.config.kv_layers)
        assert all(f.stat().st_size % (kv.page_tokens * row_bytes) == 0 for f in written)
        per_page = kv.page_tokens * row_bytes * len(written)
        assert kv.page_bytes == per_page
        assert kv.bytes_per_tier()["gpu"] == kv.num_pages["gpu"] * per_page
    spec = resolve_model_spec(str(model_dir))
    assert spec.values_are_keys and spec.kv_bytes_per_token_per_layer == (32 + 8) * spec.dtype_bytes
    as_key_and_value = replace(spec, values_are_keys=False)
    assert 2 * spec.kv_bytes_per_token_per_layer == as_key_and_value.kv_bytes_per_token_per_layer


@pytest.mark.parametrize(
    "placement", ["kv-cpu-cpu-attention", "kv-cpu-no-cpu-attention", "kv-act-disk"]
)
def test_mla_latent_once_on_every_kv_tier(tiny_model, references, tmp_path, placement):
    """DeepSeek-V3's latent rows homed on the cpu tier (attended there, or copied to the
    compute device) and on disk: transformers' tokens."""
    prompts, expected = references("deepseek_v3")
    policy = Policy(**{**MOE_PLACEMENTS, **PLACEMENTS}[placement])  # type: ignore[arg-type]
    assert run(tiny_model("deepseek_v3"), prompts, policy, tmp_path) == expected


@pytest.mark.parametrize("placement", ["resident", "offloaded-cpu-attention"])
def test_mla_latent_once_through_nano_batches(tiny_model, references, tmp_path, placement):
    """DeepSeek-V3's GPU batches cut into nano-batches (their past read packed, the device's
    and the CPU's attention apart): transformers' tokens, the nano-batched path taken."""
    from tests.engine.executor import test_nano_batches as nano

    prompts, expected = references("deepseek_v3")
    policy = Policy(**nano.SHAPE, **nano.PLACEMENTS[placement], num_nano_batches=2)
    tokens, layers_run = nano.run(tiny_model("deepseek_v3"), prompts, policy, tmp_path)
    assert tokens == expected and layers_run > 0


def test_mla_latent_spills_to_transformers_tokens(tiny_model, tmp_path):
    """DeepSeek-V3's latent pages through the prefix cache's spill to cpu and disk files and
    back: transformers' tokens."""
    model_dir, policy = tiny_model("deepseek_v3"), Policy(experts_frac=(0.0, 1.0, 0.0))
    assert_spilled_to_disk_and_loaded_back(model_dir, "deepseek_v3", policy, tmp_path)


@pytest.mark.slow  # 16 ragged requests and transformers' tokens for each: about 25 s
def test_mla_latent_preempts_to_transformers_tokens(tiny_model, tmp_path):
    """DeepSeek-V3's latent pages under preemption: a pool too small for the block, its
    newest sequence dropped and recomputed, transformers' tokens still."""
    model_dir, vocab = tiny_model("deepseek_v3"), 290
    ragged = random_prompts(16, vocab, 2, 60, seed=3)
    lengths = torch.randint(1, 25, (16,), generator=torch.Generator().manual_seed(4)).tolist()
    with LLM(
        str(model_dir),
        policy=Policy(gpu_batch_size=4, num_gpu_batches=2, experts_frac=(0.0, 1.0, 0.0)),
        device="cpu",
        offload_dir=tmp_path,
        kv_capacity_pages={"gpu": 8},  # the longest sequence, not 8 running ones
        async_scheduling=False,  # deterministic step order, so the preemption surely happens
    ) as llm:
        scheduler = llm.scheduler
        scheduler.config = replace(scheduler.config, expected_gen_tokens=1)
        params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths]
        out = llm.generate(ragged, params)
        assert scheduler.num_preemptions > 0, "the small KV pool should have forced preemption"
    want = [hf_greedy(model_dir, p, n) for p, n in zip(ragged, lengths, strict=True)]
    assert [o.outputs[0].token_ids for o in out] == want


def test_kimi_k2_checkpoint_runs_as_deepseek_v3(tiny_model, references, tmp_path):
    """Kimi K2 ships DeepSeek-V3's architecture under model type `kimi_k2` (its config and
    modeling classes as remote code in `auto_map`): read with DeepSeek-V3's config class, a
    checkpoint saved so gives transformers' DeepSeek-V3 tokens on the same weights."""
    source = tiny_model("deepseek_v3")
    kimi = tmp_path / "kimi"
    shutil.copytree(source, kimi)
    config = json.loads((kimi / "config.json").read_text())
    config["model_type"] = "kimi_k2"
    config["auto_map"] = {"AutoConfig": "configuration_deepseek.DeepseekV3Config"}
    (kimi / "config.json").write_text(json.dumps(config))
    prompts, expected = references("deepseek_v3")
    assert run(kimi, prompts, Policy(experts_frac=(0.0, 1.0, 0.0)), tmp_path) == expected


def test_multi_token_prediction_layer_is_not_read(tiny_model, references, tmp_path):
    """GLM-4.5 and DeepSeek-V3 checkpoints carry one more layer after the last (their
    multi-token prediction module, `model.layers.<L>.*`, with its own experts and extra
    projections) that transformers does not load; nanoflex does not read it either."""
    from safetensors.torch import load_file, save_file

    source = tiny_model("glm4_moe")
    copy = tmp_path / "with-mtp"
    shutil.copytree(source, copy)
    num_layers = json.loads((copy / "config.json").read_text())["num_hidden_layers"]
    state = load_file(str(copy / "model.safetensors"))
    last = num_layers - 1
    extra = {
        k.replace(f"layers.{last}.", f"layers.{num_layers}."): v.clone()
        for k, v in state.items()
        if f"layers.{last}." in k
    }
    extra[f"model.layers.{num_layers}.eh_proj.weight"] = torch.randn(64, 128)
    save_file({**state, **extra}, str(copy / "model.safetensors"))
    prompts, expected = references("glm4_moe")
    assert run(copy, prompts, Policy(experts_frac=(0.0, 0.0, 1.0)), tmp_path) == expected


FEATURES = [
    ("glm4_moe", "routed_scaling_factor", 1.0),
    ("deepseek_v3", "rope_interleave", False),
    ("glm4_moe", "topk_group", 4),
    ("glm4_moe", "norm_topk_prob", False),
    ("deepseek_v3", "rope_parameters.mscale_all_dim", 0.0),
    ("deepseek_v3", "topk_group", 4),
]
"""(kind, config field (dotted: inside a dict), a value that changes the routing, the
rotary or the attention's scale)."""


@pytest.mark.parametrize(
    ("kind", "field", "value"),
    [*FEATURES[:2], *(pytest.param(*f, marks=pytest.mark.slow) for f in FEATURES[2:])],
)
def test_each_routing_setting_changes_transformers_tokens(
    tiny_model, references, tmp_path, kind, field, value
):
    """The settings the model reads change transformers' own tokens on the test prompts, and
    ours follow them."""
    prompts, expected = references(kind)
    changed = _with_config(tiny_model(kind), tmp_path / "changed", field, value)
    theirs = [hf_greedy(changed, p, MAX_TOKENS) for p in prompts]
    assert theirs != expected
    assert run(changed, prompts, Policy(), tmp_path) == theirs

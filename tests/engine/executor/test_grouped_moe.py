"""GLM-4.5 and DeepSeek-V3 (its latent attention: engine/models/deepseek.py): sigmoid scores
with a load-balancing correction, top-k within the best groups of experts, weights
renormalised and scaled, a shared expert beside the routed ones and dense first layers.
Greedy tokens equal transformers' with experts and KV on every tier, logits equal its full
forward pass, the router equals transformers' bit for bit (ties included), MLA's pages hold
the latent, and the multi-token prediction layer the checkpoints carry is not read."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from engine.models.moe import route_grouped
from policy import Policy
from tests.engine.executor.test_correctness import PLACEMENTS, run
from tests.engine.executor.test_family_features import _prompts, _score, _with_config
from tests.engine.executor.test_moe import MOE_PLACEMENTS
from tests.engine.executor.test_prefix_caching import (
    assert_cached_prefixes_give_transformers_tokens,
)
from tests.engine.tiny_models import GROUPED_MOE_FAMILIES, MAX_TOKENS, hf_greedy

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


def test_mla_pages_hold_the_latent(tiny_model):
    """DeepSeek-V3's KV row is the latent and the rotary key, kv_lora_rank + qk_rope_head_dim
    wide, as key and as value (2 x 40 elements per token and layer here, where per-head keys
    and values would take 4 heads x (16 + 8 + 12) = 144); the cost model prices the same
    row."""
    from engine.executor.executor import Executor
    from policy.catalog import resolve_model_spec

    model_dir = tiny_model("deepseek_v3")
    executor = Executor(str(model_dir), Policy(), device="cpu")
    try:
        assert executor.kv.row_bytes == 2 * (32 + 8) * 4  # float32
    finally:
        executor.close()
    spec = resolve_model_spec(str(model_dir))
    assert spec.kv_bytes_per_token_per_layer == 2 * (32 + 8) * spec.dtype_bytes


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

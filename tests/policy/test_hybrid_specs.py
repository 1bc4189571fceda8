"""Hybrids in the cost model: parameter counts and state sizes equal transformers' models and the
engine's slots, the built-in shapes the published sizes, and the state terms of the cost model
(bytes homed per tier, PCIe copies, compute) by hand."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import pytest

from policy import FLEXGEN_T4, Policy
from policy.affine import VARS, Affine
from policy.catalog import BUILTIN_MODELS, resolve_model_spec
from policy.cost_model import CostTerms, build_terms, hardware_budgets
from policy.errors import ModelSpecError
from policy.prefix import load_seconds
from policy.specs import ModelSpec, WorkloadSpec
from policy.state_cost import state_bytes_per_tier, state_terms
from tests.engine.tiny_models import HYBRIDS, TINY_CONFIGS

MiB = 1 << 20


def _tiny(kind: str, dtype: str = "bfloat16") -> ModelSpec:
    return ModelSpec.from_hf_config({**TINY_CONFIGS[kind], "torch_dtype": dtype}, name=kind)


UNPRICED = {
    "falcon_h1": "falcon_h1",
    "falcon_h1-plain": "falcon_h1",
    "nemotron_h-moe": "moe",
    "nemotron_h-latent": "moe",
}
"""The tiny hybrids the planner refuses, each with what its refusal names: Falcon-H1 (attention
and Mamba-2 side by side in a layer) and Nemotron-H's MoE layers are not priced."""
PRICED = [kind for kind in HYBRIDS if kind not in UNPRICED]


@pytest.mark.parametrize("kind", UNPRICED)
def test_the_unpriced_hybrids_are_refused_by_name(kind: str) -> None:
    """`--policy auto` and `nanoflex plan` refuse them in one line naming what is not priced
    (the engine runs them under a policy file)."""
    with pytest.raises(ModelSpecError, match=UNPRICED[kind]):
        _tiny(kind, "float32")


@pytest.mark.parametrize("kind", PRICED)
def test_parameters_and_states_equal_transformers_and_the_engine(kind: str) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from engine.models.config import ModelConfig

    spec: dict[str, Any] = dict(TINY_CONFIGS[kind])
    config = AutoConfig.for_model(spec.pop("model_type"), pad_token_id=0, **spec)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    ours = ModelSpec.from_hf_config({**config.to_dict(), "torch_dtype": "float32"})
    assert ours.total_params == sum(p.numel() for p in model.parameters())
    engine = ModelConfig.from_hf(config)  # as the engine reads it
    assert ours.state_layer_ids == engine.state_layers
    assert ours.num_kv_layers == len(engine.kv_layers)
    assert ours.state_bytes_per_sequence == engine.state_bytes(4)  # what a slot holds


def test_granite_state_and_kv_by_hand() -> None:
    """The tiny Granite 4 hybrid in bfloat16: 3 Mamba-2 layers of 8 heads of 16, a state of 8
    in 2 groups, kernel 4; one attention layer of 2 KV heads of 16."""
    model = _tiny("granite4")
    conv_channels = 8 * 16 + 2 * 2 * 8  # x, then B and C per group
    per_layer = conv_channels * 3 * 2 + 8 * 16 * 8 * 4  # window (bf16) + recurrent (fp32)
    assert (model.num_state_layers, model.num_kv_layers) == (3, 1)
    assert model.state_bytes_per_layer == per_layer == 5056
    assert model.state_bytes_per_sequence == 3 * 5056
    assert model.kv_bytes_per_token == 1 * 2 * (2 * 16) * 2  # one attention layer's k and v


@pytest.mark.parametrize(
    ("name", "billions", "state_bytes", "kv_layers"),
    [
        # 36 Gated DeltaNet layers: q, k, v windows (2 x 16 x 128 + 32 x 128) x 3 in bf16,
        # 32 value heads x 128 x 128 in fp32
        ("qwen3-next-80b-a3b", 79.67, 36 * (8192 * 3 * 2 + 32 * 128 * 128 * 4), 12),
        ("qwen3.5-397b-a17b", 396.35, 45 * (12288 * 3 * 2 + 64 * 128 * 128 * 4), 15),
        # 36 Mamba-2 layers: x, B, C windows (8192 + 2 x 128) x 3, 128 heads x 64 x 128
        ("granite-4.0-h-small", 32.21, 36 * (8448 * 3 * 2 + 128 * 64 * 128 * 4), 4),
        ("nemotron-h-56b", 56.32, 54 * (20480 * 3 * 2 + 256 * 64 * 256 * 4), 10),
        ("nemotron-h-47b", 46.79, 45 * (20480 * 3 * 2 + 256 * 64 * 256 * 4), 5),
    ],
)
def test_builtin_hybrids_match_published_sizes(name, billions, state_bytes, kv_layers) -> None:
    model = BUILTIN_MODELS[name]
    assert model.total_params / 1e9 == pytest.approx(billions, abs=0.01)
    assert model.state_bytes_per_sequence == state_bytes
    assert model.num_kv_layers == kv_layers


def test_qwen3_next_state_is_as_documented() -> None:
    model = BUILTIN_MODELS["qwen3-next-80b-a3b"]
    assert model.state_bytes_per_sequence / MiB == pytest.approx(73.7, abs=0.05)
    assert model.state_bytes_per_sequence // model.kv_bytes_per_token == 3144


def test_hub_ids_and_vision_wrappers_name_the_hybrids() -> None:
    assert resolve_model_spec("Qwen/Qwen3-Next-80B-A3B-Instruct").name == "qwen3-next-80b-a3b"
    assert resolve_model_spec("ibm-granite/granite-4.0-h-small").name == "granite-4.0-h-small"
    assert resolve_model_spec("nvidia/Nemotron-H-56B-Base-8K").name == "nemotron-h-56b"
    text = {**TINY_CONFIGS["qwen3_5_moe"], "torch_dtype": "bfloat16"}
    wrapped = ModelSpec.from_hf_config({"model_type": "qwen3_5_moe", "text_config": text})
    assert wrapped.total_params == ModelSpec.from_hf_config(text).total_params


def test_layer_kinds_are_read_in_every_spelling_and_moe_layers_refused() -> None:
    nemotron: dict[str, Any] = dict(TINY_CONFIGS["nemotron_h"])
    kinds: list[str] = nemotron.pop("layers_block_type")
    letters = "".join(
        {"linear_attention": "M", "full_attention": "*", "mlp": "-"}[k] for k in kinds
    )
    assert ModelSpec.from_hf_config(
        {**nemotron, "hybrid_override_pattern": letters}
    ) == ModelSpec.from_hf_config({**nemotron, "layers_block_type": kinds})
    granite: dict[str, Any] = dict(TINY_CONFIGS["granite4"])
    words = ["mamba" if k == "linear_attention" else "attention" for k in granite["layer_types"]]
    read = ModelSpec.from_hf_config
    assert read({**granite, "layer_types": words}) == read(granite)
    with pytest.raises(ModelSpecError, match=r"layer kinds \['moe'\] are not priced"):
        ModelSpec.from_hf_config({**nemotron, "layers_block_type": [*kinds[:-1], "moe"]})


WORKLOAD = WorkloadSpec(prompt_len=32, gen_len=8)


def _terms(model: ModelSpec, policy: Policy) -> CostTerms:
    return build_terms(model, WORKLOAD, FLEXGEN_T4, policy, hardware_budgets(FLEXGEN_T4))


def _coeff(affine: Affine, var: str) -> float:
    return float(affine.coeffs[VARS.index(var)])


def test_state_terms_by_hand() -> None:
    """8 sequences of the tiny Granite 4 hybrid: each keeps 15,168 B of state, homed with its
    KV (gpu) or in host memory (cpu, disk); every decode step and every prefill reads and
    writes it, so host-homed states cross PCIe both ways; KV only in the attention layer."""
    model, bls, layers = _tiny("granite4"), 8, 4
    state, hw = 3 * 5056, FLEXGEN_T4
    policy = Policy(gpu_batch_size=4, num_gpu_batches=2, kv_frac=(0.5, 0.25, 0.25))
    terms = _terms(model, policy)
    kv_home = bls * (32 + 8) * 128  # every token's KV, one attention layer
    # homed: gpu-tier sequences' states on the gpu, cpu- and disk-tier ones' in host memory
    assert _coeff(terms.memory["gpu_decode"], "cg") == pytest.approx(kv_home + bls * state)
    assert _coeff(terms.memory["cpu_decode"], "cd") == pytest.approx(bls * state + 2 * 4 * 40 * 128)
    assert _coeff(terms.memory["disk"], "cd") == pytest.approx(kv_home)  # no states on disk
    assert state_bytes_per_tier(model, policy) == {"gpu": 4 * state, "cpu": 4 * state, "disk": 0}
    # per layer (averaged over the 4): the copies carry the new KV of one layer of 4 and the
    # old KV it reads; the states cross PCIe both ways too, in line with the layer (serial
    # compute, beside attention's share of it)
    kv_new, kv_read = bls * 128 / layers, bls * (32 + 4) * 128 / layers
    assert _coeff(terms.decode["gtoc"].rows[0], "cc") * hw.gtoc_bw == pytest.approx(kv_new)
    assert _coeff(terms.decode["ctog"].rows[0], "cd") * hw.ctog_bw == pytest.approx(kv_read)
    round_trip = bls * state / layers * (1 / hw.ctog_bw + 1 / hw.gtoc_bw)
    for stage in (terms.decode, terms.prefill):
        serial = stage["compute"].rows[0]
        attention = (
            _coeff(terms.compute_parts["gpu_attention"], "cc") if stage is terms.decode else 0
        )
        for var in ("cc", "cd"):
            assert _coeff(serial, var) - attention == pytest.approx(round_trip)
    assert _coeff(terms.decode["compute"].rows[0], "cg") == pytest.approx(
        _coeff(terms.compute_parts["gpu_attention"], "cg")
    )  # gpu-homed states stay put


def test_state_compute_by_hand() -> None:
    """A decode's recurrent step reads and writes each state on the compute device, bound by
    the larger of its FLOPs and those bytes, in 3 of the 4 layers; a prompt's chunked scan
    keeps a state per chunk of 16."""
    model, hw = _tiny("granite4"), FLEXGEN_T4
    shape = model.state
    assert shape is not None
    flops = 2 * 160 * 4 + 8 * (8 * 16 * 8)  # convolution step + 8 per state element
    assert shape.decode_flops == flops
    found = state_terms(model, hw, 8, 32)
    one = max(flops / hw.gpu_bmm_flops, 2 * 5056 / hw.gpu_mem_bw_estimate)
    assert found.decode_seconds == pytest.approx(0.75 * 8 * one)
    chunks = math.ceil(32 / 16) + 1
    assert found.prefill_workspace == 32 * 2 * 160 * 2 + chunks * 8 * 16 * 8 * 4
    # the step's compute carries it: a state twice the size costs the difference, no more
    policy = Policy(gpu_batch_size=8, num_gpu_batches=1)
    bigger = dataclasses.replace(model, state=dataclasses.replace(shape, heads=16))
    added = state_terms(bigger, hw, 8, 32).decode_seconds - found.decode_seconds
    parts = [_terms(m, policy).compute_parts["gpu_compute"].const for m in (model, bigger)]
    assert parts[1] - parts[0] == pytest.approx(added)


def test_plan_command_reports_the_states(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`nanoflex plan` for a hybrid checkpoint's config: the report puts the state per sequence
    beside the KV per token and the states' share of each tier's peak; --json has them."""
    from server.cli import main

    hardware = tmp_path / "hardware.json"
    FLEXGEN_T4.save(hardware)
    model_dir = tmp_path / "nemotron"
    model_dir.mkdir()
    config = {**TINY_CONFIGS["nemotron_h"], "torch_dtype": "float32"}
    (model_dir / "config.json").write_text(json.dumps(config))
    argv = ["plan", "--model", str(model_dir), "--hardware", str(hardware), "--gpu-mem", "16MiB"]
    assert main(argv) == 0
    report = capsys.readouterr().out
    assert "of KV per token in 1 of 5 layers; 11.8 KiB of state per sequence in 2" in report
    assert "recomputed from (with the state saved at its end)" in report
    assert main([*argv, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    model, policy = resolve_model_spec(str(model_dir)), Policy.from_dict(out["policy"])
    states = out["states"]
    assert states["state_bytes_per_sequence"] == model.state_bytes_per_sequence == 12032
    assert states["state_bytes"] == pytest.approx(state_bytes_per_tier(model, policy))
    # a hit copies one saved state besides its KV: no shorter hit beats recomputing it
    assert set(out["prefix_break_even_tokens"]) == {"gpu", "cpu", "disk"}
    state_seconds = model.state_bytes_per_sequence / FLEXGEN_T4.ctog_bw
    assert load_seconds(16, "gpu", model, FLEXGEN_T4, False) == pytest.approx(state_seconds)

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


@pytest.mark.parametrize("kind", HYBRIDS)
def test_parameters_and_states_equal_transformers_and_the_engine(kind: str) -> None:
    """Every tiny hybrid (Falcon-H1's parallel layers and Nemotron 3's MoE layers, latent or
    not, included): the parameters transformers builds, the layers the engine keeps states
    and KV pages for, a slot's bytes, and the MoE layers and their experts as both hold them."""
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
    assert ours.is_moe == engine.is_moe and ours.parallel_hybrid == engine.parallel_hybrid
    if ours.is_moe:
        moe_layers = tuple(i for i in range(engine.num_layers) if engine.is_moe_layer(i))
        assert ours.moe_layer_ids == moe_layers
        assert ours.num_experts == engine.num_experts
        experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
        assert ours.total_expert_params == experts


@pytest.mark.parametrize(
    ("kind", "flags"),
    [
        ("nemotron_h-latent", dict(use_bias=True, mlp_bias=True, use_conv_bias=False)),
        ("falcon_h1", dict(mamba_proj_bias=True, projectors_bias=False, mlp_bias=True)),
        ("falcon_h1", dict(mamba_d_ssm=None, mamba_n_heads=8, mamba_d_head="auto")),
    ],
)
def test_bias_and_width_flags_count_as_transformers_builds_them(
    kind: str, flags: dict[str, Any]
) -> None:
    """Each family's own names for the mixer's, MLPs' and latent projections' biases, and
    Falcon-H1's mixer width from mamba_expand with an 'auto' head width."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    spec: dict[str, Any] = {**TINY_CONFIGS[kind], **flags}
    config = AutoConfig.for_model(spec.pop("model_type"), pad_token_id=0, **spec)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    ours = ModelSpec.from_hf_config({**TINY_CONFIGS[kind], **flags})
    assert ours.total_params == sum(p.numel() for p in model.parameters())


def test_falcon_h1_has_kv_and_a_state_in_every_layer_by_hand() -> None:
    """The tiny Falcon-H1 in bfloat16: each of its 3 layers keeps the KV of 2 heads of 24 per
    token and a Mamba-2 state of 6 heads of 16 x a state of 8 (2 groups), kernel 4, per
    sequence; its mixer beside attention (biases on q, k, v, o and out_proj), one MLP."""
    model = _tiny("falcon_h1")
    assert model.parallel_hybrid and model.state_layer_ids == (0, 1, 2)
    assert (model.num_kv_layers, model.kv_layer_share, model.state_layer_share) == (3, 1.0, 1.0)
    assert model.kv_bytes_per_token == 3 * 2 * (2 * 24) * 2
    conv_channels = 6 * 16 + 2 * 2 * 8
    assert model.state_bytes_per_layer == conv_channels * 3 * 2 + 6 * 16 * 8 * 4
    h, q, kv, inner, f = 64, 4 * 24, 2 * 24, 96, 80
    attention = 2 * h * q + 2 * h * kv + (q + 2 * kv + h) + 2 * h  # + biases and 2 norms
    in_width = inner + conv_channels + 6  # z, x B C, dt
    mixer = h * in_width + conv_channels * 5 + 3 * 6 + inner + inner * h + h  # out_proj bias
    assert model.layer_params == attention + mixer + 3 * h * f


def test_nemotron_moe_layers_by_hand() -> None:
    """The tiny Nemotron 3: 2 MoE layers of 8 squared-ReLU experts (up and down, 24 wide) of
    which 2 per token, beside a shared MLP 40 wide and a router; the latent one's experts run
    over 32 channels between two projections every token runs."""
    model, latent = _tiny("nemotron_h-moe"), _tiny("nemotron_h-latent")
    h = 64
    assert model.moe_layer_ids == (1, 5) and model.num_kv_layers == 1
    assert model.expert_params == 2 * h * 24
    assert model.moe_always_params == 8 * h + 2 * h * 40
    assert latent.expert_params == 2 * 32 * 24
    assert latent.moe_always_params == model.moe_always_params + 2 * h * 32
    assert model.total_params - model.active_params == 2 * 6 * model.expert_params


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
        # 23 Mamba-2 layers: (4096 + 2 x 8 x 128) x 3 windows, 64 heads x 64 x 128
        ("nemotron-3-nano-30b-a3b", 31.58, 23 * (6144 * 3 * 2 + 64 * 64 * 128 * 4), 6),
        # every one of 72 layers: (4096 + 2 x 2 x 256) x 3 windows, 32 heads x 128 x 256
        ("falcon-h1-34b", 33.64, 72 * (5120 * 3 * 2 + 32 * 128 * 256 * 4), 72),
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
    nano = "nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16"
    assert resolve_model_spec(nano).name == "nemotron-3-nano-30b-a3b"
    assert resolve_model_spec("tiiuae/Falcon-H1-34B-Instruct").name == "falcon-h1-34b"
    text = {**TINY_CONFIGS["qwen3_5_moe"], "torch_dtype": "bfloat16"}
    wrapped = ModelSpec.from_hf_config({"model_type": "qwen3_5_moe", "text_config": text})
    assert wrapped.total_params == ModelSpec.from_hf_config(text).total_params


def test_layer_kinds_are_read_in_every_spelling_and_unknown_ones_refused() -> None:
    nemotron: dict[str, Any] = dict(TINY_CONFIGS["nemotron_h-moe"])
    kinds: list[str] = nemotron.pop("layers_block_type")
    letters = "".join(
        {"linear_attention": "M", "full_attention": "*", "mlp": "-", "moe": "E"}[k] for k in kinds
    )
    assert ModelSpec.from_hf_config(
        {**nemotron, "hybrid_override_pattern": letters}
    ) == ModelSpec.from_hf_config({**nemotron, "layers_block_type": kinds})
    granite: dict[str, Any] = dict(TINY_CONFIGS["granite4"])
    words = ["mamba" if k == "linear_attention" else "attention" for k in granite["layer_types"]]
    read = ModelSpec.from_hf_config
    assert read({**granite, "layer_types": words}) == read(granite)
    falcon = dict(TINY_CONFIGS["falcon_h1"])
    assert read({**falcon, "layers_block_type": ["hybrid"] * 3}) == read(falcon)
    with pytest.raises(ModelSpecError, match=r"layer kinds \['sliding'\] are not priced"):
        ModelSpec.from_hf_config({**nemotron, "layers_block_type": [*kinds[:-1], "sliding"]})
    with pytest.raises(ModelSpecError, match=r"falcon_h1: layer kinds \['mamba'\]"):
        read({**falcon, "layers_block_type": ["hybrid", "mamba", "hybrid"]})


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


def test_falcon_h1_terms_price_kv_and_states_in_every_layer() -> None:
    """8 sequences of the tiny Falcon-H1 (3 layers, each with KV and a state): the KV of every
    layer and the state of every layer are homed with the sequence; per layer, a decode reads
    every layer's share of KV, and host-homed states cross PCIe both ways; every layer runs
    its recurrent step."""
    model, bls, layers, hw = _tiny("falcon_h1"), 8, 3, FLEXGEN_T4
    kv_tok, state = 2 * 2 * 24 * 2, 128 * 3 * 2 + 6 * 16 * 8 * 4  # per layer, in bf16
    assert model.kv_bytes_per_token_per_layer == kv_tok and model.state_bytes_per_layer == state
    policy = Policy(gpu_batch_size=4, num_gpu_batches=2, kv_frac=(0.5, 0.25, 0.25))
    terms = _terms(model, policy)
    kv_home = bls * (32 + 8) * kv_tok * layers
    assert _coeff(terms.memory["gpu_decode"], "cg") == pytest.approx(kv_home + bls * layers * state)
    kv_read = bls * (32 + 4) * kv_tok  # one layer's, as a transformer's (kv share 1)
    assert _coeff(terms.decode["ctog"].rows[0], "cd") * hw.ctog_bw == pytest.approx(kv_read)
    found = state_terms(model, hw, bls, 32)
    assert found.host_bytes == pytest.approx(bls * layers * state / layers)
    assert model.state is not None
    one = max(model.state.decode_flops / hw.gpu_bmm_flops, 2 * state / hw.gpu_mem_bw_estimate)
    assert found.decode_seconds == pytest.approx(bls * one)  # every layer a state layer


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
    # float32 as the figures below (on a GPU profile the engine would compute float16)
    argv = ["plan", "--model", str(model_dir), "--hardware", str(hardware), "--gpu-mem", "16MiB"]
    argv += ["--dtype", "float32"]
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


@pytest.mark.parametrize(
    ("kind", "header", "moe_line"),
    [
        (
            "falcon_h1",
            "of KV per token in 3 of 3 layers; 13.5 KiB of state per sequence in 3, "
            "beside attention",
            None,
        ),
        (
            "nemotron_h-moe",
            "of KV per token in 1 of 6 layers; 11.8 KiB of state per sequence in 2",
            "mixture of experts: 8 routed experts in 2 of 6 layers, top-2, 12 KiB each",
        ),
    ],
)
def test_plan_command_reports_falcon_h1_and_nemotron_moe(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], kind: str, header: str, moe_line: str | None
) -> None:
    """`nanoflex plan` plans the parallel hybrid and the MoE hybrid it once refused: KV in
    every Falcon-H1 layer beside its state; Nemotron 3's experts placed per tier and reported
    (--json: `moe` and `states`)."""
    from server.cli import main

    hardware = tmp_path / "hardware.json"
    FLEXGEN_T4.save(hardware)
    model_dir = tmp_path / kind
    model_dir.mkdir()
    (model_dir / "config.json").write_text(
        json.dumps({**TINY_CONFIGS[kind], "torch_dtype": "float32"})
    )
    # float32 as the figures below (on a GPU profile the engine would compute float16)
    argv = ["plan", "--model", str(model_dir), "--hardware", str(hardware), "--gpu-mem", "16MiB"]
    argv += ["--dtype", "float32"]
    assert main(argv) == 0
    report = capsys.readouterr().out
    assert header in report
    assert (moe_line in report) if moe_line else "mixture of experts" not in report
    assert main([*argv, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["states"]["num_kv_layers"] == resolve_model_spec(str(model_dir)).num_kv_layers
    assert ("moe" in out) == (moe_line is not None)

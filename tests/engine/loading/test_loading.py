"""Loading checkpoints: formats, placement reports, budgets and clear errors."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from engine import LLM, SamplingParams
from engine.core.model_files import ModelLoadError
from engine.executor.budgets import MemoryBudgetError
from engine.loading.dummy import DummyReader
from engine.models.hf_config import UnsupportedModelError
from policy import Policy, PolicyError
from tests.engine.tiny_models import build_tiny, hf_greedy


def test_pytorch_bin_checkpoint(tmp_path):
    from safetensors.torch import load_file

    st_dir = build_tiny("llama", tmp_path / "st")
    (tmp_path / "bin").mkdir()
    shutil.copy(st_dir / "config.json", tmp_path / "bin" / "config.json")
    torch.save(load_file(st_dir / "model.safetensors"), tmp_path / "bin" / "pytorch_model.bin")
    prompt = [5, 9, 13, 40, 2, 77]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    with LLM(str(tmp_path / "bin"), policy=Policy(weights_frac=(0, 0.5, 0.5)), device="cpu") as llm:
        got = llm.generate([prompt], params)[0].outputs[0].token_ids
    assert got == hf_greedy(st_dir, prompt, 6)


def test_placement_reports_realized_split(tiny_model, tmp_path):
    policy = Policy(weights_frac=(0.25, 0.25, 0.5))
    with LLM(str(tiny_model("llama")), policy=policy, offload_dir=tmp_path, device="cpu") as llm:
        placement = llm.placement()
        files = sorted(p.name for p in tmp_path.glob("weights-*.bin"))
    realized = placement.realized_weights_frac
    assert placement.planned_weights_frac == (0.25, 0.25, 0.5)
    assert sum(realized) == pytest.approx(1.0) and all(f > 0 for f in realized)
    disk_layers = [j for j, t in enumerate(placement.weight_tiers) if t == "disk"]
    assert files == [f"weights-{j:04d}.bin" for j in disk_layers]  # real files per layer


def test_unsupported_architecture_is_a_clear_error(tmp_path):
    from transformers import GPT2Config

    GPT2Config(n_layer=1, n_embd=16, n_head=2).save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModelError, match="'gpt2' is not supported"):
        LLM(str(tmp_path), policy=Policy(), device="cpu")


def test_missing_model_is_a_clear_error(tmp_path):
    with pytest.raises(ModelLoadError, match="no such directory"):
        LLM(str(tmp_path / "nope" / "model"), policy=Policy(), device="cpu")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match=r"no config\.json"):
        LLM(str(tmp_path / "empty"), policy=Policy(), device="cpu")


def test_gpu_budget_refuses_weights_that_do_not_fit(tiny_model):
    with pytest.raises(MemoryBudgetError, match=r"over the .* budget"):
        LLM(str(tiny_model("llama")), policy=Policy(), device="cpu", gpu_mem=10_000)
    # the same budget is fine once the weights live elsewhere
    with LLM(
        str(tiny_model("llama")),
        policy=Policy(weights_frac=(0, 1, 0)),
        device="cpu",
        gpu_mem=10_000_000,
    ) as llm:
        assert llm.executor.kv_capacity_pages()["gpu"] > 0


def test_policy_json_round_trip(tmp_path):
    policy = Policy(gpu_batch_size=3, kv_frac=(0.2, 0.3, 0.5), cpu_attention=True)
    path = tmp_path / "policy.json"
    path.write_text(policy.to_json())
    assert Policy.load(path) == policy
    assert json.loads(path.read_text())["kv_frac"] == [0.2, 0.3, 0.5]
    with pytest.raises(PolicyError, match="policy must be a JSON object"):
        Policy.from_json("[1, 2]")
    with pytest.raises(PolicyError, match="policy is not valid JSON"):
        Policy.from_json("{gpu_batch_size: 3}")
    with pytest.raises(PolicyError, match="cannot read policy file"):
        Policy.load(tmp_path / "missing.json")
    with pytest.raises(PolicyError, match="unknown policy field"):
        Policy.from_json('{"gpu_batchsize": 3}')


@pytest.mark.parametrize(
    "weights_frac,prepack",
    [((1.0, 0.0, 0.0), False), ((1.0, 0.0, 0.0), True), ((0.0, 0.0, 1.0), True)],
)
def test_tied_embeddings_are_held_once_in_memory(tiny_model, weights_frac, prepack):
    """Llama 3-style tied embeddings: the head uses the embedding's own tensor when both
    live on one memory tier; a head prepacked for the CPU's GEMM is its own copy, counted
    as such; on disk each layer's file keeps its copy."""
    from safetensors import safe_open

    model_dir = tiny_model("llama3")
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        checkpoint = sum(f.get_tensor(n).numel() * 4 for n in f.keys())  # noqa: SIM118
    policy = Policy(weights_frac=weights_frac)
    with LLM(str(model_dir), policy=policy, device="cpu", prepack_weights=prepack) as llm:
        held = sum(llm.placement().weights_bytes.values())
        planned = sum(llm.executor.weights.planned_bytes().values())
        head = llm.executor.weights.layers[-1].values["lm_head.weight"]
        embed = llm.executor.weights.layers[0].values["tok.weight"]
    if weights_frac[0] == 1.0 and not prepack:
        assert held == checkpoint and head is embed
    elif weights_frac[0] == 1.0:
        assert head.is_mkldnn and not embed.is_mkldnn
        assert held == planned == checkpoint + embed.numel() * 4
    else:
        assert held > checkpoint  # the head layer's file has its own copy


def test_a_policy_the_machine_cannot_hold_is_refused_before_loading(
    monkeypatch: pytest.MonkeyPatch,
):
    """OPT-30B's shape with every weight in memory: refused in one line before a single
    tensor is generated, whether the budget or the machine's RAM says no."""
    generated: list[str] = []
    real_get = DummyReader.get

    def get(self: DummyReader, name: str) -> torch.Tensor:
        generated.append(name)
        return real_get(self, name)

    monkeypatch.setattr(DummyReader, "get", get)
    with pytest.raises(MemoryBudgetError, match="over the"):
        LLM("dummy:facebook/opt-30b", policy=Policy(), device="cpu")
    with pytest.raises(MemoryBudgetError, match="RAM is available"):
        LLM("dummy:facebook/opt-30b", policy=Policy(), device="cpu", gpu_mem=2**42)
    assert generated == []  # nothing of the 120 GB was made

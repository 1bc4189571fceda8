"""The comparison's child processes end to end: on the CPU with a tiny shape, and on CUDA."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from bench.gpu import accelerate_run
from bench.gpu.cases import CASES, Case, FlexGenArgs
from bench.gpu.compare import result_path, run_case
from bench.subproc import run_child
from engine import LLM, SamplingParams
from policy import Policy
from policy.hardware import FLEXGEN_T4
from policy.machine import machine_key
from tests.engine.tiny_models import TINY_CONFIGS


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A private nanoflex cache with a hardware profile keyed by this machine, so nothing is
    measured."""
    root = tmp_path / "cache"
    monkeypatch.setenv("NANOFLEX_CACHE", str(root))
    dataclasses.replace(FLEXGEN_T4, machine=machine_key()).save(root / "hardware.json")
    return root


@pytest.fixture
def tiny_opt(tmp_path):
    from transformers import AutoConfig

    spec = dict(TINY_CONFIGS["opt"])
    AutoConfig.for_model(spec.pop("model_type"), eos_token_id=2, **spec).save_pretrained(
        tmp_path / "tiny-opt"
    )
    return tmp_path / "tiny-opt"


def test_accelerate_on_cpu_generates_what_nanoflex_generates(cache, tiny_opt, tmp_path):
    out = tmp_path / "accelerate.json"
    argv = ["--model", str(tiny_opt), "--prompt-len", "12", "--gen-len", "5"]
    assert (
        accelerate_run.main([*argv, "--batch-size", "2", "--device", "cpu", "--json", str(out)])
        == 0
    )
    record = json.loads(out.read_text())
    assert record["ok"] and record["batch_size"] == 2
    m = record["metrics"]
    assert m["num_prompts"] == 2 and m["generation_throughput"] > 0
    assert m["generation_throughput"] == pytest.approx(
        2 * 5 / (m["prefill_seconds"] + m["decode_seconds"])
    )
    prompt = torch.randint(3, 251, (2, 12), generator=torch.Generator().manual_seed(0))[0]
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    with LLM(f"dummy:{tiny_opt}", policy=Policy(), device="cpu") as llm:
        tokens = llm.generate([prompt.tolist()], params)[0].outputs[0].token_ids
    assert tokens == m["first_token_ids"]


def test_flexgen_child_runs_offline_up_to_the_device(tmp_path):
    """Tokenizer (no hub), argument parsing and FlexGen's policy setup all run; without CUDA
    it stops at FlexGen's first CUDA stream and says so in its JSON record."""
    pytest.importorskip("flexgen.flex_opt", reason="flexgen is not installed")
    out = tmp_path / "flexgen.json"
    flexgen = FlexGenArgs.from_policy(Policy(gpu_batch_size=2))
    argv = flexgen.argv("opt-125m", 32, 4, str(tmp_path / "offload"))
    args = ["-m", "bench.gpu.flexgen_run", "--json", str(out), "--", *argv]
    args += ["--log-file", str(tmp_path / "bench.log")]
    child = run_child(args, timeout_s=120, log_path=tmp_path / "log", env={"HF_HUB_OFFLINE": "1"})
    record = json.loads(out.read_text())
    assert not child.timed_out and "from_pretrained" not in child.output
    if torch.cuda.is_available():
        assert record["ok"] and record["metrics"]["generation_throughput"] > 0
    else:
        assert not record["ok"] and "CUDA" in record["error"]


@pytest.mark.slow
def test_run_case_on_cpu_merges_systems_into_one_file(cache, tiny_opt, tmp_path):
    case = Case(
        "tiny",
        str(tiny_opt),
        prompt_len=12,
        gen_len=4,
        gpu_mem=None,
        cpu_mem=1 << 30,
        flexgen=Policy(gpu_batch_size=2, weights_frac=(0.0, 1.0, 0.0)),
        accelerate_batch=2,
        variants=("auto", "flexgen-policy"),
    )
    results = tmp_path / "results"
    run_case(case, systems=("nanoflex",), device="cpu", timeout_s=120, results_dir=results)
    record = run_case(
        case, systems=("flexgen", "accelerate"), device="cpu", timeout_s=120, results_dir=results
    )
    assert json.loads(result_path(case, results).read_text()) == json.loads(
        json.dumps(record, default=str)
    )
    runs = record["runs"]
    assert set(runs) == {"nanoflex:auto", "nanoflex:flexgen-policy", "flexgen", "accelerate"}
    for name in ("nanoflex:auto", "nanoflex:flexgen-policy", "accelerate"):
        assert runs[name]["ok"], runs[name].get("error")
        assert runs[name]["metrics"]["generation_throughput"] > 0
    assert runs["nanoflex:flexgen-policy"]["policy"]["weights_frac"] == [0.0, 1.0, 0.0]
    assert runs["flexgen"]["skipped"]  # a config directory is no OPT name FlexGen knows
    assert set(record["predicted"]) == {"nanoflex:auto", "nanoflex:flexgen-policy"}
    assert record["roofline"]["best"]["bound"] > 0
    assert (results / "logs" / "tiny-nanoflex-auto.log").is_file()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_smoke_case_on_cuda(tmp_path):
    """All three systems on OPT-125M shapes (needs flexgen installed, see docs/benchmarks.md)."""
    pytest.importorskip("flexgen.flex_opt", reason="flexgen is not installed")
    record = run_case(CASES["opt-125m-smoke"], device="cuda", timeout_s=300, results_dir=tmp_path)
    for name, run in record["runs"].items():
        assert run["ok"], f"{name}: {run.get('error')}"

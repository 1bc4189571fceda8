"""`nanoflex plan` through the real argument parser."""

import json
from pathlib import Path

import pytest

import policy.catalog
from policy.hardware import FLEXGEN_T4
from policy.policy import Policy
from server.cli import main


@pytest.fixture
def hardware_file(tmp_path: Path) -> str:
    path = tmp_path / "hardware.json"
    FLEXGEN_T4.save(path)
    return str(path)


def test_plan_json(hardware_file: str, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "--prompt-len", "64", "--gen-len", "8", "--hardware", hardware_file]
    assert main([*argv, "--gpu-mem", "2GiB", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) == {
        "policy",
        "predicted",
        "bottleneck",
        "prefix_break_even_tokens",
        "dtype_bytes",
        "workload",
    }
    assert out["workload"] == {"prompt_len": 64, "gen_len": 8}  # what it was priced for
    assert out["dtype_bytes"] == 2  # a CUDA profile: the checkpoint's half type
    assert set(out["prefix_break_even_tokens"]) == {"gpu", "cpu", "disk"}
    assert set(out["predicted"]) == {
        "prefill_throughput",
        "decode_throughput",
        "generation_throughput",
    }
    assert all(v > 0 for v in out["predicted"].values())
    policy = Policy.from_dict(out["policy"])
    assert out["policy"] == policy.to_dict()
    assert Policy.from_json(json.dumps(out)) == policy  # `--policy FILE` accepts this output


def test_plan_report(hardware_file: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--model", "facebook/opt-13b", "--hardware", hardware_file]) == 0
    report = capsys.readouterr().out
    for needle in ("policy (gpu / cpu / disk):", "predicted throughput", "why:", "bottleneck"):
        assert needle in report


@pytest.mark.parametrize(
    ("hub_id", "first_line"),
    [
        ("Qwen/Qwen3-8B", "qwen3-8b: 8.19B parameters, 15.3 GiB of weights, 144 KiB"),
        pytest.param(  # slow: the Qwen3-8B case plans the family without a download
            "Qwen/Qwen3-32B",
            "qwen3-32b: 32.76B parameters, 61.0 GiB of weights, 256 KiB",
            marks=pytest.mark.slow,
        ),
        (
            "google/gemma-3-12b-it",
            "gemma-3-12b-it: 11.77B parameters, 21.9 GiB of weights, 384 KiB",
        ),
        pytest.param(  # slow: the Gemma-3-12B case plans the family, its window too
            "google/gemma-3-27b-it",
            "gemma-3-27b-it: 27.01B parameters, 50.3 GiB of weights, 496 KiB",
            marks=pytest.mark.slow,
        ),
        (
            "microsoft/Phi-4-mini-instruct",
            "phi-4-mini: 3.84B parameters, 7.1 GiB of weights, 128 KiB",
        ),
    ],
)
def test_plan_knows_the_newer_families_without_a_download(
    hardware_file: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    hub_id: str,
    first_line: str,
) -> None:
    """The common sizes of Qwen 3, Gemma 3 and Phi-4-mini are built in (bf16 weights, KV per
    token, windows); their hub ids never reach the hub."""

    def no_download(name: str) -> None:
        raise AssertionError(f"{name}'s config.json was downloaded")

    monkeypatch.setattr(policy.catalog, "_download_config", no_download)
    assert main(["plan", "--model", hub_id, "--hardware", hardware_file]) == 0
    report = capsys.readouterr().out
    assert report.startswith(f"model {first_line} of KV per token")
    assert ("layers attend over their last 1024 tokens only" in report) == ("gemma" in hub_id)


def test_plan_errors_are_one_line(hardware_file: str, capsys: pytest.CaptureFixture[str]) -> None:
    base = ["plan", "--model", "opt-175b", "--hardware", hardware_file]
    assert main([*base, "--gpu-mem", "1GiB"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("nanoflex plan: error:") and "short by" in err and "\n" not in err
    assert main([*base, "--gpu-mem", "lots"]) == 2
    assert "not a byte size" in capsys.readouterr().err


def test_plan_without_profile_says_to_profile(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("NANOFLEX_CACHE", str(tmp_path))
    assert main(["plan"]) == 2
    assert "nanoflex profile" in capsys.readouterr().err


def test_policy_package_never_imports_torch() -> None:
    import subprocess
    import sys

    code = (
        "import sys, policy, policy.search, policy.plan, policy.threads\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers')]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_cpu_profile_says_cpu_mem_is_unused(
    hardware_file: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """On a profile whose compute device is the CPU, --cpu-mem has no tier: the plan says so
    and names --hardware for a GPU box's profile; a GPU profile plans without the note."""
    cpu_profile = Path(__file__).resolve().parents[1] / "fixtures" / "hardware-cpu.json"
    base = ["plan", "--model", "facebook/opt-1.3b", "--gpu-mem", "24GiB", "--cpu-mem", "64GiB"]
    assert main([*base, "--hardware", str(cpu_profile)]) == 0
    note = capsys.readouterr().err
    assert "compute device is the CPU" in note and "--hardware FILE" in note
    assert main([*base, "--hardware", hardware_file]) == 0
    assert "compute device is the CPU" not in capsys.readouterr().err


def test_plan_prices_the_dtype_the_engine_computes_in(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a CPU without bfloat16 in hardware the engine computes OPT-6.7B's half checkpoint in
    float32 (24.8 GiB of weights): under --gpu-mem 16GiB the plan cannot home them all in the
    gpu tier (it priced 12.4 GiB of half-precision weights before, and homed 92% there)."""
    import policy.dtypes

    cpu_profile = Path(__file__).resolve().parents[1] / "fixtures" / "hardware-cpu.json"
    argv = ["plan", "--model", "facebook/opt-6.7b", "--gpu-mem", "16GiB", "--json"]
    argv += ["--hardware", str(cpu_profile)]
    monkeypatch.setattr(policy.dtypes, "cpu_has_native_bf16", lambda: False)
    assert main(argv) == 0
    wide = json.loads(capsys.readouterr().out)
    gib = 1 << 30
    assert wide["dtype_bytes"] == 4
    assert wide["policy"]["weights_frac"][0] * 24.8 * gib < 16 * gib
    monkeypatch.setattr(policy.dtypes, "cpu_has_native_bf16", lambda: True)  # bfloat16
    assert main(argv) == 0
    half = json.loads(capsys.readouterr().out)
    assert half["dtype_bytes"] == 2
    assert half["policy"]["weights_frac"][0] > wide["policy"]["weights_frac"][0]
    assert main([*argv, "--dtype", "float32"]) == 0  # as `nanoflex serve --dtype float32`
    assert json.loads(capsys.readouterr().out)["dtype_bytes"] == 4

"""The GPU comparison harness, on the CPU: parsing, FlexGen arguments, roofline, report, cases."""

from __future__ import annotations

import dataclasses
import math

import pytest

from bench.gpu.cases import CASES, VARIANTS, FlexGenArgs, GiB
from bench.gpu.flexgen_run import FlexGenOutputError, build_tokenizer, parse_flexgen_output
from bench.gpu.report import BEGIN, END, comparison_table, points, report, update_docs
from bench.plans.roofline import best_roofline, max_block_size, roofline
from policy.catalog import builtin_spec
from policy.hardware import FLEXGEN_T4
from policy.paper import FLEXGEN_TABLE15
from policy.specs import WorkloadSpec

# What `python -m flexgen.flex_opt --model facebook/opt-30b --path _DUMMY_ ...` prints at the
# end of a run (flexgen 0.1.8, flexgen/utils.py write_benchmark_log), tab-separated.
FLEXGEN_SAMPLE = (
    "<run_flexgen>: args.model: facebook/opt-30b\n"
    "model size: 55.803 GB, cache size: 37.266 GB, hidden size (prefill): 0.316 GB\n"
    "init weight...\nwarmup - generate\nbenchmark - generate\n"
    "TorchDevice: cuda:0\n  cur_mem: 10.8021 GB,  peak_mem: 14.6621 GB\n"
    "TorchDevice: cpu\n  cur_mem: 82.6384 GB,  peak_mem: 0.0000 GB\n"
    "model size: 55.803 GB\tcache size: 37.266 GB\thidden size (p): 0.316 GB\n"
    "peak gpu mem: 14.662 GB\tprojected: False\n"
    "prefill latency: 21.484 s\tprefill throughput: 1143.946 token/s\n"
    "decode latency: 180.357 s\tdecode throughput: 8.250 token/s\n"
    "total latency: 201.841 s\ttotal throughput: 7.610 token/s\n"
)


def test_parse_flexgen_output():
    m = parse_flexgen_output(FLEXGEN_SAMPLE)
    assert m["generation_throughput"] == 7.610
    assert m["prefill_throughput"] == 1143.946 and m["decode_throughput"] == 8.250
    assert m["prefill_seconds"] == 21.484 and m["decode_seconds"] == 180.357
    assert m["total_seconds"] == 201.841 and m["peak_gpu_gb"] == 14.662
    assert m["model_gb"] == 55.803 and m["projected"] is False
    # FlexGen's definitions are ours: generation = block * gen / (prefill + decode) seconds
    assert 48 * 32 / (m["prefill_seconds"] + m["decode_seconds"]) == pytest.approx(7.610, 1e-3)
    projected = parse_flexgen_output(FLEXGEN_SAMPLE.replace("projected: False", "projected: True"))
    assert projected["projected"] is True


def test_parse_flexgen_output_without_a_result_raises():
    crashed = FLEXGEN_SAMPLE.split("model size: 55.803 GB\t")[0] + "torch.OutOfMemoryError: ..."
    with pytest.raises(FlexGenOutputError, match="total throughput"):
        parse_flexgen_output(crashed)


def test_flexgen_arguments_from_table_15():
    args = FlexGenArgs.from_policy(FLEXGEN_TABLE15["opt-30b"])
    argv = args.argv("opt-30b", 512, 32, "/tmp/off")
    joined = " ".join(argv)
    assert "--model facebook/opt-30b --path _DUMMY_" in joined
    assert "--percent 20 80 0 100 0 100" in joined
    assert "--gpu-batch-size 48 --num-gpu-batches 3" in joined
    assert "--cpu-cache-compute" in argv and "--compress-weight" not in argv
    compressed = FlexGenArgs.from_policy(FLEXGEN_TABLE15["opt-30b-compressed"])
    assert compressed.percent == (20, 80, 0, 100, 100, 0)
    assert compressed.compress_weight and compressed.compress_cache
    flex_opt = pytest.importorskip("flexgen.flex_opt", reason="flexgen is not installed")
    import argparse

    parser = argparse.ArgumentParser()
    flex_opt.add_parser_arguments(parser)
    parsed = parser.parse_args(argv)
    assert parsed.percent == [20, 80, 0, 100, 0, 100] and parsed.cpu_cache_compute


def test_local_tokenizer_pads_like_flexgen_needs():
    tokenizer = build_tokenizer()
    ids = tokenizer(["Paris is the capital city of"], padding="max_length", max_length=32)
    row = ids.input_ids[0]
    assert len(row) == 32 and row[:26] == [1] * 26 and 3 not in row  # OPT's pad id, no unk
    assert isinstance(tokenizer.batch_decode([[5, 50271, 1, 2]], skip_special_tokens=True)[0], str)


def test_flexgen_policies_fit_this_machine():
    """Each FlexGen policy keeps its weights and KV cache within the case's budgets."""
    for case in CASES.values():
        if case.flexgen is None:
            continue
        spec = builtin_spec(case.model)
        assert spec is not None
        p = case.flexgen
        kv = p.block_size * (case.prompt_len + case.gen_len) * spec.kv_bytes_per_token
        weights = spec.total_weight_bytes
        host = p.weights_frac[1] * weights + p.kv_frac[1] * kv
        gpu = p.weights_frac[0] * weights + p.kv_frac[0] * kv
        assert host <= case.cpu_mem, case.name
        assert gpu <= (case.gpu_mem or 80 * GiB) * 0.95, case.name


def test_cases_cover_the_issue():
    models = {c.model for c in CASES.values()}
    assert {"opt-6.7b", "opt-13b", "opt-30b", "llama-3-8b"} <= models
    for model in ("opt-6.7b", "opt-13b", "opt-30b"):
        budgets = {c.gpu_mem for c in CASES.values() if c.model == model and c.prompt_len == 512}
        assert budgets == {16 * GiB, None}, model
    assert any(c.prompt_len == 1024 for c in CASES.values())
    ablations = [c for c in CASES.values() if set(c.variants) == set(VARIANTS)]
    assert len(ablations) == 1 and ablations[0].flexgen is not None


# ---- roofline ------------------------------------------------------------------------


def test_roofline_arithmetic_all_offloaded():
    spec = builtin_spec("opt-30b")
    assert spec is not None
    hw, w = FLEXGEN_T4, WorkloadSpec(512, 32)
    r = roofline(spec, w, hw, block_size=48, gpu_mem=0, cpu_mem=200 * GiB)
    weights = spec.total_weight_bytes
    assert r.weights_off_gpu_bytes == weights and r.kv_off_gpu_frac == 1.0
    assert r.pcie_bound == pytest.approx(48 * hw.ctog_bw / weights)
    assert r.compute_bound_all_tokens == pytest.approx(hw.gpu_flops / (2 * spec.total_params))
    assert r.compute_bound == pytest.approx(r.compute_bound_all_tokens * 32 / 544)
    kv_read = 48 * (512 + 16) * spec.kv_bytes_per_token  # per decode step
    bw = max(hw.cpu_attention_bw(0, 4 * 7168 / spec.kv_bytes_per_token_per_layer), hw.ctog_bw)
    assert r.cpu_attention_bound == pytest.approx(48 * 32 / (31 * kv_read / bw))
    assert math.isinf(r.hbm_bound)  # nothing resident on the GPU
    assert r.bound == min(r.pcie_bound, r.compute_bound, r.cpu_attention_bound)
    assert r.to_dict()["limit"] == r.limit == "pcie"


def test_roofline_fits_in_gpu_memory_is_compute_or_hbm_bound():
    spec = builtin_spec("opt-6.7b")
    assert spec is not None
    r = roofline(spec, WorkloadSpec(512, 32), FLEXGEN_T4, block_size=4, gpu_mem=80 * GiB)
    assert math.isinf(r.pcie_bound) and math.isinf(r.cpu_attention_bound)
    assert r.limit in ("compute", "hbm") and r.kv_off_gpu_frac == 0.0
    assert r.hbm_bound == pytest.approx(
        4 * 32 / ((32 * spec.total_weight_bytes + 31 * 4 * 528 * spec.kv_bytes_per_token) / 250e9)
    )


def test_best_roofline_bounds_every_block_size_and_format():
    spec = builtin_spec("opt-13b")
    assert spec is not None
    w, kw = WorkloadSpec(512, 32), dict(gpu_mem=16 * GiB, cpu_mem=96 * GiB)
    largest = max_block_size(spec, w, FLEXGEN_T4, **kw)
    kv_seq = 544 * spec.kv_bytes_per_token
    assert largest == int((112 * GiB - spec.total_weight_bytes) // kv_seq)
    best = best_roofline(spec, w, FLEXGEN_T4, **kw)
    plain = best_roofline(spec, w, FLEXGEN_T4, allow_compression=False, **kw)
    assert best is not None and plain is not None and best.bound >= plain.bound
    for b in (1, 8, 64, largest):
        assert roofline(spec, w, FLEXGEN_T4, block_size=b, **kw).bound <= plain.bound
    assert best_roofline(spec, w, FLEXGEN_T4, gpu_mem=0, cpu_mem=1 * GiB) is None


# ---- report --------------------------------------------------------------------------


def _result(name: str, nano: float, flexgen: float | None, accelerate: float) -> dict:
    policy = dataclasses.asdict(FLEXGEN_TABLE15["opt-30b"])
    policy = {k: list(v) if isinstance(v, tuple) else v for k, v in policy.items()}

    def run(gen: float, block: int) -> dict:
        metrics = dict(generation_throughput=gen, prefill_throughput=gen * 10,
                       decode_throughput=gen * 1.1, prefill_seconds=2.0, decode_seconds=8.0,
                       num_prompts=block)  # fmt: skip
        return {"ok": True, "metrics": metrics, "policy": policy}

    runs = {"nanoflex:auto": run(nano, 144), "accelerate": {**run(accelerate, 8), "batch_size": 8}}
    if flexgen is not None:
        runs["flexgen"] = run(flexgen, 144)
    runs["nanoflex:overlap-off"] = {"ok": False, "error": "timed out; log tail:\n..."}
    return {
        "case": {"name": name, "gpu_mem": 16 * GiB},
        "runs": runs,
        "predicted": {"nanoflex:auto": {"generation_throughput": 9.0, "bottleneck": "decode:ctog"}},
        "roofline": {"best": {"bound": 20.0, "limit": "pcie"}},
        "hardware": {"notes": "NVIDIA H100 80GB HBM3; torch 2.x"},
    }


def test_report_table_and_ratios(tmp_path):
    results = [_result("opt-30b-p512-16g", 8.0, 4.0, 0.5), _result("llama", 10.0, None, 5.0)]
    table = comparison_table(results)
    assert "| opt-30b-p512-16g | 16 GiB | 8.00 | 4.00 | 0.50 | 9.00 | 20.00 | 2.00x | 16.00x" in (
        table
    )
    assert "| 0.40x |" in table and "| llama | 16 GiB | 10.00 | - |" in table
    text = report(results)
    assert "NVIDIA H100" in text and "48x3, 20, 80, 0, 100, 0, 100; CPU attn" in text
    assert "nanoflex:overlap-off (timed out; log tail:)" in text
    assert len(points(results)) == 5
    doc = tmp_path / "benchmarks.md"
    doc.write_text(f"# B\n\nbefore\n{BEGIN}\nold\n{END}\nafter\n")
    update_docs(doc, "new table")
    assert doc.read_text() == f"# B\n\nbefore\n{BEGIN}\nnew table\n{END}\nafter\n"

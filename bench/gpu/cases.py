"""The GPU comparison cases (issue 7): model shape, lengths, GPU budget and FlexGen's policy.

Each `Case` is run side by side by `bench.gpu.compare`: nanoflex with its planned
policy, FlexGen 0.1.8 with a hand-picked policy, Hugging Face Accelerate offloading,
and the cost model's prediction and roofline. Weights are generated (`dummy:`), so
no case downloads anything.

FlexGen's policies come from its paper (arXiv, Tables 15 and 16, T4 16 GB with 208 GB
of DRAM) and its `benchmark/flexgen/bench_suite.py`. The GPU machine has 128 GiB of
host memory, so where the paper's block would not fit (OPT-30B: 48x3 sequences need
~108 GB of KV cache on the CPU beside 48 GB of weights) the number of GPU batches is
cut, keeping the GPU batch size and placement; the `note` says so. Policies marked
"derived" have no entry in the paper (OPT-13B, whole-card budgets): they follow the
paper's recipe for the nearest case and are documented as ours.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from policy import Policy
from policy.paper import FLEXGEN_TABLE15

GiB = 1 << 30
HOST_BUDGET = 96 * GiB
"""Host memory a system may plan for: 128 GiB less room for the OS, the other process
images and pinned-allocation rounding."""

VARIANTS: tuple[str, ...] = (
    "auto",
    "overlap-off",
    "cpu-attention-off",
    "compression-off",
    "flexgen-policy",
    "piecewise-graphs-off",
)
"""nanoflex runs of one case: the searched policy, then the ablations (docs/benchmarks.md)."""


@dataclass(frozen=True)
class Case:
    """One row of the comparison: every system runs this shape, workload and GPU budget."""

    name: str
    model: str
    """A built-in shape (policy.specs), run with dummy weights: `dummy:<model>`."""
    prompt_len: int = 512
    gen_len: int = 32
    gpu_mem: int | None = 16 * GiB
    """GPU budget in bytes, enforced in every process; None: the whole card."""
    cpu_mem: int = HOST_BUDGET
    flexgen: Policy | None = None
    """FlexGen's hand-picked policy in our notation; None: FlexGen cannot run it (Llama)."""
    accelerate_batch: int = 8
    """Accelerate's batch size (FlexGen's Table 15 setting); halved on out-of-memory."""
    variants: tuple[str, ...] = ("auto",)
    """nanoflex variants to run (see VARIANTS)."""
    note: str = ""

    def __post_init__(self) -> None:
        unknown = set(self.variants) - set(VARIANTS)
        if unknown:
            raise ValueError(f"unknown variants {sorted(unknown)}; known: {VARIANTS}")

    @property
    def dummy_model(self) -> str:
        return f"dummy:{self.model}"

    @property
    def is_opt(self) -> bool:
        return self.model.startswith("opt-")


def _all_gpu(gpu_batch_size: int, num_gpu_batches: int = 1, overlap: bool = True) -> Policy:
    """FlexGen's `--percent 100 0 100 0 100 0`."""
    return Policy(gpu_batch_size=gpu_batch_size, num_gpu_batches=num_gpu_batches, overlap=overlap)


def _kv_on_cpu(gpu_batch_size: int, num_gpu_batches: int, weights_gpu: float) -> Policy:
    """FlexGen's `--percent wg wc 0 100 0 100 --cpu-cache-compute` (Table 15's OPT-30B recipe)."""
    return Policy(
        gpu_batch_size=gpu_batch_size,
        num_gpu_batches=num_gpu_batches,
        weights_frac=(weights_gpu, 1.0 - weights_gpu, 0.0),
        kv_frac=(0.0, 1.0, 0.0),
        act_frac=(0.0, 1.0, 0.0),
        cpu_attention=True,
    )


# Table 15 (prompt 512): OPT-6.7B 2x1 all on GPU; bench_suite.py runs it with --overlap False.
OPT_6B7_P512 = _all_gpu(2, overlap=False)
# Table 16 (prompt 1024): OPT-6.7B 1x1 all on GPU, --overlap False as above.
OPT_6B7_P1024 = _all_gpu(1, overlap=False)
# Table 15: OPT-30B 48x3, (20, 80, 0, 100, 0, 100), CPU attention; 48x1 here (host memory),
# a configuration bench_suite.py's policy ablation also runs.
OPT_30B_P512 = replace(FLEXGEN_TABLE15["opt-30b"], num_gpu_batches=1)

CASES: dict[str, Case] = {
    case.name: case
    for case in (
        Case(
            "opt-125m-smoke",
            "opt-125m",
            prompt_len=64,
            gen_len=8,
            gpu_mem=4 * GiB,
            cpu_mem=8 * GiB,
            flexgen=_all_gpu(4),
            accelerate_batch=4,
            variants=("auto", "flexgen-policy"),
            note="A one-minute check that all three systems run on this machine",
        ),
        Case(
            "opt-6.7b-p512-16g",
            "opt-6.7b",
            flexgen=OPT_6B7_P512,
            accelerate_batch=2,
            variants=VARIANTS,
            note="FlexGen: Table 15, 2x1 all on GPU (--overlap False as in bench_suite.py)",
        ),
        Case(
            "opt-13b-p512-16g",
            "opt-13b",
            flexgen=_kv_on_cpu(48, 2, weights_gpu=0.4),
            accelerate_batch=4,
            note="FlexGen: derived (not in the paper): the OPT-30B recipe with 40% of "
            "the weights on the GPU, 48x2",
        ),
        Case(
            "opt-30b-p512-16g",
            "opt-30b",
            flexgen=OPT_30B_P512,
            accelerate_batch=8,
            note="FlexGen: Table 15 policy (20, 80, 0, 100, 0, 100, CPU attention) with 48x1 "
            "instead of 48x3: 48x3 needs ~156 GB of host memory",
        ),
        Case(
            "opt-6.7b-p512-full",
            "opt-6.7b",
            gpu_mem=None,
            flexgen=_all_gpu(64, 2),
            accelerate_batch=64,
            note="FlexGen: derived: all on GPU, 64x2 (KV 36 GB beside 13 GB of weights)",
        ),
        Case(
            "opt-13b-p512-full",
            "opt-13b",
            gpu_mem=None,
            flexgen=_all_gpu(32, 2),
            accelerate_batch=32,
            note="FlexGen: derived: all on GPU, 32x2 (KV 29 GB beside 26 GB of weights)",
        ),
        Case(
            "opt-30b-p512-full",
            "opt-30b",
            gpu_mem=None,
            flexgen=_kv_on_cpu(48, 1, weights_gpu=0.9),
            accelerate_batch=8,
            note="FlexGen: derived: 90% of the weights on GPU, KV on CPU with CPU attention, 48x1",
        ),
        Case(
            "llama-3-8b-p512-16g",
            "llama-3-8b",
            flexgen=None,
            accelerate_batch=8,
            note="FlexGen 0.1.8 runs OPT only: nanoflex, Accelerate and the roofline",
        ),
        Case(
            "llama-3-8b-p512-full",
            "llama-3-8b",
            gpu_mem=None,
            flexgen=None,
            accelerate_batch=64,
            note="Resident: the whole card, weights and KV on the GPU; total throughput against "
            "the compute bound gpu_flops / (2 x params). FlexGen 0.1.8 runs OPT only",
        ),
        Case(
            "opt-6.7b-p1024-16g",
            "opt-6.7b",
            prompt_len=1024,
            flexgen=OPT_6B7_P1024,
            accelerate_batch=1,
            note="FlexGen: Table 16, 1x1 all on GPU (--overlap False as in bench_suite.py)",
        ),
    )
}

# The runbook's order: cheapest and most telling first (docs/gpu-benchmarks.md).
DEFAULT_ORDER: tuple[str, ...] = (
    "opt-6.7b-p512-16g",
    "opt-30b-p512-16g",
    "opt-13b-p512-16g",
    "llama-3-8b-p512-16g",
    "opt-6.7b-p1024-16g",
    "opt-6.7b-p512-full",
    "opt-13b-p512-full",
    "opt-30b-p512-full",
    "llama-3-8b-p512-full",
)


@dataclass(frozen=True)
class FlexGenArgs:
    """`python -m flexgen.flex_opt` arguments for a policy (FlexGen's own notation)."""

    gpu_batch_size: int
    num_gpu_batches: int
    percent: tuple[int, int, int, int, int, int]
    """wg, wc, cg, cc, hg, hc in percent; disk gets the rest of each pair."""
    cpu_cache_compute: bool = False
    compress_weight: bool = False
    compress_cache: bool = False
    overlap: bool = True
    extra: tuple[str, ...] = field(default=())

    @classmethod
    def from_policy(cls, policy: Policy) -> FlexGenArgs:
        def pct(x: float) -> int:
            return round(100 * x)

        w, c, h = policy.weights_frac, policy.kv_frac, policy.act_frac
        return cls(
            gpu_batch_size=policy.gpu_batch_size,
            num_gpu_batches=policy.num_gpu_batches,
            percent=(pct(w[0]), pct(w[1]), pct(c[0]), pct(c[1]), pct(h[0]), pct(h[1])),
            cpu_cache_compute=policy.cpu_attention,
            compress_weight=policy.compress_weights,
            compress_cache=policy.compress_kv,
            overlap=policy.overlap,
        )

    def argv(self, model: str, prompt_len: int, gen_len: int, offload_dir: str) -> list[str]:
        out = [
            "--model", f"facebook/{model}", "--path", "_DUMMY_",
            "--offload-dir", offload_dir,
            "--prompt-len", str(prompt_len), "--gen-len", str(gen_len),
            "--gpu-batch-size", str(self.gpu_batch_size),
            "--num-gpu-batches", str(self.num_gpu_batches),
            "--percent", *map(str, self.percent),
            "--overlap", str(self.overlap),
        ]  # fmt: skip
        if self.cpu_cache_compute:
            out.append("--cpu-cache-compute")
        if self.compress_weight:
            out.append("--compress-weight")
        if self.compress_cache:
            out.append("--compress-cache")
        return [*out, *self.extra]

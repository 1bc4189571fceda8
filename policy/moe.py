"""Mixture-of-experts terms of the cost model: distinct experts a block touches, expert bytes
loaded per block, CPU expert compute and its break-even, GPU-resident hot experts.

Routing is taken as uniform: each token picks a uniformly random set of k of a layer's E
experts, independently of the other tokens. Then
- one expert is missed by one token with probability 1 - k/E, so T tokens touch
  E (1 - (1 - k/E)^T) distinct experts on average (`expected_distinct_experts`);
- the experts homed on the GPU, whichever they are, take the share of the routed tokens that
  they are of the experts (`gpu_token_share`); the engine homes the most-routed ones there,
  so with real (skewed) routing they take more, and the model is pessimistic about them;
- every touched expert gets T k / D tokens on average, D the distinct experts touched.

An expert's weights are loaded once per block and layer (the block's touched experts stay on
the GPU while every GPU batch uses them); its tokens are grouped per decode step across the
whole block (bls tokens, MoE-Gen's module batching), and per GPU batch in prefill (gbs s
tokens, which already touch nearly every expert), so the gathered hidden states stay small.
A measured per-expert routing histogram replaces the two functions that carry the
assumption (`expected_distinct_experts`, `gpu_token_share`): with per-expert pick shares p_i,
expert i is touched with probability 1 - (1 - k p_i)^T and the hottest experts' shares add up.

Legend as in policy/cost_model.py; E num_experts, k num_experts_per_tok, T tokens of the
block in one layer (bls s in prefill, bls per decode step), D distinct experts touched.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from policy.affine import ZERO, Affine
from policy.hardware import CPU_ATTENTION_SATURATION_THREADS, HardwareSpec
from policy.policy import Policy
from policy.specs import ModelSpec, compressed_bytes_per_element

MAX_BREAK_EVEN_TOKENS = 1 << 20
"""Above this many tokens CPU expert compute is reported as always winning."""


def expected_distinct_experts(num_experts: int, top_k: int, num_tokens: float) -> float:
    """Distinct experts that `num_tokens` tokens touch in one layer, on average, under uniform
    routing: E (1 - (1 - k/E)^T)."""
    if num_experts < 1 or num_tokens <= 0:
        return 0.0
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** num_tokens)


def gpu_token_share(gpu_frac: float) -> float:
    """Share of the routed tokens that the experts homed on the GPU compute, when they are
    `gpu_frac` of the experts: under uniform routing that same share."""
    return gpu_frac


def cpu_expert_seconds(
    model: ModelSpec,
    hardware: HardwareSpec,
    num_tokens: float,
    num_threads: int = 0,
    compressed: bool = False,
) -> float:
    """Seconds the CPU takes to run one routed expert over `num_tokens` tokens with
    `num_threads` intra-op threads (0: all cores): FLOP-bound (2 P_e FLOPs per token at the
    profile's cpu_flops, scaled by the share of cores) or bound by reading its weights from
    host memory (cpu_mem_bw, which saturates at 8 threads as CPU attention does), whichever
    is slower. A 4-bit expert is read at 0.28x the bytes and dequantized on the CPU."""
    cores = hardware.cpu_cores
    threads = min(num_threads or cores, cores)
    saturation = min(cores, CPU_ATTENTION_SATURATION_THREADS)
    flops = hardware.cpu_flops * threads / cores
    mem_bw = hardware.cpu_mem_bw_estimate * min(threads, saturation) / saturation
    elems = model.expert_params
    read = elems * model.dtype_bytes * _stored_ratio(model, compressed) / mem_bw
    if compressed:  # 3 FLOPs per element, as the cost model's CPU dequantization
        read += 3.0 * elems / flops
    return max(num_tokens * 2 * elems / flops, read)


def expert_copy_seconds(model: ModelSpec, hardware: HardwareSpec, compressed: bool) -> float:
    """Seconds to copy one routed expert from pinned host memory to the GPU."""
    return model.expert_weight_bytes * _stored_ratio(model, compressed) / hardware.ctog_bw


def cpu_expert_break_even(
    model: ModelSpec, hardware: HardwareSpec, num_threads: int = 0, compressed: bool = False
) -> int:
    """The most tokens routed to a CPU-homed expert for which computing them on the CPU is
    faster than copying the expert over PCIe (0: never, the CPU reads its weights more
    slowly than PCIe copies them); below it the expert runs on the CPU."""
    if not model.is_moe:
        return 0
    copy = expert_copy_seconds(model, hardware, compressed)

    def cpu_wins(tokens: int) -> bool:
        return cpu_expert_seconds(model, hardware, tokens, num_threads, compressed) < copy

    if not cpu_wins(1):
        return 0
    low, high = 1, MAX_BREAK_EVEN_TOKENS  # cpu_wins(low) holds; CPU time grows with tokens
    if cpu_wins(high):
        return high
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if cpu_wins(mid) else (low, mid)
    return low


@dataclass(frozen=True)
class ExpertStage:
    """One stage's (prefill or decode) expert traffic and compute, per layer of the block,
    averaged over the layers (a dense layer has none). Placement-free: the cost model
    multiplies by the expert fractions (eg, ec, ed)."""

    num_tokens: float
    """Tokens of the block in one layer: bls s (prefill) or bls (one decode step)."""
    distinct_experts: float
    """D: distinct experts they touch in one MoE layer (uniform routing): loaded once each."""
    group_tokens: float
    """Tokens grouped by expert at once: bls (decode) or one GPU batch, gbs s (prefill)."""
    num_groups: int
    """Groups per block: 1 (decode) or num_gpu_batches (prefill)."""
    tokens_per_expert: float
    """G k / D_G: tokens routed to each expert a group touches, on average."""
    break_even_tokens: int
    """`cpu_expert_break_even` for the policy's threads and weight format."""
    cpu_compute: bool
    """CPU-homed touched experts run on the CPU: the policy allows it and tokens_per_expert
    is at most the break-even."""
    expert_bytes: float
    """Bytes of the touched experts of one MoE layer as stored (D x one expert)."""
    layer_expert_bytes: float
    """expert_bytes averaged over all layers (x share of MoE layers): what one layer of the
    block loads if every touched expert came from off the GPU."""
    gpu_seconds: float
    """Compute device seconds for the touched experts of one (average) layer, all on it:
    num_groups x D_G expert GEMMs of tokens_per_expert rows."""
    cpu_seconds: float
    """CPU seconds for them, all on the CPU (used for the CPU-homed share when cpu_compute)."""
    routed_bytes: float
    """Hidden states of all routed (token, expert) pairs of one (average) layer: what crosses
    PCIe each way for the share routed to CPU-computed experts."""


def expert_stage(
    model: ModelSpec,
    hardware: HardwareSpec,
    choice: Policy,
    num_tokens: float,
    num_groups: int,
    gpu_expert_seconds: Callable[[float], float],
) -> ExpertStage:
    """The expert terms for `num_tokens` tokens of the block in one layer, grouped by expert
    in `num_groups` equal groups;
    `gpu_expert_seconds(rows)` is one expert's compute device time over that many tokens (the
    cost model's dense pricing, which knows the profile's table, and its dequantization)."""
    share, top_k = model.moe_layer_share, model.num_experts_per_tok
    distinct = expected_distinct_experts(model.num_experts, top_k, num_tokens)
    group = num_tokens / num_groups
    group_distinct = expected_distinct_experts(model.num_experts, top_k, group)
    per_expert = group * top_k / group_distinct if group_distinct else 0.0
    calls = share * num_groups * group_distinct  # expert GEMMs per (average) layer
    stored = model.expert_weight_bytes * _stored_ratio(model, choice.compress_weights)
    break_even = cpu_expert_break_even(
        model, hardware, choice.num_cpu_threads, choice.compress_weights
    )
    cpu_seconds = cpu_expert_seconds(
        model, hardware, per_expert, choice.num_cpu_threads, choice.compress_weights
    )
    routed = num_tokens * model.num_experts_per_tok * model.hidden_bytes_per_token
    return ExpertStage(
        num_tokens=num_tokens,
        distinct_experts=distinct,
        group_tokens=group,
        num_groups=num_groups,
        tokens_per_expert=per_expert,
        break_even_tokens=break_even,
        cpu_compute=choice.cpu_experts and model.is_moe and per_expert <= break_even,
        expert_bytes=distinct * stored,
        layer_expert_bytes=share * distinct * stored,
        gpu_seconds=calls * gpu_expert_seconds(per_expert) if calls else 0.0,
        cpu_seconds=calls * cpu_seconds,
        routed_bytes=share * routed,
    )


@dataclass(frozen=True)
class ExpertTerms:
    """One stage's expert terms, affine in (eg, ec, ed): bytes per copy direction, seconds per
    compute lane, working bytes per tier, for one (average) layer of the block."""

    ctog: Affine
    """Bytes host -> device: touched experts not homed on the GPU (nor computed on the CPU),
    and the outputs of the tokens the CPU computed."""
    gtoc: Affine
    """Bytes device -> host: the hidden states of tokens routed to CPU-computed experts."""
    dtoc: Affine
    """Bytes read from disk: the touched disk-homed experts."""
    gpu: Affine
    """Compute device seconds: every touched expert not computed on the CPU."""
    cpu: Affine
    """CPU seconds: the touched CPU-homed experts, when the CPU computes them."""
    gpu_memory: Affine
    """Working bytes on the GPU: double-buffered touched experts of one MoE layer that come
    from off the GPU, one dequantized expert (4-bit), the block's routed tokens."""
    cpu_memory: Affine
    """Working bytes in host memory: double-buffered disk reads, CPU expert activations."""


def expert_terms(model: ModelSpec, stage: ExpertStage, compressed: bool) -> ExpertTerms:
    """The affine terms of `stage`; all zero for a dense model."""
    if not model.is_moe:
        return ExpertTerms(ZERO, ZERO, ZERO, ZERO, ZERO, ZERO, ZERO)
    loaded, gpu_s = stage.layer_expert_bytes, stage.gpu_seconds
    on_cpu = stage.cpu_compute
    copied = 0.0 if on_cpu else 1.0  # CPU-homed experts cross PCIe unless computed there
    staged = 2 * stage.expert_bytes  # one MoE layer's touched experts, double-buffered
    dt, h = model.dtype_bytes, model.hidden_size
    rows = stage.tokens_per_expert
    # A group's tokens gathered for the experts and their weighted sum, and one expert's
    # gate and up outputs at a time.
    workspace = 2 * stage.group_tokens * h * dt + rows * 2 * model.moe_intermediate_size * dt
    if compressed:
        workspace += model.expert_weight_bytes  # one expert dequantized to full width
    routed = stage.routed_bytes if on_cpu else 0.0
    cpu_workspace = rows * (2 * h + 2 * model.moe_intermediate_size) * 4 if on_cpu else 0.0
    return ExpertTerms(
        ctog=Affine.of(ec=copied * loaded + routed, ed=loaded),
        gtoc=Affine.of(ec=routed),
        dtoc=Affine.of(ed=loaded),
        gpu=Affine.of(eg=gpu_s, ec=copied * gpu_s, ed=gpu_s),
        cpu=Affine.of(ec=stage.cpu_seconds) if on_cpu else ZERO,
        gpu_memory=Affine.of(workspace, ec=copied * staged, ed=staged),
        cpu_memory=Affine.of(cpu_workspace, ed=staged),
    )


def experts_per_tier(model: ModelSpec, policy: Policy) -> tuple[int, int, int]:
    """Routed experts of each MoE layer homed on (gpu, cpu, disk) as whole experts: the GPU
    share rounded down (it never gains bytes), the rest split by largest remainder."""
    num = model.num_experts
    _, cpu_frac, disk_frac = policy.experts_frac
    gpu = int(policy.experts_frac[0] * num + 1e-6)
    rest = num - gpu
    cpu_exact = rest * cpu_frac / (cpu_frac + disk_frac) if cpu_frac + disk_frac else 0.0
    cpu = min(rest, round(cpu_exact))
    return gpu, cpu, rest - cpu


def _stored_ratio(model: ModelSpec, compressed: bool) -> float:
    if not compressed:
        return 1.0
    return compressed_bytes_per_element(model.dtype_bytes) / model.dtype_bytes

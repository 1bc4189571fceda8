"""Analytic cost model: per-layer prefill/decode time and peak memory per tier for a policy.

FlexGen A.3 (overlapped tasks, max over them), LM-Offload 3.2 ((de)quantization and
CPU attention terms), NanoFlow 4.3 (nano-batch overlap inside the compute task,
`policy.nano_batching`) and our differences (activations on any tier, overlap off = sum,
GQA, 4-bit bytes, and mixture-of-experts: `policy.moe`, routed experts placed apart and loaded
per block as far as the block touches them). Every term is affine in the twelve placement
fractions, or the max of a few affine rows, so the same terms are evaluated here and handed
to the LP in `policy.search`.
Legend: s prompt_len, n gen_len, L num_layers, bls block size, gbs GPU batch size.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from policy.affine import ZERO, Affine, MaxOf, policy_vector
from policy.hardware import HardwareSpec
from policy.moe import ExpertStage, ExpertTerms, expert_stage, expert_terms
from policy.nano_batching import dense_seconds, overlapped_compute
from policy.policy import Policy
from policy.reserves import gpu_reserves
from policy.specs import ModelSpec, WorkloadSpec, compressed_bytes_per_element
from policy.state_cost import StateTerms, state_terms
from policy.steps import prefill_steps
from policy.vision_cost import tower_cost

TASKS: tuple[str, ...] = ("ctog", "gtoc", "dtoc", "ctod", "compute")
"""Overlapped tasks per layer: the four copy directions and compute (gpu + cpu)."""
USABLE_FRAC: dict[str, float] = {"gpu": 0.9, "cpu": 0.95, "disk": 0.95}
"""Share of each budget the plan may fill (CUDA context, fragmentation, page cache)."""


@dataclass(frozen=True)
class CostTerms:
    """Affine terms for one set of discrete choices; the fractions stay free."""

    prefill: dict[str, MaxOf]
    """Seconds per layer for the block during prefill, by task in TASKS (copies are one
    affine row; compute is the max of several when nano-batches overlap its parts)."""
    decode: dict[str, MaxOf]
    """Seconds per layer for the block per decode step (KV at its mean length s + n/2)."""
    compute_parts: dict[str, Affine]
    """Decode compute by lane, before any overlap: 'gpu_compute' (the compute device's dense
    ops, attention and serial work), 'cpu_compute' (CPU attention); and by operation:
    'dense' (cut into the policy's nano-batches), 'gpu_attention', 'cpu_attention'."""
    experts: tuple[ExpertStage, ExpertStage]
    """MoE models: the routed experts' prefill and decode terms before placement (distinct
    experts touched, tokens per expert, whether the CPU computes them; policy/moe.py)."""
    memory: dict[str, Affine]
    """Peak bytes per tier and stage: gpu_prefill, gpu_decode, cpu_prefill, cpu_decode, disk."""
    capacity: dict[str, float]
    """Usable bytes per memory row (the tier's budget x USABLE_FRAC)."""
    num_layers: int
    block_size: int
    prompt_len: float
    gen_len: float
    overlap: bool
    resident: bool = False
    """Terms for weights that stay on the device (`choice.weights_frac[0]` 1: the engine's
    resident steps, policy/steps.py); False: for weights partly elsewhere."""
    copy_hidden: float = 1.0
    """Share of the shorter of copies and compute that overlap hides (HardwareSpec
    `copy_hidden_estimate`): 1.0 is FlexGen's max."""

    def stage_rows(self, terms: dict[str, MaxOf]) -> list[Affine]:
        """Affine rows whose max is the stage's seconds per layer: every task's rows when the
        tasks overlap wholly; else the copies' sum plus each row of compute. Overlap that
        hides a share h < 1 of the shorter costs max(c, io) + (1 - h) min(c, io), which is
        max(c + (1 - h) io, io + (1 - h) c): still a max of affine rows, per copy task."""
        if self.overlap and self.copy_hidden >= 1.0:
            return [row for t in TASKS for row in terms[t].rows]
        if self.overlap:
            exposed = 1.0 - self.copy_hidden
            io_rows = [row for t in TASKS if t != "compute" for row in terms[t].rows]
            return [
                pair
                for c in terms["compute"].rows
                for io in io_rows
                for pair in (c + io * exposed, io + c * exposed)
            ]
        copies = sum((terms[t].rows[0] for t in TASKS if t != "compute"), ZERO)
        return [copies + row for row in terms["compute"].rows]

    def stage_time(self, terms: dict[str, MaxOf], x: np.ndarray) -> float:
        return max(row(x) for row in self.stage_rows(terms))

    def seconds_per_token(self, x: np.ndarray) -> float:
        """The LP objective T / bls with T = L*T_pre + L*(n-1)*T_gen (FlexGen Eq. 1)."""
        total = self.num_layers * (
            self.stage_time(self.prefill, x) + (self.gen_len - 1) * self.stage_time(self.decode, x)
        )
        return total / (self.block_size * self.gen_len)


def _act_round_trip(act: float, hardware: HardwareSpec) -> Affine:
    """Seconds to store `act` bytes of activations to the cpu (hc) or disk (hd) tier and
    load them back onto the compute device."""
    to_host, from_host = act / hardware.gtoc_bw, act / hardware.ctog_bw
    return Affine.of(
        hc=to_host + from_host,
        hd=to_host + act / hardware.ctod_bw + act / hardware.dtoc_bw + from_host,
    )


def build_terms(
    model: ModelSpec,
    workload: WorkloadSpec,
    hardware: HardwareSpec,
    choice: Policy,
    budgets: dict[str, float],
) -> CostTerms:
    """Terms for `choice`'s discrete fields (its fractions are ignored).

    `budgets` holds the gpu/cpu/disk byte budgets (before USABLE_FRAC).
    """
    # s counts a vision model's image tokens; its tower is priced apart (policy/vision_cost.py)
    s, n, num_layers = workload.prompt_tokens(model), workload.gen_len, model.num_layers
    gbs, num_batches = choice.gpu_batch_size, choice.num_gpu_batches
    bls = gbs * num_batches
    tower = tower_cost(model, workload, hardware, bls, choice.vision_tier)
    dtype = model.dtype_bytes
    q_dim, h = model.num_heads * model.head_dim, model.hidden_size
    packed = compressed_bytes_per_element(dtype) / dtype
    weight_ratio = packed if choice.compress_weights else 1.0
    kv_ratio = packed if choice.compress_kv else 1.0

    # Weights: the embeddings and LM head are spread evenly over the L layers. The routed
    # experts are placed apart (eg, ec, ed; policy/moe.py); wg, wc, wd place the rest.
    expert_elems = model.total_expert_params
    layer_elems = (model.total_params - expert_elems) / num_layers
    layer_full = layer_elems * dtype  # bytes once dequantized
    layer_bytes = layer_full * weight_ratio  # bytes as stored and moved
    total_weight_bytes = (model.total_params - expert_elems) * dtype * weight_ratio
    if choice.compress_weights:  # the engine packs no embedding, and a tied head apart
        head = model.vocab_size * (model.word_embed_dim or h)
        embeddings = head + model.max_position_embeddings * h
        total_weight_bytes += embeddings * dtype * (1 - weight_ratio)
        if model.tie_word_embeddings:
            total_weight_bytes += head * dtype * weight_ratio
    total_expert_bytes = expert_elems * dtype * weight_ratio
    kv_tok_full = model.kv_bytes_per_token_per_layer  # 2 * kv_dim * dtype (1x: values are keys)
    kv_tok = kv_tok_full * kv_ratio
    kv_elems_tok = model.kv_row_dim
    act_tok = model.hidden_bytes_per_token
    kv_mean, kv_end = s + n / 2, s + n
    attended = model.attended_len(kv_mean)  # keys a decode reads: a local layer its window
    # A hybrid's KV and attention are in its attention layers only; averaged over all layers,
    # each attention term is that share of a transformer's (1 for a transformer).
    kv_share = model.kv_layer_share
    states = state_terms(model, hardware, bls, s)

    gpu_mem_bw = hardware.gpu_mem_bw_estimate
    dequant_rate = hardware.dequant_throughput_estimate(dtype)  # elements/s on the GPU
    cpu_dequant_rate = 1.0 / (3.0 / hardware.cpu_flops + dtype / hardware.cpu_mem_bw_estimate)
    # Decode attention per KV byte: q.k and p.v, 2 FLOPs each per element of a q head.
    flops_per_kv_byte = 4 * q_dim / kv_tok_full
    cpu_attention_bw = hardware.cpu_attention_bw(choice.num_cpu_threads, flops_per_kv_byte)

    # ---- prefill: one layer, the whole block ------------------------------------------
    act_pre = bls * s * act_tok
    kv_pre = kv_share * bls * s * kv_tok
    # Per token, outside the routed experts (which policy/moe.py prices per block).
    routed_params = model.moe_layer_share * model.num_experts_per_tok * model.expert_params
    weight_flops = 2 * (model.active_layer_params - routed_params)
    head_flops = 2 * model.head_rows * (model.word_embed_dim or h) / num_layers
    num_nano = choice.num_nano_batches
    # Dense ops per GPU batch, cut into nano-batches (policy/nano_batching.py); each piece is
    # FLOP- or weight-read-bound and pays layer_overhead_s (kernel launches, bookkeeping).
    dense_pre = num_batches * dense_seconds(
        gbs * (s * weight_flops + head_flops), layer_full, layer_elems, hardware, num_nano
    )
    prefill_attention_flops = hardware.prefill_attention_flops or hardware.gpu_bmm_flops
    pairs = kv_share * model.attention_pairs(s)
    attention_pre = bls * 8 * pairs * q_dim / prefill_attention_flops
    dequant_weights = layer_elems / dequant_rate if choice.compress_weights else 0.0
    new_kv_elems = kv_share * bls * s * kv_elems_tok  # quantized as the prefill stores them
    quant_kv_pre = 2 * new_kv_elems / dequant_rate if choice.compress_kv else 0.0

    def gpu_expert_seconds(rows: float) -> float:
        """One routed expert over `rows` tokens on the compute device (in decode its tokens
        from every GPU batch are grouped), dequantized first when 4-bit."""
        elems = model.expert_params
        seconds = hardware.dense_seconds(rows * 2 * elems, elems)
        if seconds is None:
            seconds = max(rows * 2 * elems / hardware.gpu_flops, elems * dtype / gpu_mem_bw)
        return seconds + (elems / dequant_rate if choice.compress_weights else 0.0)

    experts_pre = expert_stage(model, hardware, choice, bls * s, num_batches, gpu_expert_seconds)
    experts_gen = expert_stage(model, hardware, choice, bls, 1, gpu_expert_seconds)
    moe_pre = expert_terms(model, experts_pre, choice.compress_weights)
    moe_gen = expert_terms(model, experts_gen, choice.compress_weights)
    prefill = {
        "ctog": (Affine.of(wc=layer_bytes, wd=layer_bytes, hc=act_pre, hd=act_pre) + moe_pre.ctog)
        * (1 / hardware.ctog_bw),
        "gtoc": (Affine.of(cc=kv_pre, cd=kv_pre, hc=act_pre, hd=act_pre) + moe_pre.gtoc)
        * (1 / hardware.gtoc_bw),
        "dtoc": (Affine.of(wd=layer_bytes, hd=act_pre) + moe_pre.dtoc) * (1 / hardware.dtoc_bw),
        "ctod": Affine.of(cd=kv_pre, hd=act_pre) * (1 / hardware.ctod_bw),
    }
    # A step's fixed cost (launches, the host's work per layer and per step: the profile's
    # layer_overhead_s) is paid once per layer by every step: dense_pre charges it once per
    # GPU batch, and resident weights run the block's prompts in many chunked steps.
    num_steps = prefill_steps(choice, s)
    step_fixed = max(0, num_steps - num_batches) * hardware.layer_overhead_s
    # Nothing overlaps these; the routed experts run once per block, not cut in nano-batches.
    # ... nor the vision tower, which encodes the block's images before its prefill.
    tower_pre = tower.block_seconds / num_layers
    serial_pre = (
        Affine.of(dequant_weights + quant_kv_pre + states.prefill_seconds + step_fixed + tower_pre)
        + states.host_seconds
        + moe_pre.gpu
    )

    # ---- decode: one layer, one new token for each of the bls sequences ---------------
    act_gen = bls * act_tok
    kv_read = kv_share * bls * attended * kv_tok  # bytes of old KV attended per step
    kv_new = kv_share * bls * kv_tok
    dense_gen = num_batches * dense_seconds(
        gbs * (weight_flops + head_flops), layer_full, layer_elems, hardware, num_nano
    )
    # GPU attention over one unit of KV fraction: as measured through the engine's path (in
    # place for whole batches, packed for nano-batches), else FLOP- or memory-bound, whichever
    # is slower.
    attention_bw = hardware.decode_attention_bw(num_nano)
    if attention_bw:
        gpu_attention = kv_share * bls * attended * kv_tok_full / attention_bw
    else:
        gpu_attention = (
            kv_share
            * bls
            * max(
                4 * attended * q_dim / hardware.gpu_bmm_flops, attended * kv_tok_full / gpu_mem_bw
            )
        )
    if choice.compress_kv:  # dequantize old KV, quantize the new token (LM-Offload Eqs. 6-7)
        gpu_attention += kv_share * bls * (attended + 2) * kv_elems_tok / dequant_rate
    ctog = Affine.of(wc=layer_bytes, wd=layer_bytes, hc=act_gen, hd=act_gen) + moe_gen.ctog
    gtoc = Affine.of(hc=act_gen, hd=act_gen) + moe_gen.gtoc
    if choice.cpu_attention:
        # Only q and the new k, v go to the CPU; the attention output comes back.
        qkv_bytes = kv_share * bls * (q_dim + model.kv_row_dim) * dtype
        q_bytes = kv_share * bls * q_dim * dtype
        ctog += Affine.of(cc=q_bytes, cd=q_bytes)
        gtoc += Affine.of(cc=qkv_bytes, cd=qkv_bytes)
        cpu_attention = kv_share * bls * attended * kv_tok_full / cpu_attention_bw
        if choice.compress_kv:
            cpu_attention += kv_share * bls * (attended + 2) * kv_elems_tok / cpu_dequant_rate
        gpu_attention_part = Affine.of(cg=gpu_attention)
        cpu_attention_part = Affine.of(cc=cpu_attention, cd=cpu_attention)
    else:
        ctog += Affine.of(cc=kv_read, cd=kv_read)
        gtoc += Affine.of(cc=kv_new, cd=kv_new)
        gpu_attention_part = Affine.of(cg=gpu_attention, cc=gpu_attention, cd=gpu_attention)
        cpu_attention_part = ZERO
    serial_gen = (
        Affine.of(dequant_weights + states.decode_seconds) + states.host_seconds + moe_gen.gpu
    )
    share_small, share_large = hardware.io_compute_share_small, hardware.io_compute_share_large
    if hardware.compute_device == "cpu" and (share_small or share_large):
        # The copy threads and the compute share the cores: each second of disk I/O costs
        # compute that share of its progress (measured by the profile), I/O overlapped or not.
        serial_pre += (Affine.of(wd=layer_bytes, hd=act_pre) + moe_pre.dtoc) * (
            share_large / hardware.dtoc_bw
        ) + Affine.of(cd=kv_pre, hd=act_pre) * (share_large / hardware.ctod_bw)
        serial_gen += (
            Affine.of(
                wd=layer_bytes * share_large, cd=kv_read * share_small, hd=act_gen * share_large
            )
            + moe_gen.dtoc * share_large
        ) * (1 / hardware.dtoc_bw) + Affine.of(
            cd=kv_new * share_small, hd=act_gen * share_large
        ) * (1 / hardware.ctod_bw)
    if num_batches == 1:
        # One GPU batch: the activations entering layer j+1 are those layer j just stored,
        # so their round trip through a lower tier cannot overlap anything.
        serial_pre += _act_round_trip(act_pre, hardware)
        serial_gen += _act_round_trip(act_gen, hardware)
    decode = {
        "ctog": ctog * (1 / hardware.ctog_bw),
        "gtoc": gtoc * (1 / hardware.gtoc_bw),
        "dtoc": (Affine.of(wd=layer_bytes, cd=kv_read, hd=act_gen) + moe_gen.dtoc)
        * (1 / hardware.dtoc_bw),
        "ctod": Affine.of(cd=kv_new, hd=act_gen) * (1 / hardware.ctod_bw),
    }
    prefill_tasks = {task: MaxOf((affine,)) for task, affine in prefill.items()}
    prefill_tasks["compute"] = overlapped_compute(
        dense_pre, Affine.of(attention_pre), moe_pre.cpu, serial_pre, num_nano, hardware
    )
    decode_tasks = {task: MaxOf((affine,)) for task, affine in decode.items()}
    decode_tasks["compute"] = overlapped_compute(
        dense_gen,
        gpu_attention_part,
        cpu_attention_part + moe_gen.cpu,
        serial_gen,
        num_nano,
        hardware,
    )

    memory = _peak_memory(
        model,
        choice,
        s,
        kv_end,
        total_weight_bytes,
        layer_bytes,
        kv_tok,
        kv_tok_full,
        act_tok,
        total_expert_bytes,
        (moe_pre, moe_gen),
        states,
        _step_reserves(
            model, hardware, choice, s, n, kv_end, layer_bytes, layer_full, kv_tok, states
        ),
        host_staging=hardware.compute_device == "cuda",
    )
    for row, nbytes in tower.memory_rows().items():  # the tower, on its tier
        memory[row] += Affine.of(nbytes)
    usable = {tier: budgets[tier] * USABLE_FRAC[tier] for tier in ("gpu", "cpu", "disk")}
    capacity = {row: usable[row.split("_")[0]] for row in memory}
    return CostTerms(
        prefill=prefill_tasks,
        decode=decode_tasks,
        compute_parts={
            "gpu_compute": Affine.of(dense_gen) + gpu_attention_part + serial_gen,
            "cpu_compute": cpu_attention_part + moe_gen.cpu,
            "dense": Affine.of(dense_gen),
            "gpu_attention": gpu_attention_part,
            "cpu_attention": cpu_attention_part,
            "gpu_experts": moe_gen.gpu,
            "cpu_experts": moe_gen.cpu,
        },
        experts=(experts_pre, experts_gen),
        memory=memory,
        capacity=capacity,
        num_layers=num_layers,
        block_size=bls,
        prompt_len=s,
        gen_len=n,
        overlap=choice.overlap,
        resident=choice.weights_frac[0] >= 1.0,
        copy_hidden=hardware.copy_hidden_estimate,
    )


def _step_reserves(
    model: ModelSpec,
    hardware: HardwareSpec,
    choice: Policy,
    s: float,
    n: float,
    kv_end: float,
    layer_bytes: float,
    layer_full: float,
    kv_tok: float,
    states: StateTerms,
) -> dict[str, Affine]:
    """What a step holds on the compute device beside the weights and KV homed there, by
    stage ("prefill", "decode"), as the engine keeps it out of its KV pool there.

    On a GPU, the reserves of policy/reserves.py (a step's workspace, loads and stores in
    flight, the activations homed there) plus a hybrid's states: one GPU batch's of one
    layer gathered while it runs, and its prefill's mixer beside them. Where the compute
    device is the CPU, the engine keeps a flat share of the budget and the slots disk layers
    load into (engine/executor/budgets.py) and runs no copy to a device: a step's buffers
    are priced as they run there, double-buffered weights of layers off the tier, the
    widest of a layer's intermediates for one GPU batch, and a prefill's new KV.
    """
    gbs, bls = choice.gpu_batch_size, choice.block_size
    state_work = gbs * states.layer_bytes
    if hardware.compute_device == "cuda":
        reserves = gpu_reserves(model, choice, int(s), int(n))
        return {
            "prefill": reserves["prefill"] + Affine.of(state_work + gbs * states.prefill_workspace),
            "decode": reserves["decode"] + Affine.of(state_work),
        }
    dtype, h, f = model.dtype_bytes, model.hidden_size, model.intermediate_size
    q_dim, nh = model.num_heads * model.head_dim, model.num_heads
    act_tok = model.hidden_bytes_per_token
    kv_read = model.attended_len(kv_end)
    logits = gbs * model.head_width * 4  # fp32 logits for sampling (or pooled rows)
    # (gbs, s, *) activations: residual + input, then the larger of attention and MLP.
    attention_pre = s * (q_dim + model.kv_row_dim) * dtype + nh * s * s * dtype
    mlp_width = f if model.arch == "opt" else 2 * f  # fc1 output, or SwiGLU's gate and up
    if model.num_moe_layers == model.num_layers:  # the shared expert's (routed: policy.moe)
        mlp_width = 2 * model.shared_expert_intermediate_size
    if model.parallel_hybrid:  # the state mixer's output waits beside the attention's work
        attention_pre += s * h * dtype
    mixer_pre = max(attention_pre, states.prefill_workspace)
    workspace_pre = gbs * (2 * s * h * dtype + max(mixer_pre, s * mlp_width * dtype)) + logits
    workspace_gen = (
        gbs * (2 * h * dtype + max(2 * nh * kv_read * dtype, mlp_width * dtype)) + logits
    )
    dequantized_layer = layer_full if choice.compress_weights else 0.0
    common = Affine.of(2 * layer_bytes + dequantized_layer + state_work, wg=-2 * layer_bytes)
    common += Affine.of(hg=bls * s * act_tok)
    past = 0.0 if choice.cpu_attention else 2 * gbs * kv_read * kv_tok
    return {
        "prefill": common
        + Affine.of(
            workspace_pre + gbs * s * model.kv_bytes_per_token_per_layer,
            hc=2 * gbs * s * act_tok,
            hd=2 * gbs * s * act_tok,
        ),
        "decode": common
        + Affine.of(workspace_gen, cc=past, cd=past, hc=2 * gbs * act_tok, hd=2 * gbs * act_tok),
    }


def _peak_memory(
    model: ModelSpec,
    choice: Policy,
    s: float,
    kv_end: float,
    total_weight_bytes: float,
    layer_bytes: float,
    kv_tok: float,
    kv_tok_full: float,
    act_tok: float,
    total_expert_bytes: float,
    moe: tuple[ExpertTerms, ExpertTerms],
    states: StateTerms,
    reserves: dict[str, Affine],
    host_staging: bool,
) -> dict[str, Affine]:
    """Peak bytes per tier: homed tensors (KV at its final length s + n) plus working buffers:
    on the compute device, the `reserves` the engine keeps out of its KV pool there
    (`_step_reserves`); in host memory, double-buffered (the next layer / batch loads while
    this one computes), hence the factors of 2. Prefill and decode peaks are separate rows.
    """
    gbs, bls, nh = choice.gpu_batch_size, choice.block_size, model.num_heads
    # every token's KV is kept, windows or not, in every attention layer
    kv_home = bls * kv_end * kv_tok * model.num_kv_layers
    kv_read = model.attended_len(kv_end)  # keys one layer's attention loads at the end
    act_home = bls * s * act_tok

    def home(w: str, c: str, a: str) -> Affine:
        e = "e" + w[1]  # the routed experts homed on the same tier
        return Affine.of(**{w: total_weight_bytes, e: total_expert_bytes, c: kv_home, a: act_home})

    # The compute device: weights and KV homed there (a hybrid's states with their
    # sequences' KV) and what a step holds beside them (`_step_reserves`).
    gpu_home = Affine.of(
        wg=total_weight_bytes, eg=total_expert_bytes, cg=kv_home + bls * states.sequence_bytes
    )
    gpu_prefill = gpu_home + reserves["prefill"]
    gpu_decode = gpu_home + reserves["decode"]
    state_host = Affine.of(cc=bls * states.sequence_bytes, cd=bls * states.sequence_bytes)
    batch_kv = gbs * kv_read * kv_tok  # one GPU batch's KV for one layer
    kv_full_copy = gbs * kv_read * kv_tok_full if choice.compress_kv else 0.0
    # Tensors homed on disk are read through host memory on their way to a GPU; where the
    # compute device is the CPU they are read into its memory (`_step_reserves`' slots).
    staged = 1.0 if host_staging else 0.0
    cpu_decode = (
        home("wc", "cc", "hc")
        + state_host
        + Affine.of(wd=2 * layer_bytes, cd=2 * batch_kv, hd=2 * gbs * act_tok) * staged
    )
    if choice.cpu_attention:
        gpu_decode += Affine.of(cg=kv_full_copy)
        cpu_workspace = 2 * gbs * nh * kv_read * 4 + kv_full_copy  # fp32 scores and probs
        cpu_decode += Affine.of(cc=cpu_workspace, cd=cpu_workspace)
    else:
        gpu_decode += Affine.of(kv_full_copy)
    cpu_prefill = (
        home("wc", "cc", "hc")
        + state_host
        + Affine.of(wd=2 * layer_bytes, cd=2 * gbs * s * kv_tok, hd=2 * gbs * s * act_tok) * staged
    )
    moe_pre, moe_gen = moe
    return {
        "gpu_prefill": gpu_prefill + moe_pre.gpu_memory,
        "gpu_decode": gpu_decode + moe_gen.gpu_memory,
        "cpu_prefill": cpu_prefill + moe_pre.cpu_memory,
        "cpu_decode": cpu_decode + moe_gen.cpu_memory,
        "disk": home("wd", "cd", "hd"),
    }


@dataclass(frozen=True)
class Estimate:
    """The cost model's prediction for one complete policy."""

    prefill_terms: dict[str, float]
    """Seconds per layer per block, by task."""
    decode_terms: dict[str, float]
    compute_parts: dict[str, float]
    prefill_time: float
    """Seconds per layer for the block's prefill (max, or sum without overlap)."""
    decode_time: float
    """Seconds per layer per decode step for the block."""
    peak_bytes: dict[str, float]
    """Peak use per tier (gpu, cpu, disk)."""
    capacity_bytes: dict[str, float]
    """Usable bytes per tier."""
    prefill_throughput: float
    decode_throughput: float
    generation_throughput: float
    bottleneck: str
    experts: tuple[ExpertStage, ExpertStage]
    """MoE models: the prefill and decode expert terms (policy/moe.py); zeros when dense."""

    @property
    def fits(self) -> bool:
        return all(
            self.peak_bytes[t] <= self.capacity_bytes[t] * (1 + 1e-6) for t in self.peak_bytes
        )

    def predicted(self) -> dict[str, float]:
        return {
            "prefill_throughput": self.prefill_throughput,
            "decode_throughput": self.decode_throughput,
            "generation_throughput": self.generation_throughput,
        }


def evaluate(terms: CostTerms, x: np.ndarray) -> Estimate:
    """Numbers for placement `x` (VARS order), with FlexGen's throughputs
    (docs/benchmarks.md, Metrics)."""
    prefill_terms = {t: terms.prefill[t](x) for t in TASKS}
    decode_terms = {t: terms.decode[t](x) for t in TASKS}
    compute_parts = {k: v(x) for k, v in terms.compute_parts.items()}
    prefill_time = terms.stage_time(terms.prefill, x)
    decode_time = terms.stage_time(terms.decode, x)
    num_layers, bls, n = terms.num_layers, terms.block_size, terms.gen_len
    prefill_total = num_layers * prefill_time
    decode_total = num_layers * (n - 1) * decode_time
    peak = {tier: 0.0 for tier in ("gpu", "cpu", "disk")}
    capacity = {tier: 0.0 for tier in peak}
    for row, affine in terms.memory.items():
        tier = row.split("_")[0]
        peak[tier] = max(peak[tier], affine(x))
        capacity[tier] = terms.capacity[row]
    if decode_total >= prefill_total:
        stage, stage_terms = "decode", decode_terms
    else:
        stage, stage_terms = "prefill", prefill_terms
    task = max(stage_terms, key=lambda t: stage_terms[t])
    if task == "compute":
        task = (
            "cpu_compute"
            if stage == "decode" and (compute_parts["cpu_compute"] > compute_parts["gpu_compute"])
            else "gpu_compute"
        )
    return Estimate(
        prefill_terms=prefill_terms,
        decode_terms=decode_terms,
        compute_parts=compute_parts,
        prefill_time=prefill_time,
        decode_time=decode_time,
        peak_bytes=peak,
        capacity_bytes=capacity,
        prefill_throughput=bls * terms.prompt_len / prefill_total,
        decode_throughput=bls / (num_layers * decode_time),
        generation_throughput=bls * n / (prefill_total + decode_total),
        bottleneck=f"{stage}:{task}",
        experts=terms.experts,
    )


def estimate(
    policy: Policy,
    model: ModelSpec,
    workload: WorkloadSpec,
    hardware: HardwareSpec,
    budgets: dict[str, float] | None = None,
) -> Estimate:
    """Predict `policy` on `hardware` (budgets default to the hardware's memory sizes)."""
    budgets = budgets or hardware_budgets(hardware)
    return evaluate(build_terms(model, workload, hardware, policy, budgets), policy_vector(policy))


def hardware_budgets(
    hardware: HardwareSpec,
    gpu_mem: float | None = None,
    cpu_mem: float | None = None,
    disk_mem: float | None = None,
) -> dict[str, float]:
    """Byte budgets per tier: the overrides where given, else the machine's sizes. When the
    compute device is the CPU, the gpu and cpu tiers are the same RAM: together they never
    get more than the machine has, and what is not asked for goes to the gpu tier (on a
    CPU, moving bytes between the two tiers only costs copies)."""
    gpu = float(hardware.gpu_mem_bytes if gpu_mem is None else gpu_mem)
    cpu = float(hardware.cpu_mem_bytes if cpu_mem is None else cpu_mem)
    if hardware.compute_device == "cpu":
        ram = float(hardware.gpu_mem_bytes + hardware.cpu_mem_bytes)
        if gpu_mem is None:
            gpu = ram - min(cpu if cpu_mem is not None else 0.0, ram)
        gpu = min(gpu, ram)
        cpu = min(cpu if cpu_mem is not None else ram - gpu, ram - gpu)
    return {
        "gpu": gpu,
        "cpu": cpu,
        "disk": float(hardware.disk_mem_bytes if disk_mem is None else disk_mem),
    }

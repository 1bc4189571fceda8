"""The GPU's reserves, priced once for the planner and the engine: what a step holds on the
device beside the weights and KV homed there.

The cost model adds them to its gpu peak rows (`policy.cost_model`), the engine subtracts
the same bytes from its gpu budget before it sizes the KV pool (engine/executor/budgets.py),
so the pool the engine builds is the one the plan priced: no reserve is carved out of it
after planning. Each term is affine in the placement fractions (the LP's variables) for one
set of discrete choices; the engine evaluates it at its policy's fractions. The terms, per
stage (prefill, decode), as the rehearsal of the CUDA path counts them (engine/rehearsal.py,
its labels in brackets):

* the compute's workspace [compute, step]: one GPU batch's rows through one layer, the
  block's logits (`step_workspace_bytes`);
* weights in flight [load_weight, weight slots]: a 4-bit layer dequantized for each compute
  the loop runs ahead of, the head decoded, and the temporaries of decoding the largest
  matrix; uncompressed, the two slots offloaded decoder layers load into and the embedding
  or head loaded apart;
* past KV in flight [load_cache]: a GPU batch's past rows of one layer, decoded on the
  device, for each compute the loop runs ahead of (`LOAD_WINDOW`) and the next prefetched;
* stores in flight [store_cache, store_activation]: new KV rows headed for host memory
  (`STORE_WINDOW` GPU batches' layers of them, and the one being made) and activations;
* activations homed on the device (the block's residual between layers);
* CUDA graphs [setup, graph pool], where the weights are uncompressed and the model is
  neither a MoE nor a hybrid (the engine captures none over 4-bit layers, routed experts or
  state layers): the static buffers of each GPU batch's most rows and the pool's
  blocks, one capture's transient buffers (`graph_bytes`).
"""

from __future__ import annotations

from dataclasses import dataclass

from policy.affine import Affine, policy_vector
from policy.policy import Policy
from policy.specs import ModelSpec, compressed_bytes_per_element
from policy.steps import default_step_tokens

STORE_WINDOW = 3
"""Copies of new KV rows to host memory the layer loop may run ahead of (`CopyWindow`, in
the block pipeline): the device holds at most this many GPU batches' layers of them, plus
the one being made."""
LOAD_WINDOW = 1
"""Computes that read what the layer loop loaded (weights decoded on the device, past KV,
activations) the loop may run ahead of the device (`CopyWindow`, in the block pipeline):
what a compute reads stays on the device until it has run, so the device holds the loads of
the batch computing, of this many queued before it and of the one prefetched; unbounded, a
host ahead of the device held every layer's (OPT-6.7B's 96-sequence batches of 512 past
tokens: 48 GiB, found by the rehearsal, engine/rehearsal.py)."""
IN_FLIGHT = LOAD_WINDOW + 2
"""Loads alive at once: the compute running, LOAD_WINDOW queued, the next prefetched."""
PIECEWISE_MAX_ROWS = 512
"""The most rows a mixed or prefill step replays CUDA graphs at (the discrete sizes up to it
are captured; a larger step, an offloaded block's prefill, runs eagerly: its layers' GEMMs
outlast their launches, and its graphs would hold that many rows' buffers for good). vLLM's
largest capture size by default. At 2,048 the graphs of OPT-6.7B's 2,048-token steps held
0.30 GiB, which pushed its 48 x 1 fp16 plan (172.7 tokens/s predicted on the H200, 168.9
with them priced) below the 4-bit 64 x 6 one; at 512, 0.07 GiB (171.7: docs/benchmarks.md,
Stand-in decode steps)."""
DEQUANTIZE_TEMPORARY = 4.5
"""Bytes per element dequantizing a 4-bit matrix holds at its peak besides its output: the
codes (1 B), their float32 values and the float32 product (engine/storage/quant.py:
dequantize), over the largest matrix of a layer."""


@dataclass(frozen=True)
class StepShape:
    """The token counts a step runs per GPU batch, from the engine's step budget."""

    prefill_tokens: int
    """A GPU batch's prompt tokens in one prefill step (at most the step's)."""
    prefill_past: int
    """Past tokens a GPU batch's prefill chunk attends to (a prompt cut over steps: one
    sequence's chunk fills the step)."""
    decode_past: int
    """Keys a GPU batch's sequences attend to, all together, in their last decode step."""
    logit_rows: int
    """Rows of logits alive at once: the block's (one per sequence), at most a step's."""
    step_tokens: int
    """The step's token budget (the engine's default for the policy unless given)."""


def step_shape(
    model: ModelSpec, policy: Policy, prompt_len: int, gen_len: int, step_tokens: int | None
) -> StepShape:
    """`step_tokens` None: the engine's default for the policy (`default_step_tokens`)."""
    steps = default_step_tokens(policy, prompt_len) if step_tokens is None else step_tokens
    gbs = policy.gpu_batch_size
    whole = gbs * prompt_len
    tokens = min(whole, steps)
    past = max(0, prompt_len - steps)  # a prompt longer than a step: its last chunk's past
    return StepShape(
        prefill_tokens=tokens,
        prefill_past=past,
        decode_past=int(gbs * model.attended_len(prompt_len + gen_len)),
        logit_rows=min(policy.block_size, steps),
        step_tokens=steps,
    )


def step_workspace_bytes(
    model: ModelSpec, tokens: int, rows: int, dequantized_layer: float = 0.0
) -> float:
    """Device bytes one step's compute holds at its peak beside the homed weights and KV:
    `tokens` rows through one layer at once (the residual, its normed copy, and the larger
    of the attention's projections and output and the MLP's widest intermediates; a MoE
    layer's routed copies of its rows), the sampled `rows`' logits in the compute type, in
    float32 and their float32 softmax, and two `dequantized_layer`s (a 4-bit layer decoded
    beside the next one's). A flat 10% of a 4 GiB budget did not hold OPT-125M's 1,024 rows
    of 50,272 logits on the H200 (tests/engine/executor/test_budgets.py measures a step's
    buffers against it)."""
    m, itemsize = model, model.dtype_bytes
    h, q_dim = m.hidden_size, m.num_heads * m.head_dim
    attention = m.kv_row_dim + 2 * q_dim  # q, k, v, then the attention's output
    width = max(m.intermediate_size, m.shared_expert_intermediate_size)
    routed = m.num_experts_per_tok * (m.moe_intermediate_size + h) if m.num_experts else 0
    mlp = 3 * max(width, routed)  # gate and up (or fc1), then the activation's output
    per_token = (2 * h + max(attention, mlp)) * itemsize
    logits = rows * m.head_width * (itemsize + 2 * 4)
    return tokens * per_token + logits + 2 * dequantized_layer


def graph_bytes(model: ModelSpec, policy: Policy, step_tokens: int) -> float:
    """Device bytes the CUDA graphs of `policy`'s steps hold for good
    (engine/executor/cuda_graphs.py): each GPU batch's (and nano-batch's) static buffers at
    its most rows (token ids, positions and their rotary tables, the states, q, k, v and the
    attention's output), and the pool every capture shares, one capture's transient buffers
    at the most rows (a layer's workspace). One GPU batch: the discrete sizes up to the
    step's `step_tokens` (at most `PIECEWISE_MAX_ROWS`), which mixed and prefill steps replay;
    several: each batch's decode rows."""
    m, itemsize = model, model.dtype_bytes
    q_dim = m.num_heads * m.head_dim
    per_row = (m.hidden_size + 2 * q_dim + m.kv_row_dim) * itemsize + 16 + 2 * 4 * m.head_dim
    rows = policy.gpu_batch_size
    if policy.num_gpu_batches == 1:
        rows = max(rows, min(step_tokens, PIECEWISE_MAX_ROWS))
    owners = policy.num_gpu_batches * (2 if policy.num_nano_batches > 1 else 1)  # nano's too
    return owners * rows * per_row + step_workspace_bytes(m, rows, 0)


def _layer_elements(model: ModelSpec) -> tuple[float, float]:
    """A decoder layer's elements (routed experts apart) and the largest matrix's, the head's
    included."""
    layer = (model.layers_params - model.total_expert_params) / model.num_layers
    h = model.hidden_size
    widest = max(model.intermediate_size, model.shared_expert_intermediate_size)
    largest = max(widest * h * (1 if model.arch == "opt" else 2), model.vocab_size * h)
    return layer, float(largest)


def gpu_reserves(
    model: ModelSpec,
    policy: Policy,
    prompt_len: int,
    gen_len: int,
    step_tokens: int | None = None,
    slot_bytes: float | None = None,
) -> dict[str, Affine]:
    """The reserves of `policy`'s discrete choices by stage ("prefill", "decode"), affine in
    the fractions. `slot_bytes`: the weight slots' bytes where the engine knows them (None:
    two uncompressed layers for the share of layers off the device)."""
    shape = step_shape(model, policy, prompt_len, gen_len, step_tokens)
    dtype = model.dtype_bytes
    layer, largest = _layer_elements(model)
    packed = compressed_bytes_per_element(dtype) if policy.compress_weights else dtype
    head = model.vocab_size * (model.word_embed_dim or model.hidden_size)  # embedding, head
    if policy.compress_weights:  # every layer is decoded on the device, wherever it lies
        decoded = IN_FLIGHT * layer * dtype + head * dtype + DEQUANTIZE_TEMPORARY * largest
        weights = Affine.of(decoded + IN_FLIGHT * layer * packed, wg=-IN_FLIGHT * layer * packed)
    else:  # two slots for decoder layers off the device, the embedding or head loaded apart
        slots = 2 * layer * dtype if slot_bytes is None else slot_bytes
        captures = not (model.num_experts or model.is_hybrid)  # routing, states: no graphs
        graphs = graph_bytes(model, policy, shape.step_tokens) if captures else 0.0
        weights = Affine.of(slots + head * dtype + graphs, wg=-slots - head * dtype)
    kv_row, act_row = model.kv_bytes_per_token_per_layer, model.hidden_bytes_per_token
    out = {}
    for stage, tokens, past in (
        ("prefill", shape.prefill_tokens, shape.prefill_past),
        ("decode", policy.gpu_batch_size, shape.decode_past),
    ):
        workspace = step_workspace_bytes(model, tokens, shape.logit_rows)
        stores = min(STORE_WINDOW + 1, model.num_kv_layers * policy.num_gpu_batches) * tokens
        acts = 2 * tokens * act_row
        if stage == "decode" and policy.cpu_attention:
            past = 0  # the CPU reads the past where it lies
        host_kv = IN_FLIGHT * past * kv_row + stores * kv_row
        out[stage] = (
            Affine.of(workspace, hg=policy.block_size * prompt_len * act_row)
            + weights
            + Affine.of(cc=host_kv, cd=host_kv, hc=acts, hd=acts)
        )
    return out


def reserve_bytes(reserves: dict[str, Affine], policy: Policy) -> int:
    """The most the reserves hold at `policy`'s fractions, over the stages."""
    x = policy_vector(policy)
    return int(max(row(x) for row in reserves.values()))

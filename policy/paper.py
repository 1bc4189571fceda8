"""FlexGen's hand-picked policies from its paper (arXiv version, Table 15), in our notation.

FlexGen writes a policy as (gbs x #gb, wg, wc, cg, cc, hg, hc) in percent, the
disk share being the rest; here each becomes a (gpu, cpu, disk) triple. Used to
evaluate the cost model on the paper's own choices (docs/policy.md section 6)
and as the "FlexGen's policy instead of the searched one" ablation.
"""

from __future__ import annotations

from policy.policy import Policy

FLEXGEN_TABLE15: dict[str, Policy] = {
    # OPT-30B, prompt 512, gen 32, T4 16 GB: 48x3, 20, 80, 0, 100, 0, 100, CPU attention
    "opt-30b": Policy(
        gpu_batch_size=48,
        num_gpu_batches=3,
        weights_frac=(0.2, 0.8, 0.0),
        kv_frac=(0.0, 1.0, 0.0),
        act_frac=(0.0, 1.0, 0.0),
        cpu_attention=True,
    ),
    # OPT-30B with 4-bit weights and KV: 16x20, 20, 80, 0, 100, 100, 0, GPU attention
    "opt-30b-compressed": Policy(
        gpu_batch_size=16,
        num_gpu_batches=20,
        weights_frac=(0.2, 0.8, 0.0),
        kv_frac=(0.0, 1.0, 0.0),
        act_frac=(1.0, 0.0, 0.0),
        compress_weights=True,
        compress_kv=True,
    ),
    # OPT-175B: 32x8, 0, 50, 0, 0, 0, 0 (KV and activations on disk), CPU attention
    "opt-175b": Policy(
        gpu_batch_size=32,
        num_gpu_batches=8,
        weights_frac=(0.0, 0.5, 0.5),
        kv_frac=(0.0, 0.0, 1.0),
        act_frac=(0.0, 0.0, 1.0),
        cpu_attention=True,
    ),
    # OPT-175B with 4-bit weights and KV: 48x3, 0, 100, 0, 100, 0, 100, GPU attention
    "opt-175b-compressed": Policy(
        gpu_batch_size=48,
        num_gpu_batches=3,
        weights_frac=(0.0, 1.0, 0.0),
        kv_frac=(0.0, 1.0, 0.0),
        act_frac=(0.0, 1.0, 0.0),
        compress_weights=True,
        compress_kv=True,
    ),
}

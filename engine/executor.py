"""`Executor`: owns the device, placed weights and KV pools; runs one `StepPlan` per call."""

from __future__ import annotations

import contextlib
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from engine.batch import BatchBuilder, SeqState
from engine.checkpoint import open_reader, read_hf_config, resolve_model_dir
from engine.config import ModelConfig
from engine.device import Device
from engine.disk import DiskIO
from engine.kv_store import KVStore
from engine.models import build_model
from engine.pipeline import BlockPipeline
from engine.protocol import SeqChunk, StepPlan, StepResult, TokenLogprobs
from engine.quant import KVRowCodec
from engine.sampler import Sampler, top_logprobs
from engine.sampling_params import SamplingParams
from engine.weight_store import WeightStore
from policy import TIERS, Policy
from policy.errors import UserError

KV_BLOCK_TOKENS = 16


class MemoryBudgetError(UserError):
    """The policy places more on a tier than its budget allows."""


class Executor:
    """The engine side of the step protocol. Construct, call `execute(plan)` per step, `close()`."""

    def __init__(
        self,
        model: str | Path | None,
        policy: Policy,
        *,
        device: str = "auto",
        offload_dir: str | Path | None = None,
        gpu_mem: int | None = None,
        cpu_mem: int | None = None,
        disk_mem: int | None = None,
        dtype: torch.dtype | None = None,
        show_progress: bool = False,
    ) -> None:
        if policy.num_nano_batches != 1:
            raise UserError(
                f"num_nano_batches={policy.num_nano_batches}: nano-batching is not implemented "
                "yet; use 1"
            )
        self.policy = policy
        self.device = Device.resolve(device)
        self.model_dir = resolve_model_dir(None if model is None else str(model))
        hf_config = read_hf_config(self.model_dir)
        self.config = ModelConfig.from_hf(hf_config)
        self.model = build_model(self.config)
        # transformers 5 names it `dtype` (reading `torch_dtype` there warns); 4.x `torch_dtype`
        raw_dtype = vars(hf_config).get("dtype") or vars(hf_config).get("torch_dtype")
        checkpoint_dtype = (
            getattr(torch, raw_dtype, None) if isinstance(raw_dtype, str) else raw_dtype
        )
        self.dtype = dtype or self.device.default_dtype(
            checkpoint_dtype if isinstance(checkpoint_dtype, torch.dtype) else None
        )
        if policy.num_cpu_threads > 0:
            torch.set_num_threads(policy.num_cpu_threads)
        if policy.num_interop_threads > 0:
            # settable once per process, before any inter-op work: later calls keep the first
            with contextlib.suppress(RuntimeError):
                torch.set_num_interop_threads(policy.num_interop_threads)
        self.gpu_mem, self.cpu_mem, self.disk_mem = gpu_mem, cpu_mem, disk_mem
        if self.device.is_cuda and gpu_mem is not None:
            total = torch.cuda.get_device_properties(self.device.device).total_memory
            torch.cuda.set_per_process_memory_fraction(
                min(1.0, gpu_mem / total), self.device.device
            )
        self._own_offload_dir = offload_dir is None
        self.offload_dir = Path(offload_dir or tempfile.mkdtemp(prefix="nanoflex-offload-"))
        self.disk = DiskIO(self.offload_dir, policy.num_copy_threads)

        def progress(done: int, total: int) -> None:
            print(f"\rloading {self.model_dir.name}: layer {done}/{total}", end="", file=sys.stderr)
            if done == total:
                print(file=sys.stderr)

        self.weights = WeightStore(
            self.model,
            open_reader(self.model_dir),
            weights_frac=policy.weights_frac,
            compress=policy.compress_weights,
            dtype=self.dtype,
            device=self.device,
            disk=self.disk,
            progress=progress if show_progress else None,
        )
        codec = KVRowCodec(2 * self.config.kv_dim, compress=policy.compress_kv, dtype=self.dtype)
        self.kv = KVStore(self.config.num_layers, KV_BLOCK_TOKENS, codec, self.device, self.disk)
        self._check_budgets()
        self.pipeline = BlockPipeline(
            self.model,
            self.weights,
            self.kv,
            self.device,
            self.disk,
            overlap=policy.overlap,
            dtype=self.dtype,
        )
        self.sampler = Sampler()
        self._seqs: dict[int, SeqState] = {}
        self._builder = BatchBuilder(
            self.device.device,
            KV_BLOCK_TOKENS,
            cpu_attention=policy.cpu_attention,
            sliding_window=self.config.sliding_window,
            pool_device=self.kv.pool_device,
        )

    # -- capacity ----------------------------------------------------------------------

    @property
    def block_tokens(self) -> int:
        return KV_BLOCK_TOKENS

    def _check_budgets(self) -> None:
        placed = self.weights.bytes_per_tier()
        for tier, budget in (("gpu", self.gpu_mem), ("cpu", self.cpu_mem), ("disk", self.disk_mem)):
            if budget is not None and placed[tier] > budget:
                raise MemoryBudgetError(
                    f"weights placed on {tier} take {placed[tier] / 2**30:.2f} GiB, over the "
                    f"{budget / 2**30:.2f} GiB budget; lower weights_frac[{TIERS.index(tier)}]"
                )

    def kv_capacity_blocks(self) -> dict[str, int | None]:
        """KV blocks each tier may hold: its budget less its weights (10% of the gpu budget is
        kept for activations and workspace). None means bounded only by the machine."""
        placed = self.weights.bytes_per_tier()
        out: dict[str, int | None] = {"gpu": None, "cpu": None, "disk": None}
        budgets = (
            ("gpu", self.gpu_mem, 0.1),
            ("cpu", self.cpu_mem, 0.0),
            ("disk", self.disk_mem, 0.0),
        )
        for tier, budget, reserve in budgets:
            if budget is not None:
                free = budget * (1 - reserve) - placed[tier]
                out[tier] = max(0, int(free // self.kv.block_bytes))
        return out

    def describe(self) -> dict[str, Any]:
        """What a scheduler in another process needs to plan for this engine."""
        return {
            "model_dir": str(self.model_dir),
            "block_tokens": self.block_tokens,
            "kv_capacity_blocks": self.kv_capacity_blocks(),
            "placement": self.placement(),
        }

    def placement(self) -> dict[str, Any]:
        """What was realized: bytes per tier for weights, KV and activations, and layer homes."""
        weights = self.weights.bytes_per_tier()
        total = sum(weights.values()) or 1
        return {
            "planned_weights_frac": list(self.policy.weights_frac),
            "realized_weights_frac": [round(weights[t] / total, 4) for t in TIERS],
            "weights_bytes": weights,
            "kv_bytes": self.kv.bytes_per_tier(),
            "act_bytes": dict(self.pipeline.act_bytes),
            "weight_tiers": list(self.weights.tiers),
            "device": str(self.device.device),
            "dtype": str(self.dtype).removeprefix("torch."),
        }

    # -- one step ----------------------------------------------------------------------

    def execute(self, plan: StepPlan) -> StepResult:
        start = time.perf_counter()
        for seq_id in plan.freed_seq_ids:
            self._seqs.pop(seq_id, None)
        by_batch: dict[int, list[SeqChunk]] = {}
        for chunk in plan.chunks:
            self._admit(chunk)
            by_batch.setdefault(chunk.batch_index, []).append(chunk)
        batches = [
            self._builder.build(k, [(c, self._seqs[c.seq_id]) for c in chunks])
            for k, chunks in sorted(by_batch.items())
        ]
        logits = self.pipeline.run(batches)
        # Split each batch's logit rows by chunk: the row to sample from, and for echo +
        # logprobs requests the prompt positions. Rows follow batch order; results plan order.
        sample_rows: list[torch.Tensor] = []
        sampled: list[SeqChunk] = []
        prompt_logprobs: dict[int, list[TokenLogprobs]] = {}
        for batch, batch_logits, (_, chunks) in zip(
            batches, logits, sorted(by_batch.items()), strict=True
        ):
            start = 0
            for c, count in zip(chunks, batch.logit_counts, strict=True):
                rows, start = batch_logits[start : start + count], start + count
                state = self._seqs[c.seq_id]
                if state.wants_prompt_logprobs:
                    score_prompt(c, state, rows)
                    if c.do_sample:
                        prompt_logprobs[c.seq_id] = state.prompt_logprobs
                if c.do_sample:
                    sample_rows.append(rows[-1:])
                    sampled.append(c)
                    state.has_sampled = True
        token_ids, logprobs = self.sampler.sample(
            torch.cat(sample_rows) if sampled else torch.empty(0),
            [self._seqs[c.seq_id].sampling for c in sampled],
            [c.num_sampled for c in sampled],
        )
        by_seq = {c.seq_id: i for i, c in enumerate(sampled)}
        order = [by_seq[c.seq_id] for c in plan.chunks if c.do_sample]
        self.device.synchronize()
        return StepResult(
            plan.step_id,
            [sampled[i].seq_id for i in order],
            [token_ids[i] for i in order],
            [logprobs[i] for i in order],
            prompt_logprobs=prompt_logprobs,
            step_seconds=time.perf_counter() - start,
        )

    def _admit(self, chunk: SeqChunk) -> None:
        state = self._seqs.get(chunk.seq_id)
        if state is None:
            if chunk.sampling is None:
                raise ValueError(f"first chunk of sequence {chunk.seq_id} carries no sampling")
            state = self._seqs[chunk.seq_id] = SeqState(
                chunk.kv_tier, chunk.act_tier, chunk.sampling
            )
        state.block_ids.extend(chunk.new_block_ids)
        if chunk.new_block_ids:
            self.kv.reserve(state.kv_tier, max(chunk.new_block_ids) + 1)

    def score(self, prompts: list[list[int]], prefill_len: int | None = None) -> list[torch.Tensor]:
        """(len, vocab) float32 logits at every position of each prompt: for offline
        log-likelihood evaluation and for measuring compressed paths. The first `prefill_len`
        tokens (all by default) run as one prefill; the rest one per step, as decodes that read
        the KV cache back. Uses its own KV blocks: not while scheduled requests are in flight."""
        from engine.block_manager import BlockManager

        blocks = BlockManager(KV_BLOCK_TOKENS, {})
        greedy = SamplingParams(max_tokens=1, temperature=0.0)
        out = []
        for i, prompt in enumerate(prompts):
            seq_id = -1 - i  # negative ids never collide with the scheduler's
            first = len(prompt) if prefill_len is None else max(1, min(prefill_len, len(prompt)))
            pieces = [(0, first)] + [(t, t + 1) for t in range(first, len(prompt))]
            logits = []
            for start, stop in pieces:
                new_blocks = blocks.append(seq_id, stop - start, "gpu")
                chunk = SeqChunk(
                    seq_id,
                    list(prompt[start:stop]),
                    start,
                    0,
                    new_blocks,
                    "gpu",
                    "gpu",
                    do_sample=False,
                    sampling=greedy,
                )
                self._admit(chunk)
                batch = self._builder.build(0, [(chunk, self._seqs[seq_id])])
                batch.logit_rows = torch.arange(stop - start, device=self.device.device)
                logits.append(self.pipeline.run([batch])[0].cpu())
            out.append(torch.cat(logits))
            self._seqs.pop(seq_id)
            blocks.free(seq_id)
        return out

    def shutdown(self) -> None:
        self.close()

    def close(self) -> None:
        self.pipeline.close()
        self.disk.close()
        if self._own_offload_dir:
            shutil.rmtree(self.offload_dir, ignore_errors=True)


def build_executor(
    model: str | None = None, policy: dict[str, Any] | None = None, **kwargs: Any
) -> Executor:
    """Factory for the engine process: plain arguments in (they cross a process boundary)."""
    return Executor(model, Policy.from_dict(policy or {}), **kwargs)


def score_prompt(chunk: SeqChunk, state: SeqState, logits: torch.Tensor) -> None:
    """Logprobs of a prompt chunk's tokens (echo + logprobs). logits: (q_len, vocab), row r
    predicting position start_pos + r + 1; the prediction for the chunk's first token was
    left by the previous chunk. Position 0 has no logprob, as in OpenAI's API."""
    log_probs = torch.log_softmax(logits.float(), dim=-1).cpu()
    for i, token_id in enumerate(chunk.token_ids):
        row = state.pending_logprobs if i == 0 else log_probs[i - 1]
        if row is not None:
            state.prompt_logprobs.append(top_logprobs(row, token_id, state.sampling.logprobs))
    state.pending_logprobs = log_probs[-1]

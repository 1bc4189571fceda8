"""`StepRunner`: runs one `StepPlan` on an assembled engine and answers with its `StepResult`.

A step admits the plan's chunks (new sequences' sampling, pages, images), stages the GPU
batches and the draws, applies the plan's page moves and copies layer by layer as the
block pipeline runs, then splits each batch's logit rows by chunk: the rows sampled, a
prompt's logprobs (echo), a pooling request's head row.
"""

from __future__ import annotations

import torch

from base.pages import PAGE_TOKENS
from engine.core.kv_pages import PageMove
from engine.core.protocol import SeqChunk, StepFailure, StepPlan, StepResult, TokenLogprobs
from engine.executor.assembly import EngineAssembly
from engine.executor.batch_builder import BatchBuilder
from engine.executor.gpu_batch import GpuBatch, SeqState
from engine.executor.nano_batches import NanoBatcher
from engine.executor.scoring import pool, score_prompt
from engine.executor.vision_encoder import UNUSED
from engine.storage.disk import OffloadIOError


class StepRunner:
    """Runs the scheduler's plans on `engine`, keeping each running sequence's `SeqState`
    (page table, sampling, prompt logprobs) between steps."""

    def __init__(self, engine: EngineAssembly) -> None:
        self.engine = engine
        self.seqs: dict[int, SeqState] = {}
        """Sequence id -> what the executor keeps of it between steps."""
        e, policy = engine, engine.policy
        self.builder = BatchBuilder(
            e.device.device,
            PAGE_TOKENS,
            cpu_attention=policy.cpu_attention,
            windows=e.config.windows,
            pool_device=e.kv.pool_device,
            positions=lambda ids: e.model.positions(ids, e.dtype),
            paged_attention=e.args.paged_attention and not policy.compress_kv,
            inputs=e.inputs,
            mrope=bool(e.config.mrope_section),
        )
        self.nano_batcher = (
            NanoBatcher(policy.num_nano_batches, self.builder)
            if policy.num_nano_batches > 1
            else None
        )

    def execute(self, plan: StepPlan) -> StepResult:
        """Run one plan. A cached disk page that fails verification, or a read or write of the
        offload directory that fails (a full disk, an I/O error), ends the step early with a
        `StepFailure` instead of tokens: the scheduler recomputes its sequences."""
        e = self.engine
        for seq_id in plan.freed_seq_ids:
            e.sampler.drop(seq_id)
            gone = self.seqs.pop(seq_id, None)
            if gone is not None:  # drop what is staged for its partly written disk pages
                e.kv.disk_pool.release_pages([p for tier, p in gone.pages if tier == "disk"])
        for page, h in plan.cached_disk_pages:  # cached by earlier steps: record them
            e.disk_cache.add(page, h)
        if not plan.chunks:  # records only: nothing runs
            e.disk_cache.save()
            return StepResult(plan.step_id, [], [], [], bytes_per_tier=e.bytes_per_tier())
        bad = e.disk_cache.failed_checks(plan.page_moves, plan.disk_hits)
        if bad:
            message = f"{len(bad)} cached KV page(s) on disk failed verification"
            return self._failed(plan, StepFailure(message, bad_pages=bad))
        try:
            return self._run(plan)
        except OffloadIOError as err:
            e.sampler.discard()
            e.disk_cache.forget(err.pages)
            failure = StepFailure(str(err), "disk", self._disk_users(plan), err.pages)
            return self._failed(plan, failure)

    def _run(self, plan: StepPlan) -> StepResult:
        e = self.engine
        by_batch: dict[int, list[SeqChunk]] = {}
        forks: list[SeqChunk] = []  # no tokens to run: they sample from their leader's row
        for chunk in plan.chunks:
            self.admit(chunk)
            if chunk.forked_from is None:
                by_batch.setdefault(chunk.gpu_batch, []).append(chunk)
            else:
                forks.append(chunk)
        for copy in plan.page_copies:  # copy-on-write: the copy is made with the page moves
            self.seqs[copy.seq_id].pages[copy.index] = copy.dst
        moves = [*plan.page_moves, *(PageMove(c.src, c.dst, "") for c in plan.page_copies)]
        batches = self._stage(plan, by_batch, forks)
        e.kv.reserve_pages([m.dst for m in moves])
        moved_to_disk = [m.dst[1] for m in plan.page_moves if m.dst[0] == "disk"]
        e.kv.disk_pool.begin_pages(moved_to_disk)
        e.disk_cache.forget(moved_to_disk + self._disk_pages_written(plan))  # new contents
        logits = e.pipeline.run(batches, moves)
        for c in plan.chunks:  # a hybrid's state at the end of a shared prefix, kept
            if c.state_save is not None:
                assert e.states is not None and c.state_slot is not None
                e.states.copy(c.state_slot, c.state_save)
        for move in plan.page_moves:  # spilled to disk, or loaded up from there
            if move.dst[0] == "disk":
                e.disk_cache.add(move.dst[1], move.hash)
        e.disk_cache.save()
        # Split each batch's logit rows by chunk: the row to sample from, and for echo +
        # logprobs requests the prompt positions. Rows follow batch order; results plan order.
        sample_rows: list[torch.Tensor] = []
        sampled: list[SeqChunk] = []
        prompt_logprobs: dict[int, list[TokenLogprobs]] = {}
        pooled_rows: list[torch.Tensor] = []  # (width,) each: a pooling request's head row
        pooled_ids: list[int] = []
        for batch, batch_logits, (_, chunks) in zip(
            batches, logits, sorted(by_batch.items()), strict=True
        ):
            row = 0
            for c, count in zip(chunks, batch.logit_counts, strict=True):
                rows, row = batch_logits[row : row + count], row + count
                state = self.seqs[c.seq_id]
                if state.wants_prompt_logprobs:
                    score_prompt(c, state, rows)
                    if c.do_sample:
                        prompt_logprobs[c.seq_id] = state.prompt_logprobs
                if c.do_sample and state.sampling.pooling:  # its answer, not a token
                    pooled_rows.append(rows[-1])
                    pooled_ids.append(c.seq_id)
                elif c.do_sample:
                    sample_rows.append(rows[-1:])
                    sampled.append(c)
                    state.has_sampled = True
        pooled = pool(e.pooler, pooled_rows, pooled_ids)
        by_seq = {c.seq_id: i for i, c in enumerate(sampled)}  # its row in sample_rows
        for fork in forks:  # the same logits row, sampled with the fork's own settings
            assert fork.forked_from is not None
            by_seq[fork.seq_id] = len(sampled)
            sample_rows.append(sample_rows[by_seq[fork.forked_from]])
            sampled.append(fork)
            self.seqs[fork.seq_id].has_sampled = True
        whole = not forks and len(logits) == 1 and len(sample_rows) == logits[0].shape[0]
        token_ids, logprobs, errors = e.sampler.sample(
            # every row of the one batch, in order (a decode step): no copy
            logits[0] if whole else torch.cat(sample_rows) if sampled else torch.empty(0)
        )
        order = [by_seq[c.seq_id] for c in plan.chunks if c.seq_id in by_seq]
        if not e.is_resident or moves:  # stores on other streams: fence them
            e.device.synchronize()
        return StepResult(
            plan.step_id,
            [sampled[i].seq_id for i in order],
            [token_ids[i] for i in order],
            [logprobs[i] for i in order],
            prompt_logprobs=prompt_logprobs,
            bytes_per_tier=e.bytes_per_tier(),
            errors=errors,
            pooled=pooled,
        )

    def _stage(
        self, plan: StepPlan, by_batch: dict[int, list[SeqChunk]], forks: list[SeqChunk]
    ) -> list[GpuBatch]:
        """Stages the step's draws (grammar masks start now, while layers run) and its GPU
        batches, the last padded to the step's discrete size, cut into nano-batches."""
        e = self.engine
        padding = max(0, plan.dense_size - plan.num_tokens)  # to the step's discrete size
        last = max(by_batch)
        e.inputs.begin_step()
        to_sample = [
            c
            for _, cs in sorted(by_batch.items())
            for c in cs
            if c.do_sample and not self.seqs[c.seq_id].sampling.pooling
        ] + forks
        e.sampler.prepare(  # stages the draws; grammar masks start now, while layers run
            to_sample,
            [self.seqs[c.seq_id].sampling for c in to_sample],
            [not self.seqs[c.seq_id].has_sampled for c in to_sample],
        )
        members = {k: [(c, self.seqs[c.seq_id]) for c in cs] for k, cs in by_batch.items()}
        batches = self.builder.build_step(  # stages the batches, copies all in one go
            [(k, members[k], padding if k == last else 0) for k in sorted(by_batch)]
        )
        if self.nano_batcher is not None:
            for batch in batches:
                batch.nano_batches = self.nano_batcher.split(batch, members[batch.index])
        return batches

    def _disk_pages_written(self, plan: StepPlan) -> list[int]:
        """Disk pages the plan's chunks write new KV into."""
        out: list[int] = []
        for c in plan.chunks:
            if not c.token_ids:  # a fork writes nothing
                continue
            pages = self.seqs[c.seq_id].pages
            first, last = (
                c.start_pos // PAGE_TOKENS,
                (c.start_pos + len(c.token_ids) - 1) // PAGE_TOKENS,
            )
            out.extend(p for tier, p in pages[first : last + 1] if tier == "disk")
        return out

    def admit(self, chunk: SeqChunk) -> None:
        """Takes in a chunk's sequence (the first time: its state slot, sampling and images)
        and its new pages."""
        e = self.engine
        state = self.seqs.get(chunk.seq_id)
        if state is None:
            if chunk.sampling is None:
                raise ValueError(f"first chunk of sequence {chunk.seq_id} carries no sampling")
            state = self.seqs[chunk.seq_id] = SeqState(
                chunk.kv_tier, chunk.act_tier, chunk.sampling, state=chunk.state_slot
            )
            if chunk.state_slot is not None:  # a sequence (or its recompute) starts at zero
                assert e.states is not None  # or at the state its cached prefix ends with
                if chunk.state_restore is not None:
                    e.states.copy(chunk.state_restore, chunk.state_slot)
                else:
                    assert chunk.start_pos == 0
                    e.states.reset(*chunk.state_slot)
            e.sampler.admit(chunk.seq_id, chunk.sampling)
            if chunk.media is not None:
                if e.vision is None:
                    raise ValueError(f"sequence {chunk.seq_id} has images; the model takes text")
                state.media = chunk.media
                state.image_features = [  # an image in the cached prefix is never run again
                    e.vision.features(i) if i.start + i.num_tokens > chunk.start_pos else UNUSED
                    for i in chunk.media.images
                ]
        e.sampler.feed(chunk)
        state.pages.extend(chunk.new_pages)
        e.kv.reserve_pages(chunk.new_pages)
        # fresh disk pages start clean (a cached prefix page is full: nothing staged for it)
        e.kv.disk_pool.begin_pages([p for tier, p in chunk.new_pages if tier == "disk"])

    def batch_of(self, chunk: SeqChunk) -> GpuBatch:
        """The GPU batch (index 0) of one admitted chunk alone, outside a step's staging."""
        return self.builder.build(0, [(chunk, self.seqs[chunk.seq_id])])

    def _disk_users(self, plan: StepPlan) -> list[int]:
        """Sequences of the plan that use the disk tier: all of them when weights live there,
        else those with KV pages or activations there."""
        if self.engine.weights.uses_tier("disk"):
            return [c.seq_id for c in plan.chunks]
        out = []
        for c in plan.chunks:
            state = self.seqs.get(c.seq_id)
            pages = state.pages if state is not None else c.new_pages
            if c.act_tier == "disk" or c.kv_tier == "disk" or any(t == "disk" for t, _ in pages):
                out.append(c.seq_id)
        return out

    def _failed(self, plan: StepPlan, failure: StepFailure) -> StepResult:
        return StepResult(
            plan.step_id, [], [], [], bytes_per_tier=self.engine.bytes_per_tier(), failure=failure
        )

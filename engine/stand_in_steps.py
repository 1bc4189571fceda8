"""`StandIns`: the rehearsal (engine/rehearsal.py) runs the layer loop of only some decode
steps of a run of like ones, and bounds the others' peak by the next one it runs.

A fake-tensor operator costs about as much as its Python meta kernel, a millisecond or so on
a busy 2-core box, and a decode step of an offloaded plan is every layer of every GPU batch:
OPT-30B's 12 x 8 plan is 384 layer runs of some 160 operators a step, minutes a step. The
decode steps of one block differ only in how much past each sequence attends to. Here a
decode step whose layer loop is *like* the last one run (the same sequences in the same GPU
batches, one token each, on the same tiers, no KV page moved) is stood in for: everything
outside the loop runs and is counted as ever (the scheduler, the KV pages reserved, the
step's inputs staged, the sampler), the loop itself returns the logits the last run loop
returned, as fresh device tensors of the same shapes. Each stood-in step is then bounded by
the next like step whose loop runs: its loop's peak above the bytes alive when it started
(`Loop.rise`), added to the bytes alive when the stood-in loop would have started. Every
tensor a like step's loop makes grows with the past its sequences attend to (the past KV
loaded, the padded keys and values, the mask) and nothing else differs, so the later step's
rise is at least the stood-in one's; the last decode step of each sequence always runs, so
every stood-in step gets a bound (tests/engine/test_rehearsal.py runs a case both ways: the
same peak, and every step's bound at least its own peak).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from engine.storage.device_ledger import DeviceLedger

Like = tuple[tuple[int, int, str, str, bool], ...]
"""A decode step's loop, up to its past: per chunk (sequence, GPU batch, KV tier, activation
tier, samples)."""


@dataclass(frozen=True)
class Loop:
    """One layer loop the rehearsal ran."""

    step: str
    like: Like
    positions: tuple[int, ...]
    """Per chunk, the position of its token (the past it attends to)."""
    start_bytes: int
    """The bytes alive when the loop started."""
    rise: int
    """The most bytes alive during the loop less those alive when it started."""
    logits: tuple[tuple[tuple[int, ...], torch.dtype], ...]
    """The shape and type of each GPU batch's logits it returned."""


@dataclass
class StoodIn:
    """A decode step whose loop did not run: the bytes alive when it would have started."""

    step: str
    like: Like
    positions: tuple[int, ...]
    start_bytes: int
    bound: int | None = None
    bounded_by: str | None = None


def decode_like(plan: Any) -> Like | None:
    """`plan`'s loop up to its past, or None unless every chunk decodes one token and no KV
    page moves between tiers (a move runs inside the loop)."""
    if plan.page_moves or plan.page_copies or not plan.chunks:
        return None
    if any(len(c.token_ids) != 1 or c.forked_from is not None for c in plan.chunks):
        return None
    return tuple((c.seq_id, c.gpu_batch, c.kv_tier, c.act_tier, c.do_sample) for c in plan.chunks)


class StandIns:
    """Which decode steps' loops run (every `stride`-th of a run of like steps, and each
    sequence's last, at position `last_position`), and the bounds of the others.
    `stride` 1: every loop runs (the switch off)."""

    def __init__(self, ledger: DeviceLedger, stride: int, last_position: int) -> None:
        self.ledger = ledger
        self.stride = max(1, stride)
        self.last_position = last_position
        self.loops: list[Loop] = []
        self.stood_in: list[StoodIn] = []
        self._pending: list[StoodIn] = []
        self._plan: Any = None
        self._step = ""
        self._since_run = 0

    def begin(self, step: str, plan: Any) -> None:
        """The executor starts `plan`, the rehearsal's step `step`."""
        self._step, self._plan = step, plan

    def _stands_in(self, like: Like | None, positions: tuple[int, ...]) -> bool:
        last = self.loops[-1] if self.loops else None
        return (
            like is not None
            and last is not None
            and last.like == like
            and self._since_run + 1 < self.stride
            and max(positions) < self.last_position
        )

    def wrap(self, run: Callable[..., list[torch.Tensor]]) -> Callable[..., list[torch.Tensor]]:
        """The pipeline's `run(batches, moves)`, run or stood in for."""

        def run_or_stand_in(batches: Any, moves: Sequence[Any] = ()) -> list[torch.Tensor]:
            plan = self._plan
            like = decode_like(plan) if plan is not None and not moves else None
            positions = tuple(c.start_pos for c in plan.chunks) if plan is not None else ()
            ledger = self.ledger
            if self._stands_in(like, positions):
                assert like is not None
                self._since_run += 1
                stood = StoodIn(self._step, like, positions, ledger.live_bytes)
                self._pending.append(stood)
                self.stood_in.append(stood)
                with ledger.task("compute"):
                    return [
                        torch.empty(shape, dtype=dtype, device="cuda")
                        for shape, dtype in self.loops[-1].logits
                    ]
            outer_peak, start = ledger.step_peak, ledger.live_bytes
            ledger.step_peak = start
            logits = run(batches, moves)
            rise = ledger.step_peak - start
            ledger.step_peak = max(outer_peak, ledger.step_peak)
            shapes = tuple((tuple(t.shape), t.dtype) for t in logits)
            loop = Loop(self._step, like or (), positions, start, rise, shapes)
            self.loops.append(loop)
            self._since_run = 0
            self._bound(loop)
            return logits

        return run_or_stand_in

    def _bound(self, loop: Loop) -> None:
        """Bound the stood-in steps like `loop` whose every sequence attended to no more past."""
        kept = []
        for stood in self._pending:
            if stood.like == loop.like and all(
                p <= q for p, q in zip(stood.positions, loop.positions, strict=True)
            ):
                stood.bound, stood.bounded_by = stood.start_bytes + loop.rise, loop.step
            else:
                kept.append(stood)
        self._pending = kept

    @property
    def unbounded(self) -> list[str]:
        """Stood-in steps no later loop bounded (none when the run ended as planned)."""
        return [s.step for s in self._pending]

    @property
    def peak_bound(self) -> StoodIn | None:
        """The stood-in step with the highest bound."""
        bounded = [s for s in self.stood_in if s.bound is not None]
        return max(bounded, key=lambda s: s.bound or 0) if bounded else None

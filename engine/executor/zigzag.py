"""`ZigZag`: FlexGen's zig-zag block schedule (Fig. 4, Algorithm 1), written once, for one step.

For each layer j the weights are loaded once and used by every GPU batch k of the block
(j-th layer, k-th GPU batch, as in FlexGen). Around each (j, k)'s compute run FlexGen's
verbs (engine/executor/layer_io.py): load_weight, load_cache, load_activation, then
store_activation and store_cache, and sync where a value is used. One loop, two strategies:
- in order (`ahead=False`, FlexGen's `generation_loop_normal`, the reference): each (j, k)
  loads what it computes on, here and now, then computes and stores;
- looking ahead (`ahead=True`): while (j, k) computes, the load threads fetch layer j+1's
  weights and the next (j, k)'s past KV and activations, and the store threads write
  (j, k)'s new KV and activations (CUDA side streams fenced by events). Only a true
  dependency waits: the activations entering (j+1, k) wait for (j, k)'s activation store
  (their load is issued once that store is); past KV never waits for this step's stores (it
  was written in earlier steps), so with one GPU batch the next layer's past KV loads while
  this layer computes.
A layer that holds its outputs to the block's end (a grouped MoE layer, `GroupedMoe`) stores
each batch's activations once the block's experts have run. Both strategies give
bit-identical tokens; tests hold them to it, and the trace (engine/executor/trace.py) shows
what overlapped.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

import torch

from engine.executor.gpu_batch import GpuBatch, PastKV
from engine.executor.layer_io import LayerIO
from engine.executor.layer_ways import LayerRun
from engine.executor.moe_block import GroupedMoe
from engine.executor.tasks import Done, Task, start, wait_all
from engine.models.base import Model, Weights
from engine.storage.device import Ready

T = TypeVar("T")
Position = tuple[int, int]
"""(j, k): layer j of GPU batch k."""


def _now(fn: Callable[..., T], *args: Any) -> Task[T]:
    """The in-order loop's launch: `fn` runs here, now, and an error raises here."""
    return Done(fn(*args))


class ZigZag:
    """One step's schedule over `io`'s loads and stores, each layer computed by `compute` (the
    pipeline's one face for a layer); `grouped`: the MoE layers that hold their outputs to
    the block's end, if the model has any."""

    def __init__(
        self,
        model: Model,
        io: LayerIO,
        compute: LayerRun,
        grouped: GroupedMoe | None,
        ahead: bool,
    ) -> None:
        self.model, self.io, self.compute, self.grouped, self.ahead = (
            model,
            io,
            compute,
            grouped,
            ahead,
        )
        # Tasks not yet done: a done one is dropped, so that what it loaded (a layer's past
        # KV, its decoded weights) is freed once the loop is through with it, not kept by
        # this set to the step's end (the rehearsal found a whole step's past KV held so:
        # 48 GiB for OPT-6.7B's 96-sequence batches, engine/rehearsal.py).
        self._started: set[Future[Any]] = set()
        self._weights: dict[int, Task[Ready[Weights]]] = {}
        self._pasts: dict[Position, Task[Ready[PastKV]]] = {}
        self._acts: dict[Position, Task[Ready[torch.Tensor | None]]] = {}
        self._act_stored: dict[int, tuple[int, Task[None]]] = {}
        """GPU batch -> (layer, its latest activation store)."""
        self._kv_stores: list[Task[None]] = []

    def run(self, batches: list[GpuBatch]) -> list[torch.Tensor]:
        """The step: (S_k, vocab) logits for each GPU batch's logit rows. If a load or store
        fails, every task already started is waited for before the error goes up: none of
        them may still write into the KV pools when the next step (or a recompute) reuses
        their pages."""
        try:
            return self._layers(batches)
        except BaseException:  # a failed load or store: let the others land before we return
            wait_all(list(self._started))
            raise

    # -- launching: a copy thread when looking ahead and there are bytes to move -----------

    def _launch(
        self, pool: ThreadPoolExecutor, moves: bool, fn: Callable[..., T], *args: Any
    ) -> Task[T]:
        if not self.ahead:
            return _now(fn, *args)
        # one without bytes to move runs inline (a hand-off would cost more than the nothing
        # it does), and has ended once it returns: only a pool's is tracked
        task = start(pool if moves else None, fn, *args)
        if isinstance(task, Future):
            self._started.add(task)
            task.add_done_callback(self._started.discard)
        return task

    def load(self, moves: bool, fn: Callable[..., T], *args: Any) -> Task[T]:
        """A load (`Launch`): on a load thread when it moves bytes and the loop looks ahead."""
        return self._launch(self.io.loads, moves, fn, *args)

    def store(self, moves: bool, fn: Callable[..., T], *args: Any) -> Task[T]:
        """A store (`Launch`): on a store thread when it moves bytes and the loop looks ahead."""
        return self._launch(self.io.stores, moves, fn, *args)

    # -- the loop --------------------------------------------------------------------------

    def _layers(self, batches: list[GpuBatch]) -> list[torch.Tensor]:
        io, num_layers, num_batches = self.io, self.model.num_layers, len(batches)
        logits: list[torch.Tensor] = []
        if self.ahead:
            if io.moves:  # first in the load queue: every KV load and store waits for its layer's
                io.moved = {j: self.load(True, io.move_pages, j) for j in range(1, num_layers - 1)}
            self._load_weight(0)
            self._load_cache((0, 0), batches)
            self._load_activation((0, 0), batches)
        for j in range(num_layers):
            self._load_weight(j + 1 if self.ahead else j)
            w = self._sync(self._weights.pop(j))
            if not self.ahead:
                io.move_pages(j)
            holds = self.grouped is not None and self.grouped.groups(j)
            waiting: Position | None = None  # an activation load waiting for its store
            for k, batch in enumerate(batches):
                nxt = self._loads_at(j, k, num_batches)
                if nxt[0] < num_layers:
                    self._load_cache(nxt, batches)
                    waiting = self._load_activation(nxt, batches) or waiting
                past = self._sync(self._pasts.pop((j, k)))
                h = self._sync(self._acts.pop((j, k)))
                out, new_kv = self.compute(j, w, h, past, batch)
                if self.model.layer_kind(j) == "head":
                    logits.append(out)
                    continue
                if not holds:
                    self._store_activation(j, k, batch, out, admit=self.ahead)
                if new_kv is not None:
                    self._kv_stores.append(io.store_cache(self.store, j, batch, new_kv))
                if not holds and waiting is not None:
                    self._issue_activation(waiting, batches)
                    waiting = None
            if holds:
                assert self.grouped is not None
                outs = self.grouped.block_outputs(j, w, self.load)
                for k, (batch, out) in enumerate(zip(batches, outs, strict=True)):
                    self._store_activation(j, k, batch, out, admit=False)
                if waiting is not None:
                    self._issue_activation(waiting, batches)
            # before layer j + 2's load is issued (next iteration): its slot is this layer's
            io.weights.release(j)
        for future in (*self._kv_stores, *(stored for _, stored in self._act_stored.values())):
            future.result()
        return logits

    def _loads_at(self, j: int, k: int, num_batches: int) -> Position:
        """Whose inputs are loaded while (j, k) is about to compute: its own in order; looking
        ahead, the next (j, k)'s, the next layer's first batch after the last batch."""
        if not self.ahead:
            return j, k
        return (j, k + 1) if k + 1 < num_batches else (j + 1, 0)

    def _sync(self, future: Task[Ready[T]]) -> T:
        """The value a launched load made, once the compute stream may read it."""
        return self.io.device.wait(future.result())

    # -- the verbs, launched -----------------------------------------------------------------

    def _load_weight(self, j: int) -> None:
        if j < self.model.num_layers:
            self._weights[j] = self.load(self.io.weights_move(j), self.io.load_weight, j)

    def _load_cache(self, at: Position, batches: list[GpuBatch]) -> None:
        j, batch = at[0], batches[at[1]]
        self._pasts[at] = self.load(self.io.past_moves(j, batch), self.io.load_cache, j, batch)

    def _load_activation(self, at: Position, batches: list[GpuBatch]) -> Position | None:
        """load_activation of (j, k) = `at`, issued once the store it reads, of (j - 1, k), has
        been: `at` is returned when that has not happened yet (`_issue_activation` later)."""
        j, k = at
        stored = self._act_stored.get(k)
        if j > 0 and (stored is None or stored[0] < j - 1):
            return at
        self._issue_activation(at, batches)
        return None

    def _issue_activation(self, at: Position, batches: list[GpuBatch]) -> None:
        (j, k), batch = at, batches[at[1]]
        stored = self._act_stored.get(k)
        after = None if stored is None else stored[1]
        moves = self.io.acts_move(j, batch)
        self._acts[at] = self.load(moves, self.io.load_activation, j, batch, after)

    def _store_activation(
        self, j: int, k: int, batch: GpuBatch, out: torch.Tensor, admit: bool
    ) -> None:
        """store_activation of (j, k), after this batch's previous one. `admit`: the loop
        runs LOAD_WINDOW computes ahead of the loads they read (`LayerIO.load_window`)."""
        done = self.io.device.record()
        if admit and self.io.loads_for(j, batch):
            self.io.load_window.admit(done)
        stored = self._act_stored.get(k)
        after = None if stored is None else stored[1]
        moves = bool(batch.act_rows)
        future = self.store(moves, self.io.store_activation, j, batch, out, done, after)
        self._act_stored[k] = (j, future)

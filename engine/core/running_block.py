"""`RunningBlock`: the sequences running now and the block's free slots, torch-free.

A block holds at most `block_size` sequences (Policy.block_size); a sequence's slot fixes its
GPU batch (slot // gpu_batch_size). Free slots are handed out lowest first, so a refilled
block keeps its GPU batches dense.
"""

from __future__ import annotations

import heapq

from engine.core.sequence import Sequence, SequenceStatus


class RunningBlock:
    """The running sequences in admission order (the last one is the newest: the first to
    preempt) and the slots nobody holds."""

    def __init__(self, block_size: int) -> None:
        self.seqs: list[Sequence] = []
        """Admission order: the last one is the newest (the first to preempt)."""
        self._free_slots = list(range(block_size))  # a heap: the lowest slot first

    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    def enter(self, seq: Sequence) -> None:
        """Give seq the lowest free slot and mark it running (there must be one free)."""
        seq.slot = heapq.heappop(self._free_slots)
        seq.status = SequenceStatus.RUNNING
        self.seqs.append(seq)

    def leave(self, seq: Sequence) -> None:
        """Take seq out of the block if it runs, freeing its slot (its slot field is the
        caller's to reset)."""
        if seq in self.seqs:
            self.seqs.remove(seq)
            heapq.heappush(self._free_slots, seq.slot)

"""`ChoiceForks`: the n choices of one request compute their prompt once, torch-free.

`ParentRequest` sends the n choices of a request as n requests of one group
(`Request.group`). The first choice to sample leads: its prompt's pages are forked to the
other choices that have not started (`PageManager.fork`; a partial last page is copied when
first written), and each samples its first token from the leader's logits row, then waits
in its queue holding its KV until a slot is free. Only with prefix caching (the pages are
shared through its reference counts) and not for a hybrid model (its state is not forked).
"""

from __future__ import annotations

from collections.abc import Iterable

from engine.core.kv_pages import PageManager
from engine.core.protocol import SeqChunk
from engine.core.sequence import Sequence, SequenceStatus


class ChoiceForks:
    """The unfinished choices of each request with n > 1, by group, and the forks they take."""

    def __init__(self, page_manager: PageManager, enabled: bool) -> None:
        self.page_manager = page_manager
        self.enabled = enabled
        """The n choices of a request share one prefill."""
        self._groups: dict[str, list[Sequence]] = {}
        """While enabled: the unfinished choices of each request with n > 1, by group."""

    def join(self, seq: Sequence) -> None:
        """Count a newly added choice in its request's group (when forking is on)."""
        if self.enabled and seq.request.group is not None:
            self._groups.setdefault(seq.request.group, []).append(seq)

    def leave(self, seq: Sequence) -> None:
        """Take a finished or aborted choice out of its group."""
        group = self._groups.get(seq.request.group or "")
        if group is not None:
            group.remove(seq)
            if not group:
                del self._groups[seq.request.group or ""]

    def leads(self, seq: Sequence) -> bool:
        """seq computes the prompt of a request whose other choices fork it at seq's first
        sample (`forks_of`); not a sequence homed on disk (its partial pages are staged in
        host memory, not copied)."""
        return seq.request.group in self._groups and not seq.num_generated and seq.kv_tier != "disk"

    def leading_groups(self, running: Iterable[Sequence]) -> set[str | None]:
        """The groups whose prompt one of `running` is computing for its choices."""
        return {s.request.group for s in running if self.leads(s)}

    def can_fork(self, seq: Sequence) -> bool:
        """seq waits and has computed nothing (and wants no prompt logprobs: those need its
        own pass over the prompt)."""
        return (
            seq.status is SequenceStatus.WAITING
            and seq.seq_id not in self.page_manager
            and not seq.num_pending
            and not seq.num_generated
            and not seq.wants_prompt_logprobs
        )

    def forks_of(self, leader: Sequence, chunk: SeqChunk) -> list[SeqChunk]:
        """With `chunk` the leader samples its first token: the other choices of its request
        that have not started fork its pages, each a chunk of no tokens that samples from the
        same logits row."""
        if not (chunk.do_sample and leader.num_pending == 1 and self.leads(leader)):
            return []
        group = self._groups[leader.request.group or ""]
        return [self._fork(leader, seq, chunk) for seq in group if self.can_fork(seq)]

    def _fork(self, leader: Sequence, seq: Sequence, chunk: SeqChunk) -> SeqChunk:
        """seq takes leader's prompt KV; it stays queued, holding it, until a slot is free."""
        pages = self.page_manager.fork(leader.seq_id, seq.seq_id)
        seq.kv_tier, seq.act_tier = leader.kv_tier, leader.act_tier
        seq.num_computed_tokens = leader.num_computed_tokens
        if seq.num_cached_tokens is None:  # the request's prefix hit, as its leader's
            seq.num_cached_tokens = leader.num_cached_tokens
        history = list(seq.token_ids) if seq.sampling.needs_history else []
        seq.is_sent, seq.num_pending = True, 1
        return SeqChunk(
            seq_id=seq.seq_id,
            token_ids=[],
            start_pos=seq.num_computed_tokens,
            gpu_batch=chunk.gpu_batch,
            new_pages=pages,
            kv_tier=seq.kv_tier,
            act_tier=seq.act_tier,
            do_sample=True,
            sampling=seq.sampling,
            media=seq.request.media,  # its M-RoPE positions past the prompt; nothing to encode
            cached_token_ids=history,
            forked_from=leader.seq_id,
        )

"""`LogitsProcessor`: the one stage between the model's logits and the sampler.

Everything a request asks of its next token beyond temperature and truncation is applied
here, in place, to the (rows, vocab) float32 logits of the rows being sampled, greedy or
not, in vLLM's order: the allowed tokens, bad words, min_tokens (EOS and stop ids banned
until then), the logit bias, the presence, frequency and repetition penalties, and the
structured-output mask (engine/executor/grammar.py). Rows that ask for none of it are not
touched (and a step where no row does is not copied). A row whose settings fail here (a
token id outside the vocabulary, a grammar error, nothing left to sample) fails alone:
its error comes back by row, and the rest of the step goes on.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.core.sampling_params import SamplingParams
from engine.executor.grammar import GrammarBank, GrammarError
from engine.kernels import TokenMask

_MINUS_INF = float("-inf")

Masks = tuple[dict[int, torch.Tensor], dict[int, str]]
"""(sequence id -> its (1, ceil(vocab / 32)) int32 grammar bits, sequence id -> failure)."""


@dataclass(slots=True)
class RowTokens:
    """What the logits stage reads of one sampled row's sequence."""

    seq_id: int
    params: SamplingParams
    output_ids: Sequence[int]
    """The tokens it has generated so far."""
    prompt_ids: Sequence[int]
    """Its prompt (the repetition penalty counts it too)."""


class LogitsProcessor:
    """Applies every row's logit settings in place; `eos_ids` are what min_tokens bans."""

    def __init__(
        self,
        vocab_size: int,
        eos_ids: tuple[int, ...],
        grammars: GrammarBank | None = None,
        token_mask: TokenMask | None = None,
    ) -> None:
        self.vocab_size = vocab_size
        self.eos_ids = eos_ids
        self.grammars = grammars
        self.token_mask = token_mask
        """The native CPU op that applies a grammar's bits (engine/kernels), or None."""

    def apply(
        self, logits: torch.Tensor, rows: list[RowTokens], masks: Masks | None = None
    ) -> dict[int, str]:
        """logits: (len(rows), vocab) float32, changed in place; `masks`: the structured
        rows' grammar bits, computed beforehand (`masks`). Returns errors by row."""
        errors: dict[int, str] = {}
        constrained: list[int] = []
        for r, row in enumerate(rows):
            p = row.params
            if not p.processes_logits:
                continue
            try:
                self._apply_row(logits[r], row)
            except (IndexError, RuntimeError, ValueError) as e:  # a bad id names itself here
                errors[r] = f"sampling settings failed: {e}"
            if p.structured is not None and r not in errors:
                constrained.append(r)
        if constrained:
            bits, failed = masks if masks is not None else self.masks(rows)
            for r in constrained:
                seq_id = rows[r].seq_id
                if seq_id in failed:
                    errors[r] = failed[seq_id]
                elif seq_id in bits:
                    apply_bits(logits[r : r + 1], bits[seq_id], self.token_mask)
        live = [r for r, row in enumerate(rows) if row.params.processes_logits and r not in errors]
        if live:  # one pass over the rows, not a call per row
            best = logits.amax(dim=-1).tolist()
            for r in live:
                if best[r] == _MINUS_INF:
                    errors[r] = "no token is allowed (the constraints exclude every token)"
        return errors

    def _apply_row(self, x: torch.Tensor, row: RowTokens) -> None:
        p, out = row.params, row.output_ids
        dev = x.device
        if p.allowed_token_ids is not None:
            keep = torch.tensor(p.allowed_token_ids, device=dev)
            kept = x[keep]
            x.fill_(_MINUS_INF)
            x[keep] = kept
        banned = [w[-1] for w in p.bad_words_token_ids if _ends_with(out, w[:-1])]
        if len(out) < p.min_tokens:
            banned += [*self.eos_ids, *p.stop_token_ids]
        if banned:
            x[torch.tensor(banned, device=dev)] = _MINUS_INF
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias), device=dev)
            x.index_add_(0, ids, torch.tensor(list(p.logit_bias.values()), device=dev))
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted({*row.prompt_ids, *out}), dtype=torch.long, device=dev)
            values = x[seen]
            penalty = p.repetition_penalty
            x[seen] = torch.where(values > 0, values / penalty, values * penalty)
        if (p.frequency_penalty or p.presence_penalty) and out:
            ids, counts = torch.tensor(list(out), device=dev).unique(return_counts=True)
            x.index_add_(0, ids, -(p.frequency_penalty * counts + p.presence_penalty))

    def masks(self, rows: list[RowTokens]) -> Masks:
        """The grammar bits of the structured rows, by sequence id, and the failures."""
        seq_ids = [row.seq_id for row in rows if row.params.structured is not None]
        if not seq_ids:
            return {}, {}
        if self.grammars is None:
            return {}, {s: "structured outputs need the model's tokenizer.json" for s in seq_ids}
        bits, failed = self.grammars.masks(seq_ids)
        return {s: bits[i : i + 1] for i, s in enumerate(seq_ids) if s not in failed}, failed

    def advance(self, rows: list[RowTokens], token_ids: list[int]) -> dict[int, str]:
        """Advance each structured row's matcher by its sampled token; errors by row."""
        errors: dict[int, str] = {}
        if self.grammars is None:
            return errors
        for r, (row, token_id) in enumerate(zip(rows, token_ids, strict=True)):
            if row.params.structured is not None and row.seq_id in self.grammars:
                try:
                    error = self.grammars.advance(row.seq_id, token_id)
                except GrammarError as e:
                    error = str(e)
                if error:
                    errors[r] = error
        return errors


def apply_bits(logits: torch.Tensor, bits: torch.Tensor, native: TokenMask | None) -> None:
    """Forbidden tokens (clear bits: token 32 w + b is bit b of word w) get -inf, in place.
    logits: (rows, vocab) float32; bits: (rows, ceil(vocab / 32)) int32 on the CPU."""
    if native is not None and logits.device.type == "cpu":
        native(logits, bits)
        return
    vocab = logits.shape[1]
    as_bytes = bits.to(logits.device).contiguous().view(torch.uint8)  # little-endian words
    shifts = torch.arange(8, device=logits.device, dtype=torch.uint8)
    allowed = ((as_bytes[:, :, None] >> shifts) & 1).flatten(1)[:, :vocab].bool()
    logits.masked_fill_(~allowed, _MINUS_INF)


def _ends_with(tokens: Sequence[int], tail: Sequence[int]) -> bool:
    n = len(tail)
    return n == 0 or (len(tokens) >= n and list(tokens[len(tokens) - n :]) == list(tail))

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

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from engine.core.sampling_params import SamplingParams
from engine.executor.grammar import GrammarBank, GrammarError
from engine.kernels import TokenMask

_MINUS_INF = float("-inf")
NOTHING_ALLOWED = "no token is allowed (the constraints exclude every token)"

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
        self,
        logits: torch.Tensor,
        rows: list[RowTokens],
        masks: Masks | None = None,
        check_empty: bool = True,
    ) -> dict[int, str]:
        """logits: (len(rows), vocab) float32, changed in place; `masks`: the structured
        rows' grammar bits, computed beforehand (`masks`). Returns errors by row.
        check_empty: a processed row left with no allowed token fails here (one read of the
        device); False leaves that to the caller (the sampler reads it with the tokens).

        Every row's settings are gathered on the host into flat (row, token) lists, moved to
        the device in one copy of integers and one of values, and applied to all rows at
        once, stage by stage in vLLM's order: no operation per row."""
        errors: dict[int, str] = {}
        edits = _Edits()
        for r, row in enumerate(rows):
            if row.params.processes_logits:
                try:
                    self._gather_row(edits, r, row)
                except ValueError as e:  # a bad id names itself here
                    errors[r] = f"sampling settings failed: {e}"
        edits.drop_rows(set(errors))
        edits.apply(logits)
        constrained = [
            r for r, row in enumerate(rows) if row.params.structured is not None and r not in errors
        ]
        if constrained:
            bits, failed = masks if masks is not None else self.masks(rows)
            masked: list[int] = []
            for r in constrained:
                seq_id = rows[r].seq_id
                if seq_id in failed:
                    errors[r] = failed[seq_id]
                elif seq_id in bits:
                    masked.append(r)
            if masked:
                apply_row_bits(
                    logits, masked, [bits[rows[r].seq_id] for r in masked], self.token_mask
                )
        live = [r for r, row in enumerate(rows) if row.params.processes_logits and r not in errors]
        if live and check_empty:  # one pass over the rows, not a call per row
            best = logits.amax(dim=-1).tolist()
            for r in live:
                if best[r] == _MINUS_INF:
                    errors[r] = NOTHING_ALLOWED
        return errors

    def _gather_row(self, edits: _Edits, r: int, row: RowTokens) -> None:
        """Row r's edits, on the host; a token id outside the vocabulary raises ValueError."""
        p, out = row.params, row.output_ids
        if p.allowed_token_ids is not None:
            edits.allowed.add(r, self._checked(p.allowed_token_ids))
        banned = [w[-1] for w in p.bad_words_token_ids if _ends_with(out, w[:-1])]
        if len(out) < p.min_tokens:
            banned += [*self.eos_ids, *p.stop_token_ids]
        edits.banned.add(r, self._checked(banned))
        if p.logit_bias:
            edits.bias.add(r, self._checked(list(p.logit_bias)), list(p.logit_bias.values()))
        if p.repetition_penalty != 1.0:
            seen = self._checked(sorted({*row.prompt_ids, *out}))
            edits.repeated.add(r, seen, [p.repetition_penalty] * len(seen))
        if (p.frequency_penalty or p.presence_penalty) and out:
            counts = Counter(self._checked(list(out)))
            penalties = [-(p.frequency_penalty * n + p.presence_penalty) for n in counts.values()]
            edits.penalized.add(r, list(counts), penalties)

    def _checked(self, ids: Sequence[int]) -> list[int]:
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary of {self.vocab_size}")
        return list(ids)

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


@dataclass(slots=True)
class _TokenEdits:
    """One stage's edits of the step: (row, token id) pairs, with a value each or none."""

    rows: list[int] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    values: list[float] = field(default_factory=list)

    def add(self, row: int, ids: list[int], values: list[float] | None = None) -> None:
        self.rows += [row] * len(ids)
        self.ids += ids
        self.values += values or []

    def drop_rows(self, rows: set[int]) -> None:
        keep = [i for i, r in enumerate(self.rows) if r not in rows]
        self.rows = [self.rows[i] for i in keep]
        self.ids = [self.ids[i] for i in keep]
        if self.values:
            self.values = [self.values[i] for i in keep]


@dataclass(slots=True)
class _Edits:
    """Every processed row's edits of one step, by stage, in the order they apply."""

    allowed: _TokenEdits = field(default_factory=_TokenEdits)
    """Only these tokens of the row stay."""
    banned: _TokenEdits = field(default_factory=_TokenEdits)
    """Bad words' last tokens, EOS and stop ids before min_tokens: -inf."""
    bias: _TokenEdits = field(default_factory=_TokenEdits)
    """Added to the logit."""
    repeated: _TokenEdits = field(default_factory=_TokenEdits)
    """Tokens of the prompt and output, with the repetition penalty that divides them."""
    penalized: _TokenEdits = field(default_factory=_TokenEdits)
    """Output tokens, with -(frequency * count + presence) added."""

    def stages(self) -> list[_TokenEdits]:
        return [self.allowed, self.banned, self.bias, self.repeated, self.penalized]

    def drop_rows(self, rows: set[int]) -> None:
        if rows:
            for stage in self.stages():
                stage.drop_rows(rows)

    def apply(self, logits: torch.Tensor) -> None:
        """All stages on logits (rows, vocab) in place: one copy of the step's (row, id)
        pairs and one of its values to the device, then a few batched ops per stage."""
        stages = self.stages()
        if not any(stage.rows for stage in stages):
            return
        device = logits.device
        allowed_rows = sorted(set(self.allowed.rows))
        ints = torch.tensor(
            [i for stage in stages for i in (*stage.rows, *stage.ids)] + allowed_rows,
            dtype=torch.long,
            device=device,
        )
        values = [v for stage in stages for v in stage.values]
        floats = torch.tensor(values, dtype=torch.float32, device=device) if values else None
        pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        at = 0
        for stage in stages:
            n = len(stage.rows)
            pairs.append((ints[at : at + n], ints[at + n : at + 2 * n]))
            at += 2 * n
        allowed, banned, bias, repeated, penalized = pairs
        if allowed_rows:
            kept = logits[allowed]
            logits.index_fill_(0, ints[at:], _MINUS_INF)
            logits.index_put_(allowed, kept)
        if self.banned.rows:
            logits.index_put_(banned, logits.new_full((len(self.banned.rows),), _MINUS_INF))
        at = 0
        for stage, where in (
            (self.bias, bias),
            (self.repeated, repeated),
            (self.penalized, penalized),
        ):
            n = len(stage.values)
            if not n:
                continue
            assert floats is not None
            value = floats[at : at + n]
            at += n
            if stage is self.repeated:  # divides a positive logit, multiplies a negative one
                old = logits[where]
                logits.index_put_(where, torch.where(old > 0, old / value, old * value))
            else:
                logits.index_put_(where, value, accumulate=True)


def apply_row_bits(
    logits: torch.Tensor, rows: list[int], bits: list[torch.Tensor], native: TokenMask | None
) -> None:
    """Grammar bits (1, ceil(vocab / 32)) int32 on the CPU, one per row of `rows`, applied to
    those rows of logits (rows, vocab) in place (`apply_bits`): on another device than the
    CPU, in one copy and one pass over the rows together."""
    if native is not None and logits.device.type == "cpu":
        for r, row_bits in zip(rows, bits, strict=True):
            native(logits[r : r + 1], row_bits)
        return
    index = torch.tensor(rows, dtype=torch.long, device=logits.device)
    chosen = logits.index_select(0, index)
    apply_bits(chosen, torch.cat(bits), None)
    logits.index_copy_(0, index, chosen)


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

"""`Sampler`: next tokens from logits, every row of a step in one batch on the compute
device: greedy, temperature, min-p, top-k, top-p, seeds, logprobs."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.core.protocol import TokenLogprobs
from engine.core.sampling_params import SamplingParams
from engine.executor.draws import as_int64, draw_rows, uniforms
from engine.executor.logits import NOTHING_ALLOWED
from engine.executor.step_inputs import Staged, StepInputs

MIN_TEMPERATURE = 1e-5
"""Below this, logits / temperature overflow float32 (inf, then NaN probabilities): such a
row is sampled greedily, which is what the temperature tends to."""
_UNSEEDED = 0x5EED_0F_F
"""Mixed into the key of rows without a seed, so that they never share a seeded row's draws."""


@dataclass(frozen=True, slots=True)
class DrawRows:
    """The rows of a step that draw at random, with what their truncation needs (host side)."""

    rows: list[int]
    """Their rows in the step's logits."""
    max_top_k: int
    """The largest top-k among them that truncates (0: none does)."""
    any_top_p: bool
    any_min_p: bool


class Sampler:
    """Samples one token per row, all rows at once: no call per row, and one read of the
    device per step (the tokens, with whether each row had any token left).

    A row's uniform variate is a hash of (key, counter) (engine/executor/draws.py): a request
    with a seed is keyed by (seed, tokens generated so far), so its output does not depend
    on what shares the batch; a row without one by (the sampler's seed, a running count of
    its draws)."""

    def __init__(self, seed: int = 0, inputs: StepInputs | None = None) -> None:
        self._key = as_int64(seed ^ _UNSEEDED)
        self._num_draws = 0
        self._inputs = inputs
        """Where `prepare` stages the step's draws (the step's `StepInputs`, copied with the
        batches' inputs); None: `sample` stages and copies them itself."""
        self._prepared: _StagedDraws | None = None

    def prepare(self, params: list[SamplingParams], num_sampled: list[int], vocab: int) -> None:
        """Stage the next `sample`'s draws into the step's inputs before they are copied:
        every row that draws (a row the logits stage fails draws too; its token is dropped)."""
        assert self._inputs is not None, "prepare() needs the step's inputs"
        draws = draw_rows_of(params, {}, vocab)
        self._prepared = self._stage(self._inputs, draws, params, num_sampled)

    def discard(self) -> None:
        """The prepared step will not be sampled."""
        self._prepared = None

    def sample(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        num_sampled: list[int],
        process: Callable[[torch.Tensor], dict[int, str]] | None = None,
    ) -> tuple[list[int], list[TokenLogprobs | None], dict[int, str]]:
        """logits: (S, vocab) float32, changed in place by `process` (the logits stage,
        engine/executor/logits.py, which returns errors by row). Returns S token ids, S
        logprob records (or None) and the errors by row; a row left with no token it may
        take fails with `NOTHING_ALLOWED`. Logprobs are those of the model's own
        distribution, before the logits stage (vLLM's default, `raw_logprobs`); the token
        is chosen after it, greedy rows by the same stage as sampled ones."""
        staged, self._prepared = self._prepared, None
        if not params:
            return [], [], {}
        wanted = [row for row, p in enumerate(params) if p.logprobs is not None]
        log_probs = None
        if wanted:
            rows = torch.tensor(wanted, device=logits.device)
            log_probs = torch.log_softmax(logits.index_select(0, rows).float(), dim=-1)
        errors = process(logits) if process is not None else {}
        # greedy rows are done here; `max` finds the same first maximum as `argmax`, which
        # on a CPU runs 2.5x slower over a vocabulary-wide row (one lane per row)
        best, tokens = logits.max(dim=-1)
        if staged is None:  # not prepared: stage and copy the draws now
            inputs = self._own_inputs(logits.device)
            inputs.begin_step()
            draws = draw_rows_of(params, errors, logits.shape[-1])
            staged = self._stage(inputs, draws, params, num_sampled)
            inputs.flush()
        if staged.draws.rows:
            tokens = tokens.clone()
            self._draw(logits, tokens, staged)
        # the step's one read of the device: (2, S) tokens and rows with nothing allowed
        token_ids, empty = torch.stack([tokens, (best == float("-inf")).long()]).tolist()
        for row, is_empty in enumerate(empty):
            if is_empty and row not in errors:
                errors[row] = NOTHING_ALLOWED
        logprobs: list[TokenLogprobs | None] = [None] * len(params)
        if log_probs is not None:
            ranked = top_logprobs(
                log_probs, [token_ids[r] for r in wanted], [params[r].logprobs for r in wanted]
            )
            for row, entry in zip(wanted, ranked, strict=True):
                logprobs[row] = entry
        return token_ids, logprobs, errors

    def _own_inputs(self, device: torch.device) -> StepInputs:
        if self._inputs is None or self._inputs.device != device:
            self._inputs = StepInputs(device, pinned=device.type == "cuda")
        return self._inputs

    def _stage(
        self,
        inputs: StepInputs,
        draws: DrawRows,
        params: list[SamplingParams],
        num_sampled: list[int],
    ) -> _StagedDraws:
        """Stage the drawing rows' indices, keys and counters (3n,) int64 and settings
        (4n,) float32: a seeded row is keyed by (seed, tokens sampled so far), the others
        by (this sampler's key, its running count of draws)."""
        keys, counters = [], []
        for row in draws.rows:
            p = params[row]
            if p.seed is not None:
                keys.append(as_int64(p.seed))
                counters.append(num_sampled[row])
            else:
                keys.append(self._key)
                counters.append(self._num_draws)
                self._num_draws += 1
        chosen = [params[row] for row in draws.rows]
        settings = [
            *(p.temperature for p in chosen),
            *(p.min_p for p in chosen),
            *(float(p.top_k) for p in chosen),
            *(p.top_p for p in chosen),
        ]
        return _StagedDraws(
            draws,
            inputs.stage([*draws.rows, *keys, *counters], torch.long),
            inputs.stage(settings, torch.float32),
            inputs,
        )

    def _draw(self, logits: torch.Tensor, tokens: torch.Tensor, staged: _StagedDraws) -> None:
        """Draw the rows `staged` names and write their tokens into `tokens` (S,)."""
        n = len(staged.draws.rows)
        rows, keys, counters = staged.inputs.tensor(staged.ints).view(3, n)
        temperature, min_p, top_k, top_p = staged.inputs.tensor(staged.settings).view(4, n)
        top_k = torch.where(top_k < logits.shape[-1], top_k, 0.0)  # past the vocabulary: off
        scores = logits.index_select(0, rows).float() / temperature[:, None]  # (n, vocab)
        scores = truncate(scores, staged.draws, min_p, top_k, top_p)
        probs = torch.softmax(scores, dim=-1)
        tokens.index_copy_(0, rows, draw_rows(probs, uniforms(keys, counters)))


@dataclass(frozen=True, slots=True)
class _StagedDraws:
    """A step's draws, staged in its inputs (`Sampler.prepare`)."""

    draws: DrawRows
    ints: Staged
    """(3n,) int64: the rows, their keys, their counters."""
    settings: Staged
    """(4n,) float32: temperature, min_p, top_k, top_p."""
    inputs: StepInputs


def draw_rows_of(params: list[SamplingParams], errors: dict[int, str], vocab: int) -> DrawRows:
    """The rows that draw (not greedy, a usable temperature, no error) and what they need."""
    rows = [
        r
        for r, p in enumerate(params)
        if not p.is_greedy and p.temperature >= MIN_TEMPERATURE and r not in errors
    ]
    chosen = [params[r] for r in rows]
    return DrawRows(
        rows,
        max((p.top_k for p in chosen if 0 < p.top_k < vocab), default=0),
        any(p.top_p < 1.0 for p in chosen),
        any(p.min_p > 0.0 for p in chosen),
    )


def truncate(
    scores: torch.Tensor,
    draws: DrawRows,
    min_p: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
) -> torch.Tensor:
    """scores (n, vocab) with the tokens each row's min-p, top-k and top-p drop set to -inf,
    in that order (each reads what the one before left). min_p, top_k, top_p: (n,) float32;
    top_k 0 and top_p 1 leave a row as it is. A step pays only for the truncations one of
    its rows asks for."""
    minus_inf = float("-inf")
    if draws.any_min_p:  # below min_p of the likeliest token's probability: out
        probs = torch.softmax(scores, dim=-1)
        cut = min_p[:, None] * probs.amax(dim=-1, keepdim=True)
        scores = scores.masked_fill(probs < cut, minus_inf)
    if draws.max_top_k:  # below the k-th largest score: out (ties with it stay)
        largest = torch.topk(scores, min(draws.max_top_k, scores.shape[-1]), dim=-1).values
        k = top_k.long()
        kth = largest.gather(1, (k - 1).clamp(min=0)[:, None])
        scores = scores.masked_fill((scores < kth) & (k > 0)[:, None], minus_inf)
    if draws.any_top_p:
        sorted_scores, order = torch.sort(scores, dim=-1, descending=True)
        sorted_probs = torch.softmax(sorted_scores, dim=-1)
        # keep the smallest prefix whose mass reaches top_p (always at least one token,
        # also when a tiny top_p rounds to 0 in float32)
        drop = sorted_probs.cumsum(dim=-1) - sorted_probs >= top_p[:, None]
        drop &= (top_p < 1.0)[:, None]
        drop[:, 0] = False
        scores = scores.scatter(1, order, sorted_scores.masked_fill(drop, minus_inf))
    return scores


def top_logprobs(
    log_probs: torch.Tensor, token_ids: list[int], ks: list[int | None]
) -> list[TokenLogprobs]:
    """log_probs: (n, vocab), one row per position, on the compute device. Row i's logprob
    of token_ids[i] and its top ks[i], taken on the device (one gather, one top-k for the
    largest k) and moved to the host once: never a vocab-wide row."""
    rows = log_probs.shape[0]
    if rows == 0:
        return []
    ids = torch.tensor(token_ids, device=log_probs.device)[:, None]
    chosen = log_probs.gather(1, ids)[:, 0].tolist()
    k = max((k or 0) for k in ks)
    top_values: list[list[float]] = [[]] * rows
    top_ids: list[list[int]] = [[]] * rows
    if k:
        values, indices = torch.topk(log_probs, k, dim=-1)
        top_values, top_ids = values.tolist(), indices.tolist()
    return [
        TokenLogprobs(
            token_ids[i],
            chosen[i],
            list(zip(top_ids[i][: ks[i] or 0], top_values[i][: ks[i] or 0])),
        )
        for i in range(rows)
    ]

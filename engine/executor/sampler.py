"""`Sampler`: next tokens from logits: greedy, temperature, min-p, top-k, top-p, seeds,
logprobs."""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.core.protocol import TokenLogprobs
from engine.core.sampling_params import SamplingParams

_SEED_STRIDE = 1_000_003  # decorrelates (seed, step) pairs for per-request generators
MIN_TEMPERATURE = 1e-5
"""Below this, logits / temperature overflow float32 (inf, then NaN probabilities): such a
row is sampled greedily, which is what the temperature tends to."""


class Sampler:
    """Samples one token per row. A request with a seed draws from its own generator keyed by
    (seed, tokens generated so far), so its output does not depend on what shares the batch."""

    def __init__(self, seed: int = 0) -> None:
        self._rng = torch.Generator().manual_seed(seed)

    def sample(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        num_sampled: list[int],
        process: Callable[[torch.Tensor], dict[int, str]] | None = None,
    ) -> tuple[list[int], list[TokenLogprobs | None], dict[int, str]]:
        """logits: (S, vocab) float32, changed in place by `process` (the logits stage,
        engine/executor/logits.py, which returns errors by row). Returns S token ids, S
        logprob records (or None) and the errors by row. Logprobs are those of the model's
        own distribution, before the logits stage (vLLM's default, `raw_logprobs`); the
        token is chosen after it, greedy rows by the same stage as sampled ones."""
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
        token_ids = logits.max(dim=-1).indices.tolist()
        for row, p in enumerate(params):
            if not p.is_greedy and p.temperature >= MIN_TEMPERATURE and row not in errors:
                token_ids[row] = self._draw(logits[row], p, num_sampled[row])
        logprobs: list[TokenLogprobs | None] = [None] * len(params)
        if log_probs is not None:
            ranked = top_logprobs(
                log_probs, [token_ids[r] for r in wanted], [params[r].logprobs for r in wanted]
            )
            for row, entry in zip(wanted, ranked, strict=True):
                logprobs[row] = entry
        return token_ids, logprobs, errors

    def _draw(self, logits: torch.Tensor, p: SamplingParams, num_sampled: int) -> int:
        scores = logits.float() / p.temperature
        if p.min_p > 0.0:  # below min_p of the likeliest token's probability: out
            probs = torch.softmax(scores, dim=-1)
            scores = scores.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
        if p.top_k > 0 and p.top_k < scores.shape[-1]:
            kth = torch.topk(scores, p.top_k).values[-1]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        if p.top_p < 1.0:
            sorted_scores, order = torch.sort(scores, descending=True)
            sorted_probs = torch.softmax(sorted_scores, dim=-1)
            # keep the smallest prefix whose mass reaches top_p (always at least one token,
            # also when a tiny top_p rounds to 0 in float32)
            drop = sorted_probs.cumsum(dim=-1) - sorted_probs >= p.top_p
            drop[0] = False
            scores = scores.scatter(0, order, sorted_scores.masked_fill(drop, float("-inf")))
        probs = torch.softmax(scores, dim=-1)
        rng = self._rng
        if p.seed is not None:
            rng = torch.Generator().manual_seed((p.seed * _SEED_STRIDE + num_sampled) % 2**63)
        return draw(probs, float(torch.rand((), generator=rng)))


def draw(probs: torch.Tensor, u: float) -> int:
    """The token whose probability interval holds `u` (uniform in [0, 1)): the inverse of
    the cumulative distribution, one cumulative sum and one binary search. torch.multinomial
    draws an exponential variate for every token of the vocabulary instead, 1.5 ms a row on
    a 49k vocabulary on a CPU core. A token of probability 0 is never drawn: the sums do not
    grow there and the search takes the first sum above `u` of the total."""
    cdf = probs.cumsum(dim=-1)
    target = cdf[-1:] * u
    index = int(torch.searchsorted(cdf, target, right=True).item())
    index = min(index, probs.shape[-1] - 1)
    while index > 0 and float(probs[index]) == 0.0:  # u * total rounded up to the total
        index -= 1
    return index


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

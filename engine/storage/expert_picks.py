"""`ExpertPicks`: how often the router picked each expert of each MoE layer, counted as the
engine runs and kept with the model's cache, so that the next load homes the most-picked
experts on the fastest tier first.

Routers are far from uniform on real text (a few experts of a layer take a large share of
its tokens), so when only part of the experts fit the GPU, the ones picked most should be
there: what the GPU holds then serves more than its byte share of the routed rows. The
counts start at zero (no history: experts are placed in index order) and add up over runs:
the file is rewritten when the engine closes. A file that does not match the model's
shape (another model under the same key, a damaged write) is ignored with a warning.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import torch

from engine.core.cache import cache_root, publish_file

logger = logging.getLogger("nanoflex.engine")


def picks_path(model_dir: Path) -> Path:
    """Where a model's counts are kept: under the nanoflex cache, keyed by the model directory
    and its config (a rebuilt or replaced model starts afresh)."""
    digest = hashlib.sha256(str(model_dir.resolve()).encode())
    digest.update((model_dir / "config.json").read_bytes())
    return cache_root() / "expert-picks" / f"{digest.hexdigest()[:20]}.json"


class ExpertPicks:
    """Per MoE layer, an int64 count per expert (host memory), loaded from `path` if it
    holds counts of this shape."""

    def __init__(self, path: Path | None, layers: list[int], num_experts: int) -> None:
        self.path, self.num_experts = path, num_experts
        self.counts = {j: torch.zeros(num_experts, dtype=torch.int64) for j in layers}
        if path is not None and path.is_file():
            self._read(path)

    def _read(self, path: Path) -> None:
        try:
            saved = json.loads(path.read_text())
            counts = {int(j): [int(c) for c in row] for j, row in saved["counts"].items()}
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            logger.warning("ignoring the expert pick counts in %s: %s", path, e)
            return
        if set(counts) != set(self.counts) or any(
            len(row) != self.num_experts for row in counts.values()
        ):
            logger.warning("ignoring the expert pick counts in %s: another shape", path)
            return
        for j, row in counts.items():
            self.counts[j] = torch.tensor(row, dtype=torch.int64)

    def hottest_first(self) -> list[tuple[int, int]]:
        """Every (layer, expert), most picked first; ties (and no counts at all) in layer and
        index order."""
        units = [(j, e) for j in sorted(self.counts) for e in range(self.num_experts)]
        return sorted(units, key=lambda u: -int(self.counts[u[0]][u[1]]))

    def save(self) -> None:
        """Write the counts (atomically: a crash leaves the old file or the new one)."""
        if self.path is None:
            return
        body = {"counts": {str(j): row.tolist() for j, row in self.counts.items()}}
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            publish_file(self.path, json.dumps(body))
        except OSError as e:
            logger.warning("could not keep the expert pick counts in %s: %s", self.path, e)

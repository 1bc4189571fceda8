"""The share of a copy hidden behind compute, as the profile keeps it (`copy_hidden`).

The CUDA probe itself runs in the GPU pass (`nanoflex profile` there); here its arithmetic,
which the profile and bench/gpu/overlap.py share."""

from __future__ import annotations

import pytest

from engine.profiling.copy_overlap import Overlap, hidden_share


@pytest.mark.parametrize(
    "copy,compute,both,hidden",
    [
        (10.0, 10.0, 10.0, 1.0),  # the copy wholly behind the GEMMs
        (10.0, 10.0, 20.0, 0.0),  # one after the other
        (4.0, 10.0, 12.0, 0.5),  # half of the shorter (the copy) hidden
        (10.0, 4.0, 10.5, 0.875),
        (10.0, 10.0, 25.0, 0.0),  # slower together than apart: nothing hidden, not < 0
        (10.0, 10.0, 8.0, 1.0),  # timing noise past perfect: clamped
        (0.0, 10.0, 10.0, 0.0),  # nothing to hide
    ],
)
def test_hidden_share_of_the_shorter(copy: float, compute: float, both: float, hidden: float):
    assert hidden_share(copy, compute, both) == pytest.approx(hidden)
    assert Overlap(copy, compute, both, gemms=1).hidden == pytest.approx(hidden)

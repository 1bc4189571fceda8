"""Mamba-2's gated norms, each family's against transformers' own module, bit for bit in
float32 and bfloat16 (where the order of the cast and the scale decides the rounding)."""

from __future__ import annotations

import pytest
import torch

from engine.models.mamba2 import gated_norm_f32, grouped_gated_norm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("norm_before_gate", [True, False])
def test_falcon_h1_gated_norm_is_transformers(dtype: torch.dtype, norm_before_gate: bool) -> None:
    from transformers.models.falcon_h1.modeling_falcon_h1 import FalconH1RMSNormGated

    g = torch.Generator().manual_seed(0)
    width, groups = 48, 3
    reference = FalconH1RMSNormGated(width, 1e-5, groups, norm_before_gate).to(dtype)
    with torch.no_grad():
        reference.weight.copy_(1 + torch.randn(width, generator=g))
    y, gate = (torch.randn(7, width, generator=g).to(dtype) for _ in range(2))
    expected = reference(y, gate)
    got = gated_norm_f32(y, gate, reference.weight.detach(), groups, 1e-5, not norm_before_gate)
    assert got.dtype == dtype and torch.equal(got, expected)


def test_granite_and_nemotron_gated_norm_is_transformers() -> None:
    """The gate first, the cast back before the scale (which Falcon-H1's does after)."""
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHRMSNormGated

    g = torch.Generator().manual_seed(1)
    reference = NemotronHRMSNormGated(48, group_size=16, eps=1e-5).to(torch.bfloat16)
    with torch.no_grad():
        reference.weight.copy_(1 + torch.randn(48, generator=g))
    y, gate = (torch.randn(7, 48, generator=g).to(torch.bfloat16) for _ in range(2))
    got = grouped_gated_norm(y, gate, reference.weight.detach(), 3, 1e-5)
    assert torch.equal(got, reference(y, gate))

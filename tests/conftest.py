"""Settings every test process needs before any test module imports what they govern."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    # Triton's interpreter runs the CUDA kernels on CPU tensors (tests/engine/kernels). The
    # setting is read when triton.language is first imported, for its own jit functions.
    os.environ.setdefault("TRITON_INTERPRET", "1")

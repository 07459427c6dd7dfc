"""What the CUDA room's Triton kernels share."""

from __future__ import annotations

import os

# Whether Triton runs its kernels in its interpreter (how the tests run them on a CPU), read once as
# Triton reads it: when the kernels are defined. The interpreter multiplies 16-bit dots as raw bits,
# so a kernel's tensor-core path multiplies the same 16-bit values widened to float32 there.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

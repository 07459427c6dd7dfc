"""The CUDA runner: the packed forward on transformers' modules, with the attention op outside
compiled graphs that replay as CUDA graphs (piecewise, workers.engine.compiled.GraphReplay).

Not yet run on a GPU in this form (docs/architecture.md): tests/test_compiled.py and
tests/test_scheduler.py have CUDA-only tests for it. A decode step captured whole as one graph,
with the device's own paged kernels, goes here.
"""

from __future__ import annotations

from workers.engine.runners.paged import PagedRunner


class CudaRunner(PagedRunner):
    """PagedRunner as it runs on CUDA: eager, or compiled with CUDA graphs (its platform's
    cuda_graphs); its attention is the PyTorch path (attention_backend.TORCH)."""

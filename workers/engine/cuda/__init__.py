"""The CUDA room: its runner (runner.py: a decode step one CUDA graph), its kernel chooser
(ops.py: the Triton kernels, or the PyTorch reference off a GPU), the device's lean forward
(lean.py), its sampler (sampler.py) and the Triton kernels (triton_*.py). Nothing here imports the
CPU's room (workers.engine.cpu)."""

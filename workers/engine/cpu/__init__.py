"""The CPU's room: its runner (runner.py), its kernel chooser (backend.py), the lean forward on
prepacked or quantized linears (lean.py, linears.py, invariant.py, decode_layers.py), what a long
prompt's position costs (calibrate.py), and the C++ kernels (kernels/, built by extension.py).
Nothing here imports the CUDA room (workers.engine.cuda)."""

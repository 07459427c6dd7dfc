"""Weight-only quantization: the formats (formats.py, one row each), their layout in memory
(weight.py), GGUF block types read into it (gguf.py), and how a model's linears take it (fuse.py)."""

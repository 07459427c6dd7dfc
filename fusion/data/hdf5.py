"""GptHDF5MapDataProcessor: token-ID prompts from one HDF5 file, predictions as .npz per batch.

Input: the single `.h5` file in data_dir, integer dataset `data` of shape (num_samples,
max_seq_len), or (max_seq_len, num_samples) with loop_dim 0. A row's prompt is the tokens before
its first start token (any of `start_token`); the start token itself is never given to a model.
Output rows are the prompt immediately followed by the generated tokens, padded with the first
start token; dummy rows (padding the last batch to batch_size) are all start token.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fusion.data.files import DataError, atomic_write

__all__ = ["DataError", "GptHDF5MapDataProcessor", "as_list", "write_npz_atomic"]


def as_list(value, name: str) -> list[int]:
    vals = value if isinstance(value, (list, tuple)) else [value]
    if not vals or not all(isinstance(v, int) and not isinstance(v, bool) for v in vals):
        raise DataError(f"{name} must be an integer or a non-empty list of integers, got {value!r}")
    return list(vals)


@dataclass(slots=True)
class Batch:
    number: int  # 1-based: the global step of predictions_<number>.npz
    prompts: list[list[int] | None]  # None marks a dummy row
    sample_indices: list[int | None]


class GptHDF5MapDataProcessor:
    def __init__(self, data_dir: str | Path, batch_size: int, start_token, loop_dim: int = 1,
                 inference_steps: int | None = None):
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise DataError(f"batch_size must be a positive integer, got {batch_size!r}")
        if loop_dim not in (0, 1):
            raise DataError(f"loop_dim must be 0 or 1, got {loop_dim!r}")
        if inference_steps is not None and (not isinstance(inference_steps, int) or inference_steps < 1):
            raise DataError(f"inference_steps must be a positive integer or null, got {inference_steps!r}")
        self.start_tokens = as_list(start_token, "start_token")
        self.batch_size, self.loop_dim, self.inference_steps = batch_size, loop_dim, inference_steps
        self.path = self._find(Path(data_dir))
        self.data = self._read(self.path)  # (num_samples, max_seq_len)
        self.prompts = [self._prompt(i, row) for i, row in enumerate(self.data)]

    @staticmethod
    def _find(data_dir: Path) -> Path:
        if not data_dir.is_dir():
            raise DataError(f"data_dir {data_dir} is not a directory")
        files = sorted(data_dir.glob("*.h5"))
        if len(files) != 1:
            raise DataError(f"data_dir {data_dir} must hold exactly one .h5 file, found {len(files)}")
        return files[0]

    def _read(self, path: Path) -> np.ndarray:
        import h5py

        try:
            with h5py.File(path, "r") as f:
                if "data" not in f:
                    raise DataError(f"{path}: no dataset named 'data' (found: {sorted(f.keys())})")
                ds = f["data"]
                if not isinstance(ds, h5py.Dataset):
                    raise DataError(f"{path}: 'data' is a group, not a dataset")
                if ds.ndim != 2:
                    raise DataError(f"{path}: 'data' must have rank 2 (samples x sequence), got shape {ds.shape}")
                if not np.issubdtype(ds.dtype, np.integer):
                    raise DataError(f"{path}: 'data' must hold integer token IDs, got dtype {ds.dtype}")
                arr = ds[()].astype(np.int64)
        except OSError as exc:
            raise DataError(f"{path}: not a readable HDF5 file ({exc})") from None
        return arr.T if self.loop_dim == 0 else arr

    def _prompt(self, i: int, row: np.ndarray) -> list[int]:
        hits = np.flatnonzero(np.isin(row, self.start_tokens))
        if hits.size == 0:
            raise DataError(f"{self.path}: row {i} has no start token (any of {self.start_tokens})")
        if hits[0] == 0:
            raise DataError(f"{self.path}: row {i} has an empty prompt (it begins with the start token)")
        prompt = row[: hits[0]]
        if (prompt < 0).any():
            j = int(np.flatnonzero(prompt < 0)[0])
            raise DataError(f"{self.path}: row {i} has a negative token ID ({int(prompt[j])}) at position {j}")
        return prompt.tolist()

    @property
    def max_seq_len(self) -> int:
        return self.data.shape[1]

    @property
    def num_batches(self) -> int:
        n = -(-len(self.prompts) // self.batch_size)
        return min(n, self.inference_steps) if self.inference_steps else n

    def batches(self) -> Iterator[Batch]:
        for b in range(self.num_batches):
            idx = list(range(b * self.batch_size, min((b + 1) * self.batch_size, len(self.prompts))))
            pad = self.batch_size - len(idx)
            yield Batch(b + 1, [self.prompts[i] for i in idx] + [None] * pad, idx + [None] * pad)

    def max_new_tokens(self, prompt: list[int], max_tokens: int | None) -> int:
        """Generation stops at max_tokens or when the row is full."""
        room = self.max_seq_len - len(prompt)
        return room if max_tokens is None else min(room, max_tokens)

    def predictions(self, batch: Batch, generated: list[list[int] | None]) -> np.ndarray:
        """(batch_size, max_seq_len) rows: prompt + generated, padded with the first start token."""
        out = np.full((self.batch_size, self.max_seq_len), self.start_tokens[0], dtype=self.data.dtype)
        for r, (prompt, gen) in enumerate(zip(batch.prompts, generated, strict=True)):
            if prompt is None:
                continue
            row = (prompt + list(gen or []))[: self.max_seq_len]
            out[r, : len(row)] = row
        return out.T if self.loop_dim == 0 else out


def write_npz_atomic(path: str | Path, global_step: int, predictions: np.ndarray) -> None:
    """A half-written file never appears under its name, and a written one survives a crash."""
    atomic_write(path, lambda f: np.savez(f, global_step=np.int64(global_step), predictions=predictions))

"""The compat runner: models whose attention does not go through transformers' attention
interface (BLOOM's ALiBi). One forward per sequence with a DynamicCache of its own: any causal
LM, at batch-1 speed. The scheduler still counts its blocks, so the budget holds here too."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from workers.engine.runners.base import Runner, chunk_tokens, kept_rows
from workers.engine.scheduler import Chunk
from workers.engine.sequence import Sequence
from workers.weights.loaded_model import LoadedModel

if TYPE_CHECKING:
    from workers.engine.kv_cache import CacheLayout
    from workers.platform import Platform


class CompatRunner(Runner):
    def __init__(self, lm: LoadedModel, platform: Platform, layout: CacheLayout):
        super().__init__(lm, platform, layout)
        self.caches: dict[int, object] = {}  # by sequence id

    def release(self, seq: Sequence) -> None:
        super().release(seq)
        self.caches.pop(seq.seq_id, None)

    def _run(self, seq: Sequence, ids: list[int], start: int, keep: range) -> torch.Tensor:
        from transformers import DynamicCache

        if start == 0 or seq.seq_id not in self.caches:
            self.caches[seq.seq_id] = DynamicCache(config=self.model.config)
        dev = self.lm.device
        end = start + len(ids)
        out = self.model(
            input_ids=torch.tensor([ids], device=dev),
            attention_mask=torch.ones(1, end, dtype=torch.long, device=dev),
            position_ids=torch.arange(start, end, device=dev)[None],
            past_key_values=self.caches[seq.seq_id],
            use_cache=True,
        )
        return out.logits[0, keep.start: keep.stop]

    def _forward(self, decode: list[Sequence], chunks: list[Chunk]) -> torch.Tensor:
        rows = [self._run(s, [s.token_at(s.num_computed)], s.num_computed, range(0, 1)) for s in decode]
        for c in chunks:
            rows.append(self._run(c.seq, chunk_tokens(c), c.start, kept_rows(c)))
        vocab = self.lm.vocab_size
        rows = [r for r in rows if r.shape[0]]
        return torch.cat(rows) if rows else torch.empty(0, vocab, device=self.lm.device)

"""A request's text, made from the engine's tokens away from the compute thread.

The engine only produces tokens and ends a sample on a stop token or a length. Everything that
needs the tokenizer happens here, as in vLLM v1's output processor: incremental detokenization,
stop strings (which end a sample: the caller tells the engine, which may have run a step or two
past it by then; those tokens are dropped), the final text, and the choice of the n best of
`best_of` samples, ranked on the tokens kept.

The engine's outputs of a running request hold its growing token lists (see Engine._output); they
only ever grow, so reading them up to a length taken on the engine's thread is safe from another.
"""

from __future__ import annotations

from dataclasses import dataclass

from workers.engine.detok import IncrementalText
from workers.engine.outputs import CompletionOutput, RequestOutput
from workers.engine.params import SamplingParams
from workers.engine.stops import stop_token_ids


@dataclass(slots=True)
class SampleText:
    detok: IncrementalText | None  # None: no stop strings and no stream, so no text until the end
    read: int = 0  # tokens taken from the engine's list
    checked: int = 0  # characters of text scanned for stop strings
    ended: int | None = None  # tokens kept once a stop token or stop string ended the sample
    cut: str | None = None  # the text, cut before a stop string

    @property
    def text(self) -> str:
        """The stable text so far (cut at a stop string once one matched)."""
        if self.cut is not None:
            return self.cut
        return self.detok.text if self.detok is not None else ""


class RequestText:
    """Per request: the samples' text and stop strings, then the final RequestOutput."""

    def __init__(self, tokenizer, params: SamplingParams, eos_token_ids: list[int], incremental: bool = False):
        self.tokenizer, self.params = tokenizer, params
        self._stop_ids = stop_token_ids(params, eos_token_ids)
        self._incremental = incremental or bool(params.stop)
        self._longest = max((len(s) for s in params.stop), default=0)
        self.samples: dict[int, SampleText] = {}

    def sample(self, index: int) -> SampleText:
        s = self.samples.get(index)
        if s is None:
            s = self.samples[index] = SampleText(IncrementalText(self.tokenizer) if self._incremental else None)
        return s

    def update(self, out: RequestOutput, lengths: list[int] | None = None) -> list[int]:
        """Read each sample's tokens up to `lengths` (default: all it has); return the samples a
        stop string ended just now, which the engine should stop running."""
        ended = []
        for k, c in enumerate(out.outputs):
            s = self.sample(c.index)
            n = len(c.token_ids) if lengths is None else lengths[k]
            if s.ended is not None or n <= s.read:
                continue
            if s.detok is None:
                s.read = n
                continue
            for tok in c.token_ids[s.read:n]:
                s.read += 1
                s.detok.extend((tok,))
                if tok in self._stop_ids:  # the engine ends it here, with the whole text (stop tokens win)
                    s.ended = s.read
                    break
                if not self._longest:
                    continue
                if s.read <= self.params.min_tokens:  # held back too, as vLLM holds them: text that
                    s.checked = len(s.detok.text)  # came before is never scanned
                elif self._match_stop(s):
                    s.ended = s.read
                    ended.append(c.index)
                    break
        return ended

    def _match_stop(self, s: SampleText) -> bool:
        text = s.detok.text
        # only text not yet scanned (with the overlap a stop string could straddle) can hold a new match
        begin = max(0, s.checked - self._longest + 1)
        hits = [i for i in (text.find(stop, begin) for stop in self.params.stop) if i >= 0]
        s.checked = len(text)
        if hits:
            s.cut = text[: min(hits)]
            return True
        return False

    def done(self, out: RequestOutput) -> bool:
        """Every sample ended: by the engine, or here by a stop string."""
        if out.finished:
            return True
        started = {c.index: c for c in out.outputs}
        return len(started) == self.params.num_samples and all(
            c.finish_reason is not None or self.sample(i).cut is not None for i, c in started.items())

    def final(self, out: RequestOutput) -> RequestOutput:
        """The finished request (call once done(out)): texts, stop cuts and, for best_of, the n best."""
        self.update(out)
        outs = [self._final_sample(c) for c in out.outputs]
        p = self.params
        if p.num_samples > p.n:  # best_of: the n samples with the highest mean token log-probability
            outs = sorted(outs, key=lambda c: -c.mean_logprob if c.logprobs else 0.0)[: p.n]
            for i, c in enumerate(outs):
                c.index = i
        return RequestOutput(
            request_id=out.request_id, prompt=out.prompt, prompt_token_ids=out.prompt_token_ids, outputs=outs,
            finished=True,
            prompt_logprobs=list(out.prompt_logprobs) if out.prompt_logprobs is not None else None,
            prompt_top_logprobs=list(out.prompt_top_logprobs) if out.prompt_top_logprobs is not None else None)

    def _final_sample(self, c: CompletionOutput) -> CompletionOutput:
        s = self.sample(c.index)
        n = s.ended if s.ended is not None else len(c.token_ids)
        ids = list(c.token_ids[:n])
        if s.cut is not None:
            text, reason = s.cut, "stop"
        else:
            text, reason = self.tokenizer.decode(ids, skip_special_tokens=True), c.finish_reason
        return CompletionOutput(
            index=c.index, token_ids=ids, text=text,
            logprobs=list(c.logprobs[:n]) if c.logprobs is not None else None,
            top_logprobs=list(c.top_logprobs[:n]) if c.top_logprobs is not None else None,
            finish_reason=reason, new_token_ids=[])

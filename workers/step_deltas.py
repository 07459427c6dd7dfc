"""A step's outputs as they cross to the output process: what each request added since the last
step, not its whole lists (a running request's token lists are the engine's own and grow every
step; sending them whole made a stream's cost quadratic in its length).

`StepEncoder` runs on the engine thread and `StepMirror` in the output process; the mirror rebuilds
each running request's RequestOutput from the additions, so the output work sees what the output
thread would have seen. A request is sent whole the first time it has a token (its prompt's
log-probabilities are complete by then) and when it finishes (the engine's finished output is a
copy already).
"""

from __future__ import annotations

from workers.engine.outputs import CompletionOutput, RequestOutput
from workers.thread_messages import StepOutputs

# (index, new token ids, finish_reason, new logprobs or None, new top logprobs or None)
SampleDelta = tuple[int, list[int], str | None, list | None, list | None]


def _snapshot(res: RequestOutput) -> RequestOutput:
    def copy(x):
        return list(x) if x is not None else None

    outs = [CompletionOutput(c.index, list(c.token_ids), "", copy(c.logprobs), copy(c.top_logprobs), c.finish_reason)
            for c in res.outputs]
    return RequestOutput(res.request_id, res.prompt, list(res.prompt_token_ids), outs, res.finished,
                         copy(res.prompt_logprobs), copy(res.prompt_top_logprobs))


class StepEncoder:
    """Remembers how much of each running request was sent."""

    def __init__(self):
        self.sent: dict[str, dict[int, int]] = {}  # key -> per sample index, tokens sent

    def forget(self, keys: list[str] | None) -> None:
        if keys is None:
            self.sent.clear()
        for key in keys or ():
            self.sent.pop(key, None)

    def encode(self, results: list[RequestOutput]) -> list[tuple[str, RequestOutput | list[SampleDelta]]]:
        rows: list[tuple[str, RequestOutput | list[SampleDelta]]] = []
        for res in results:
            key = res.request_id
            if res.finished:
                self.sent.pop(key, None)
                rows.append((key, res))
                continue
            sent = self.sent.get(key)
            if sent is None:
                if any(c.token_ids for c in res.outputs):
                    self.sent[key] = {c.index: len(c.token_ids) for c in res.outputs}
                    rows.append((key, _snapshot(res)))
                continue  # nothing to say yet (a prompt still being prefilled)
            deltas: list[SampleDelta] = []
            for c in res.outputs:
                s, n = sent.get(c.index, 0), len(c.token_ids)
                if n == s and c.finish_reason is None:
                    continue
                sent[c.index] = n
                deltas.append((c.index, c.token_ids[s:n], c.finish_reason,
                               c.logprobs[s:n] if c.logprobs is not None else None,
                               c.top_logprobs[s:n] if c.top_logprobs is not None else None))
            if deltas:
                rows.append((key, deltas))
        return rows


class StepMirror:
    """The output process's copy of each running request's output, grown by the encoder's rows."""

    def __init__(self):
        self.outputs: dict[str, RequestOutput] = {}

    def forget(self, keys: list[str] | None) -> None:
        if keys is None:
            self.outputs.clear()
        for key in keys or ():
            self.outputs.pop(key, None)

    def apply(self, rows: list[tuple[str, RequestOutput | list[SampleDelta]]]) -> StepOutputs:
        results, lengths = [], []
        for key, body in rows:
            if isinstance(body, RequestOutput):
                res = body
                if res.finished:
                    self.outputs.pop(key, None)
                else:
                    self.outputs[key] = res
            else:
                res = self.outputs.get(key)
                if res is None:
                    continue  # forgotten since: nothing more is sent for it
                samples = {c.index: c for c in res.outputs}
                for index, tokens, finish, logprobs, tops in body:
                    c = samples.get(index)
                    if c is None:
                        c = CompletionOutput(index, [], "", [] if logprobs is not None else None,
                                             [] if tops is not None else None, None)
                        res.outputs.append(c)
                    c.token_ids += tokens
                    if logprobs is not None:
                        c.logprobs += logprobs
                    if tops is not None:
                        c.top_logprobs += tops
                    c.finish_reason = finish
            results.append(res)
            lengths.append([len(c.token_ids) for c in res.outputs])
        return StepOutputs(results, lengths)

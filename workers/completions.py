"""OpenAI completions on top of the engine: request parameters in, completion objects out."""

from __future__ import annotations

import time
import uuid

from workers.engine.detok import tokens_within
from workers.engine.outputs import RequestOutput
from workers.engine.params import SamplingParams

# OpenAI parameter -> SamplingParams field (extensions: top_k, stop_token_ids, ignore_eos)
_DIRECT = {"max_tokens", "temperature", "top_p", "top_k", "n", "best_of", "seed", "stop", "stop_token_ids",
           "ignore_eos"}
_HANDLED = _DIRECT | {"logprobs", "echo"}
# no effect on sampling: routing and bookkeeping fields (return_token_ids is read by the worker and adds
# choices[i]["token_ids"])
_IGNORED = {"user", "stream", "model", "engine", "prompt", "return_token_ids"}
# OpenAI parameters not implemented: accepted only at their no-op value, refused otherwise, never ignored
_UNSUPPORTED = {"presence_penalty": 0, "frequency_penalty": 0, "logit_bias": {}, "suffix": ""}


def sampling_params(req: dict, defaults: dict | None = None) -> tuple[SamplingParams, bool]:
    """SamplingParams and `echo` from OpenAI-style parameters. ValueError names a bad key."""
    merged = dict(defaults or {})
    merged.update(req)
    unknown = sorted(set(merged) - _HANDLED - _IGNORED - set(_UNSUPPORTED))
    if unknown:
        raise ValueError(f"unknown parameter {unknown[0]!r}")
    for key, noop in _UNSUPPORTED.items():
        if merged.get(key) not in (None, noop):
            raise ValueError(f"{key} is not supported by this server (got {merged[key]!r}); leave it out or "
                             f"set it to {noop!r}")
    kw = {k: merged[k] for k in _DIRECT if merged.get(k) is not None}
    lp = merged.get("logprobs")
    if lp is not None:
        if isinstance(lp, bool) or not isinstance(lp, int) or not 0 <= lp <= 20:
            raise ValueError(f"logprobs must be an integer in [0, 20], got {lp!r}")
        kw["logprobs"] = lp
    echo = merged.get("echo", False)
    if not isinstance(echo, bool):
        raise ValueError(f"echo must be true or false, got {echo!r}")
    if echo and lp is not None:
        kw["prompt_logprobs"] = lp
    return SamplingParams(**kw), echo


def _logprobs_block(tokenizer, token_ids, logprobs, tops, start_offset: int):
    tokens, offsets = [], []
    offset = start_offset
    for t in token_ids:
        s = tokenizer.decode([t])
        tokens.append(s)
        offsets.append(offset)
        offset += len(s)
    top = [({tokenizer.decode([k]): v for k, v in d.items()} if d is not None else None) for d in tops]
    return {"tokens": tokens, "token_logprobs": list(logprobs), "top_logprobs": top, "text_offset": offsets}


def completion_response(out: RequestOutput, model_name: str, tokenizer, echo: bool, with_logprobs: bool,
                        token_ids: bool = False) -> dict:
    """An OpenAI `text_completion` object for a finished request."""
    prompt_text = "" if not echo else out.prompt if out.prompt is not None else tokenizer.decode(out.prompt_token_ids)
    choices = []
    for c in out.outputs:
        text = (prompt_text + c.text) if echo else c.text
        lp_block = None
        if with_logprobs:
            n_text = len(tokenizer.decode(c.token_ids)) if c.token_ids else 0
            gen_ids = c.token_ids
            # stop strings cut the text: report only the tokens that are inside it
            if len(c.text) < n_text:
                gen_ids = gen_ids[: tokens_within(tokenizer, gen_ids, len(c.text))]
            tops = c.top_logprobs[: len(gen_ids)] if c.top_logprobs else [None] * len(gen_ids)
            gen = _logprobs_block(tokenizer, gen_ids, c.logprobs[: len(gen_ids)], tops,
                                  len(prompt_text) if echo else 0)
            if echo:
                ptops = out.prompt_top_logprobs or [None] * len(out.prompt_token_ids)
                pblock = _logprobs_block(tokenizer, out.prompt_token_ids, out.prompt_logprobs or
                                         [None] * len(out.prompt_token_ids), ptops, 0)
                lp_block = {k: pblock[k] + gen[k] for k in gen}
            else:
                lp_block = gen
        choice = {"text": text, "index": c.index, "logprobs": lp_block, "finish_reason": c.finish_reason}
        if token_ids:
            choice["token_ids"] = list(c.token_ids)
        choices.append(choice)
    completion_tokens = sum(len(c.token_ids) for c in out.outputs)
    return {
        "id": f"cmpl-{uuid.uuid4().hex[:24]}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": model_name,
        "choices": choices,
        "usage": {"prompt_tokens": len(out.prompt_token_ids), "completion_tokens": completion_tokens,
                  "total_tokens": len(out.prompt_token_ids) + completion_tokens},
    }

"""A finished request's neutral result: tokens, text, logprobs (with the tokens' text), finish
reasons and usage, made on the worker, where the tokenizer is."""

from __future__ import annotations

from workers.engine.detok import tokens_within
from workers.engine.outputs import RequestOutput


def logprobs_block(tokenizer, token_ids, logprobs, tops, start_offset: int) -> dict:
    """OpenAI's completion `logprobs` of `token_ids`: each token's text, its log-probability, the top
    alternatives by text, and where each token's text starts (from `start_offset`)."""
    tokens, offsets = [], []
    offset = start_offset
    for t in token_ids:
        s = tokenizer.decode([t])
        tokens.append(s)
        offsets.append(offset)
        offset += len(s)
    top = [({tokenizer.decode([k]): v for k, v in d.items()} if d is not None else None) for d in tops]
    return {"tokens": tokens, "token_logprobs": list(logprobs), "top_logprobs": top, "text_offset": offsets}


def completion_result(out: RequestOutput, model_name: str, tokenizer, echo: bool, with_logprobs: bool) -> dict:
    """A finished request's result, as the worker sends it (wire/protocol.py): per sample its
    text, token IDs, logprobs and finish reason, and the usage. The clients make OpenAI objects of
    it (routing/openai_objects.py)."""
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
            gen = logprobs_block(tokenizer, gen_ids, c.logprobs[: len(gen_ids)], tops,
                                 len(prompt_text) if echo else 0)
            if echo:
                ptops = out.prompt_top_logprobs or [None] * len(out.prompt_token_ids)
                pblock = logprobs_block(tokenizer, out.prompt_token_ids, out.prompt_logprobs or
                                        [None] * len(out.prompt_token_ids), ptops, 0)
                lp_block = {k: pblock[k] + gen[k] for k in gen}
            else:
                lp_block = gen
        choices.append({"text": text, "index": c.index, "logprobs": lp_block, "finish_reason": c.finish_reason,
                        "token_ids": list(c.token_ids)})
    completion_tokens = sum(len(c.token_ids) for c in out.outputs)
    return {
        "model": model_name,
        "choices": choices,
        "usage": {"prompt_tokens": len(out.prompt_token_ids), "completion_tokens": completion_tokens,
                  "total_tokens": len(out.prompt_token_ids) + completion_tokens},
    }

"""Sampling parameters of one request, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass, field

from workers.config_keys import DEFAULT_MAX_TOKENS
from workers.validate import ParamError, check_int, check_number

# every stop string is searched for in each new piece of a sample's text, on the output thread that
# all of a worker's requests share (OpenAI takes 4; lm-evaluation-harness sends a few)
MAX_STOP_STRINGS = 64


def _token_biases(bias) -> dict[int, float]:
    """logit_bias as {token ID: bias}: JSON gives the IDs as strings ("50256"); a bias in [-100, 100]
    as OpenAI's API takes it."""
    if not isinstance(bias, dict):
        raise ParamError("logit_bias", f"logit_bias must be an object of token ID -> bias, got {type(bias).__name__}")
    out = {}
    for key, value in bias.items():
        tid = int(key) if isinstance(key, str) and key.isdigit() else key
        if isinstance(tid, bool) or not isinstance(tid, int) or tid < 0:
            raise ParamError("logit_bias", f"logit_bias keys must be token IDs (integers >= 0), got {key!r}")
        check_number("logit_bias", value, -100, 100)
        out[tid] = float(value)
    return out


@dataclass(slots=True)
class SamplingParams:
    """What to generate for one prompt, in the names OpenAI and vLLM users know.

    temperature 0 is greedy. top_k 0 (or -1) and top_p 1.0 disable those filters. A sampled token
    depends only on (seed, sample index, token index) and the logits, so a request gives the
    same tokens alone or inside any batch. `seed` None draws one per request.
    """

    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    n: int = 1
    best_of: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False  # True: the model's EOS does not end the sequence (HDF5 contract)
    logprobs: int | None = None  # None: no top alternatives; k >= 0: chosen token plus top-k
    prompt_logprobs: int | None = None  # None: none; k >= 0: per prompt token, plus top-k
    # what changes the logits before a token is picked (vLLM's meanings): a bias per token ID; the
    # end tokens (and stop strings: text_output) held back until min_tokens are out; a penalty on
    # every token of the prompt and the output (divides a positive logit, multiplies a negative
    # one); and penalties per output token's count (frequency) and presence
    logit_bias: dict[int, float] = field(default_factory=dict)
    min_tokens: int = 0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if isinstance(self.stop_token_ids, int):
            self.stop_token_ids = [self.stop_token_ids]
        for name in ("stop", "stop_token_ids"):
            if not isinstance(getattr(self, name) or [], (list, tuple)):
                raise ParamError(name, f"{name} must be a list, got {type(getattr(self, name)).__name__}")
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        check_int("max_tokens", self.max_tokens, 0)
        if not isinstance(self.ignore_eos, bool):
            raise ParamError("ignore_eos", f"ignore_eos must be true or false, got {self.ignore_eos!r}")
        check_number("temperature", self.temperature)
        if self.temperature < 0:
            raise ParamError("temperature", f"temperature must be >= 0 (0 is greedy), got {self.temperature}")
        check_int("top_k", self.top_k, -1)
        check_number("top_p", self.top_p)
        if not 0 < self.top_p <= 1:
            raise ParamError("top_p", f"top_p must be in (0, 1], got {self.top_p}")
        if self.seed is not None:
            check_int("seed", self.seed, 0)
        check_int("n", self.n, 1)
        if self.best_of is not None:
            check_int("best_of", self.best_of, 1)
            if self.best_of < self.n:
                raise ParamError("best_of", f"best_of ({self.best_of}) must be >= n ({self.n})")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ParamError("stop", f"stop holds {len(self.stop)} strings; the limit is {MAX_STOP_STRINGS}")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ParamError("stop", f"stop must be non-empty strings, got {s!r}")
        for t in self.stop_token_ids:
            check_int("stop_token_ids", t, 0)
        if self.logprobs is not None:
            check_int("logprobs", self.logprobs, 0)
        if self.prompt_logprobs is not None:
            check_int("prompt_logprobs", self.prompt_logprobs, 0)
        self.logit_bias = _token_biases(self.logit_bias)
        check_int("min_tokens", self.min_tokens, 0)
        if self.min_tokens > self.max_tokens:
            raise ParamError("min_tokens", f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        check_number("repetition_penalty", self.repetition_penalty, 0, low_open=True)
        for name in ("frequency_penalty", "presence_penalty"):
            check_number(name, getattr(self, name), -2, 2)

    @property
    def adjusts_logits(self) -> bool:
        """Whether anything changes the logits before a token is picked."""
        return bool(self.logit_bias or self.min_tokens or self.repetition_penalty != 1.0 or self.frequency_penalty
                    or self.presence_penalty)

    @property
    def num_samples(self) -> int:
        """Sequences to run: best_of when given (the n best are returned), else n."""
        return self.best_of or self.n

    @property
    def wants_logprobs(self) -> bool:
        """The chosen tokens' log-probabilities are needed: asked for, or to rank best_of samples."""
        return self.logprobs is not None or self.num_samples > self.n

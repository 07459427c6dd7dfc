"""run_mm.py --mode eval: score each variant's input data instead of generating.

Every sample (an HDF5 row's prompt, or a JSONL line's prompt) is sent to its variant as a scoring
request (echo, logprobs 0, max_tokens 0), through the router like predict. Per sample: the
per-token log-probabilities (the first token has none) and the perplexity; per model: the
token-weighted mean log-probability and perplexity. Written atomically to
`<model_dir>/eval/<variant>.json`.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from fusion.data.hdf5 import DataError
from fusion.data.jsonl import find_files, parse_file
from fusion.model_info import MultiModelFusion
from fusion.predict import HDF5, Transient, complete, hdf5_processor, processor_name, run_jobs, variant_groups
from fusion.progress import Progress
from routing.client import AsyncClient, RouterError


@dataclass(slots=True)
class EvalSample:
    where: str  # "prompts.h5 row 3", "requests.jsonl line 7"
    prompt: str | list[int] | None
    error: str | None = None


@dataclass(slots=True)
class EvalJob:
    name: str
    source: str
    samples: list[EvalSample]
    out: Path
    concurrency: int
    retry_delays: tuple[float, ...] = ()
    results: list[dict] = field(default_factory=list)

    async def _one(self, client: AsyncClient, i: int, s: EvalSample, progress: Progress) -> dict:
        entry: dict = {"sample": i, "where": s.where}
        if s.error is not None:
            progress.advance(self.name, errors=1)
            return {**entry, "error": s.error}
        try:
            r = await complete(client, self.name, s.prompt, self.retry_delays, max_tokens=0, echo=True, logprobs=0,
                               temperature=0.0)
        except (RouterError, Transient) as exc:
            progress.advance(self.name, errors=1)
            return {**entry, "error": f"{s.where}: {exc}"}
        lp = r["choices"][0]["logprobs"]
        scored = [x for x in lp["token_logprobs"] if x is not None]
        mean = sum(scored) / len(scored) if scored else None
        progress.advance(self.name, samples=1)
        return {**entry, "num_tokens": len(lp["tokens"]), "tokens": lp["tokens"],
                "token_logprobs": lp["token_logprobs"], "mean_logprob": mean,
                "perplexity": math.exp(-mean) if mean is not None else None}

    async def run(self, client: AsyncClient, progress: Progress) -> None:
        progress.start(self.name)
        gate = asyncio.Semaphore(self.concurrency)

        async def guarded(i, s):
            async with gate:
                return await self._one(client, i, s, progress)

        self.results = list(await asyncio.gather(*[guarded(i, s) for i, s in enumerate(self.samples)]))
        write_json_atomic(self.out, self.report())

    def report(self) -> dict:
        lps = [x for r in self.results if "token_logprobs" in r for x in r["token_logprobs"] if x is not None]
        mean = sum(lps) / len(lps) if lps else None
        return {"variant": self.name, "source": self.source, "samples": len(self.results),
                "errors": sum("error" in r for r in self.results), "scored_tokens": len(lps),
                "mean_logprob": mean, "perplexity": math.exp(-mean) if mean is not None else None,
                "per_sample": self.results}


def write_json_atomic(path: Path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=".json")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(obj, f, ensure_ascii=False)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def eval_samples(fusion: MultiModelFusion, name: str, inference_steps: int | None) -> list[EvalSample]:
    if processor_name(fusion, name) == HDF5:
        proc = hdf5_processor(fusion, name, inference_steps)
        return [EvalSample(f"{proc.path.name} row {i}", p) for b in proc.batches()
                for i, p in zip(b.sample_indices, b.prompts) if p is not None]
    info = fusion.models[variant_groups(fusion)[name][0]]
    data_dir = (info.params.get("inference_input") or {}).get("data_dir", "")
    out = []
    for path in find_files(data_dir):  # each variant scores all of its own input, whatever `model` says
        for ln in parse_file(path, name, {name}, {}, routed=False).lines:
            where = f"{path.name} line {ln.number}"
            out.append(EvalSample(where, ln.request["prompt"]) if ln.error is None else
                       EvalSample(where, None, error=ln.error))
    if not out:
        raise DataError(f"variant {name!r}: no samples to score in {data_dir}")
    return out


def build_eval_jobs(fusion: MultiModelFusion, model_dir: str | Path, inference_steps: int | None,
                    retry_delays: tuple[float, ...] = (0.5, 2.0, 8.0)) -> list[EvalJob]:
    jobs = []
    for name, mids in variant_groups(fusion).items():
        info = fusion.models[mids[0]]
        bs = (info.params.get("inference_input") or {}).get("batch_size", 8)
        jobs.append(EvalJob(name, info.source, eval_samples(fusion, name, inference_steps),
                            Path(model_dir) / "eval" / f"{name}.json", max(1, int(bs)) * len(mids), retry_delays))
    return jobs


def run_eval(frontend: str, jobs: list[EvalJob], timeout: float = 3600, stream=None,
             bars: bool | None = None, client_kw: dict | None = None) -> list[str]:
    progress = Progress({j.name: len(j.samples) for j in jobs}, stream=stream, bars=bars)
    run_jobs(frontend, jobs, progress, timeout, client_kw)
    lines = []
    for j in jobs:
        rep = j.report()
        ppl = f"{rep['perplexity']:.3f}" if rep["perplexity"] is not None else "n/a"
        lines.append(f"{j.name}: {rep['samples']} samples, {rep['scored_tokens']} tokens scored, perplexity {ppl}"
                     f"{', ' + str(rep['errors']) + ' errors' if rep['errors'] else ''}; written to {j.out}")
    return lines

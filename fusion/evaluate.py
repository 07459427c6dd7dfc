"""run_mm.py --mode eval: score each variant's input data instead of generating.

Every sample (an HDF5 row's prompt, or a JSONL line's prompt) is sent to its variant as a scoring
request (echo, logprobs 0, max_tokens 0), through the router like predict. Per sample: the
per-token log-probabilities (the first token has none) and the perplexity; per model: the
token-weighted mean log-probability and perplexity, in `<model_dir>/eval/<variant>.json`.

Like predict it writes as it goes and resumes: each scored sample is appended (fsynced) to
`<variant>.partial.jsonl` beside the report; a rerun scores only the samples not in it (and those
that failed for a transient reason), and the report is written atomically at the end.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, field
from pathlib import Path

from fusion.data.files import RecordLog, write_json_atomic
from fusion.inputs import Sample, variant_samples
from fusion.jobs import Transient, complete, run_jobs, variant_groups
from fusion.model_info import MultiModelFusion
from fusion.params import RUNCONFIG_DEFAULTS, input_value
from fusion.progress import Progress
from routing.client import AsyncClient, RouterError


@dataclass(slots=True)
class EvalJob:
    name: str
    source: str
    samples: list[Sample]
    out: Path
    concurrency: int
    retry_delays: tuple[float, ...] = ()
    results: list[dict] = field(default_factory=list)
    failed: int = 0  # samples that failed for a transient reason: a rerun scores them again

    @property
    def log_path(self) -> Path:
        return self.out.with_name(f"{self.out.stem}.partial.jsonl")

    async def _one(self, client: AsyncClient, i: int, s: Sample, progress: Progress) -> dict:
        entry: dict = {"sample": i, "where": s.where}
        if s.error is not None:
            progress.advance(self.name, errors=1)
            return {**entry, "error": s.error}
        try:
            r = await complete(client, self.name, s.prompt, self.retry_delays, max_tokens=0, echo=True, logprobs=0,
                               temperature=0.0)
        except (RouterError, Transient) as exc:
            progress.advance(self.name, errors=1)
            return {**entry, "error": f"{s.where}: {exc}", "retry": isinstance(exc, Transient)}
        lp = r["choices"][0]["logprobs"]
        scored = [x for x in lp["token_logprobs"] if x is not None]
        mean = sum(scored) / len(scored) if scored else None
        progress.advance(self.name, samples=1)
        return {**entry, "num_tokens": len(lp["tokens"]), "tokens": lp["tokens"],
                "token_logprobs": lp["token_logprobs"], "mean_logprob": mean,
                "perplexity": math.exp(-mean) if mean is not None else None}

    async def run(self, client: AsyncClient, progress: Progress) -> None:
        progress.start(self.name)
        log = RecordLog(self.log_path)
        done = {r["sample"]: r for r in log.records
                if isinstance(r.get("sample"), int) and r["sample"] < len(self.samples) and not r.get("retry")}
        if done:
            progress.advance(self.name, skipped=len(done))
        gate = asyncio.Semaphore(self.concurrency)

        async def guarded(i, s):
            async with gate:
                rec = await self._one(client, i, s, progress)
            log.append(rec)
            done[i] = rec

        try:
            await asyncio.gather(*[guarded(i, s) for i, s in enumerate(self.samples) if i not in done])
        finally:
            log.close()
        self.results = [done[i] for i in sorted(done)]
        self.failed = sum(bool(r.get("retry")) for r in self.results)
        write_json_atomic(self.out, self.report())
        if not self.failed:
            log.remove()

    def report(self) -> dict:
        lps = [x for r in self.results if "token_logprobs" in r for x in r["token_logprobs"] if x is not None]
        mean = sum(lps) / len(lps) if lps else None
        return {"variant": self.name, "source": self.source, "samples": len(self.results),
                "errors": sum("error" in r for r in self.results), "scored_tokens": len(lps),
                "mean_logprob": mean, "perplexity": math.exp(-mean) if mean is not None else None,
                "per_sample": self.results}


def build_eval_jobs(fusion: MultiModelFusion, model_dir: str | Path, inference_steps: int | None,
                    retry_delays: tuple[float, ...] = tuple(RUNCONFIG_DEFAULTS["retry_delays"])) -> list[EvalJob]:
    jobs = []
    for name, mids in variant_groups(fusion).items():
        info = fusion.models[mids[0]]
        bs = input_value(info.inference_input, "batch_size")
        jobs.append(EvalJob(name, info.source, variant_samples(fusion, name, inference_steps),
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

"""predict over HDF5 prompts (GptHDF5MapDataProcessor), as a client of the router.

A variant with count c splits its batches over its c copies: batch X goes to copy (X-1) mod c.
Each batch's file is written atomically as soon as the batch finishes; a rerun skips batches
whose file already exists, so an interrupted run resumes where it stopped.
"""

from __future__ import annotations

import asyncio
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from fusion.data.hdf5 import DataError, GptHDF5MapDataProcessor, as_list, write_npz_atomic
from fusion.model_info import MultiModelFusion
from routing.client import AsyncClient


@dataclass(slots=True)
class VariantJob:
    name: str
    model_ids: list[int]
    processor: GptHDF5MapDataProcessor
    params: dict  # the variant's model section
    out_dir: Path
    samples: int = 0
    tokens: int = 0
    skipped: int = 0
    seconds: float = 0.0


def hdf5_jobs(fusion: MultiModelFusion, model_dir: str | Path, inference_steps: int | None) -> list[VariantJob]:
    jobs: dict[str, VariantJob] = {}
    for mid, info in enumerate(fusion.models):
        if info.name in jobs:
            jobs[info.name].model_ids.append(mid)
            continue
        p = info.params
        inp = p.get("inference_input") or {}
        proc_name = inp.get("data_processor")
        if proc_name != "GptHDF5MapDataProcessor":
            raise DataError(f"variant {info.name!r}: inference_input.data_processor {proc_name!r} is not supported by "
                            "predict yet (GptHDF5MapDataProcessor is)")
        if "start_token" not in p:
            raise DataError(f"variant {info.name!r}: model.start_token is required for GptHDF5MapDataProcessor")
        processor = GptHDF5MapDataProcessor(inp.get("data_dir", ""), inp.get("batch_size", 1), p["start_token"],
                                            p.get("loop_dim", 1), inference_steps)
        jobs[info.name] = VariantJob(info.name, [mid], processor, p, Path(model_dir) / "predictions" / info.name)
    return list(jobs.values())


async def _run_batch(client: AsyncClient, job: VariantJob, batch) -> None:
    path = job.out_dir / f"predictions_{batch.number}.npz"
    if path.exists():
        job.skipped += 1
        return
    p = job.params
    mid = job.model_ids[(batch.number - 1) % len(job.model_ids)]
    end = [t for t in as_list(p.get("end_token", []) or [], "end_token") if t >= 0] if "end_token" in p else []

    async def one(prompt):
        if prompt is None:
            return None
        n = job.processor.max_new_tokens(prompt, p.get("max_tokens"))
        if n <= 0:
            return []
        r = await client.complete(mid, prompt, max_tokens=n, temperature=p.get("temperature", 0.0),
                                  top_p=p.get("top_p", 1.0), top_k=p.get("top_k", 0), stop_token_ids=end,
                                  ignore_eos=True, return_token_ids=True)
        return r["choices"][0]["token_ids"]

    generated = await asyncio.gather(*[one(pr) for pr in batch.prompts])
    write_npz_atomic(path, batch.number, job.processor.predictions(batch, generated))
    job.samples += sum(pr is not None for pr in batch.prompts)
    job.tokens += sum(len(g) for g in generated if g)


async def _run_job(client: AsyncClient, job: VariantJob, report) -> None:
    start = time.perf_counter()
    job.out_dir.mkdir(parents=True, exist_ok=True)
    gate = asyncio.Semaphore(len(job.model_ids))  # one batch in flight per copy

    async def guarded(batch):
        async with gate:
            await _run_batch(client, job, batch)
            report(job)

    await asyncio.gather(*[guarded(b) for b in job.processor.batches()])
    job.seconds = time.perf_counter() - start


def run_predict(frontend: str, jobs: list[VariantJob], timeout: float = 3600) -> list[VariantJob]:
    done: dict[str, int] = {}

    def report(job: VariantJob) -> None:
        done[job.name] = done.get(job.name, 0) + 1
        print(f"[{job.name}] batch {done[job.name]}/{job.processor.num_batches} done "
              f"({job.samples} samples, {job.tokens} tokens)", file=sys.stderr, flush=True)

    async def go():
        async with AsyncClient(frontend, timeout=timeout) as client:
            await asyncio.gather(*[_run_job(client, j, report) for j in jobs])

    asyncio.run(go())
    for j in jobs:
        rate = j.tokens / j.seconds if j.seconds else 0.0
        print(f"{j.name}: {j.samples} samples, {j.tokens} tokens generated, {rate:.1f} tokens/s, "
              f"{j.seconds:.1f}s wall, {j.skipped} batches already written; outputs in {j.out_dir}", flush=True)
    return jobs

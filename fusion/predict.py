"""run_mm.py --mode predict: the variants' input data through the router, outputs on disk.

Jobs are built (and every input file checked) before any model loads:
- GptHDF5MapDataProcessor: one job per variant. Batch X goes to copy (X-1) mod count, one batch
  in flight per copy; each batch's .npz is written atomically as it finishes.
- JsonlCompletions: one job per input file. Lines go to the variant their `model`/`engine` field
  names; output lines are written in input order as they finish (see fusion.data.jsonl).
A rerun skips batches and lines already written, so an interrupted run resumes where it stopped.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from fusion.data.hdf5 import DataError, GptHDF5MapDataProcessor, as_list, write_npz_atomic
from fusion.data.jsonl import JsonlFile, JsonlLine, ResumableWriter, find_files, output_path, parse_file
from fusion.model_info import MultiModelFusion
from fusion.progress import Progress
from routing.client import AsyncClient, RouterError

HDF5, JSONL = "GptHDF5MapDataProcessor", "JsonlCompletions"
PROCESSORS = (HDF5, JSONL)
TRANSIENT = {"busy", "worker_lost", "router_lost"}  # worth sending again; other errors are the request's fault


class Transient(RuntimeError):
    """A request that kept failing for reasons outside it (overload, lost worker, timeout)."""


async def complete(client: AsyncClient, model, prompt, retry_delays: tuple[float, ...], **params) -> dict:
    """client.complete, sent again after a transient failure: greedy and seeded requests give the
    same tokens on any copy, so a resend is safe."""
    for attempt in range(len(retry_delays) + 1):
        try:
            return await client.complete(model, prompt, **params)
        except RouterError as exc:
            if exc.code not in TRANSIENT:
                raise
            last: Exception = exc
        except TimeoutError as exc:
            last = exc
        if attempt < len(retry_delays):
            await asyncio.sleep(retry_delays[attempt])
    raise Transient(f"{last} (after {len(retry_delays) + 1} attempts)")


def variant_groups(fusion: MultiModelFusion) -> dict[str, list[int]]:
    """Variant name -> its model IDs, in --variants order."""
    groups: dict[str, list[int]] = {}
    for mid, info in enumerate(fusion.models):
        groups.setdefault(info.name, []).append(mid)
    return groups


def processor_name(fusion: MultiModelFusion, name: str) -> str:
    info = fusion.models[variant_groups(fusion)[name][0]]
    proc = (info.params.get("inference_input") or {}).get("data_processor")
    if proc not in PROCESSORS:
        raise DataError(f"variant {name!r}: inference_input.data_processor must be one of {', '.join(PROCESSORS)}, "
                        f"got {proc!r}")
    return proc


def hdf5_processor(fusion: MultiModelFusion, name: str, inference_steps: int | None) -> GptHDF5MapDataProcessor:
    p = fusion.models[variant_groups(fusion)[name][0]].params
    inp = p.get("inference_input") or {}
    if "start_token" not in p:
        raise DataError(f"variant {name!r}: model.start_token is required for {HDF5}")
    return GptHDF5MapDataProcessor(inp.get("data_dir", ""), inp.get("batch_size", 1), p["start_token"],
                                   p.get("loop_dim", 1), inference_steps)


def jsonl_files(fusion: MultiModelFusion) -> list[JsonlFile]:
    """Every input file of the JSONL variants, parsed. A file in the data_dir of several variants is
    read once; its lines without `model` go to the first of them."""
    groups = variant_groups(fusion)
    names = set(groups)
    sources: dict[str, str] = {}
    for name, mids in groups.items():
        src = fusion.models[mids[0]].source
        sources[src] = name if src not in sources else None  # a source shared by two variants is ambiguous
    sources = {k: v for k, v in sources.items() if v is not None}
    files: dict[Path, JsonlFile] = {}
    stems: dict[str, Path] = {}
    for name, mids in groups.items():
        if processor_name(fusion, name) != JSONL:
            continue
        data_dir = (fusion.models[mids[0]].params.get("inference_input") or {}).get("data_dir", "")
        for path in find_files(data_dir):
            key = path.resolve()
            if key in files:
                continue
            if path.stem in stems:
                raise DataError(f"{path} and {stems[path.stem]} would both write output_{path.stem}.jsonl; "
                                "rename one of them")
            stems[path.stem] = path
            files[key] = parse_file(path, name, names, sources)
    return list(files.values())


# --- HDF5 -------------------------------------------------------------------------------------------

@dataclass(slots=True)
class HDF5Job:
    name: str
    model_ids: list[int]
    processor: GptHDF5MapDataProcessor
    params: dict  # the variant's model section
    out_dir: Path
    retry_delays: tuple[float, ...] = ()
    failed: int = 0

    @property
    def output(self) -> Path:
        return self.out_dir

    def totals(self) -> Counter:
        return Counter({self.name: sum(p is not None for b in self.processor.batches() for p in b.prompts)})

    async def _batch(self, client: AsyncClient, batch, progress: Progress) -> None:
        real = sum(p is not None for p in batch.prompts)
        path = self.out_dir / f"predictions_{batch.number}.npz"
        if path.exists():
            progress.advance(self.name, skipped=real)
            return
        p = self.params
        mid = self.model_ids[(batch.number - 1) % len(self.model_ids)]
        end = [t for t in as_list(p["end_token"], "end_token") if t >= 0] if p.get("end_token") is not None else []

        async def one(prompt):
            if prompt is None:
                return None
            n = self.processor.max_new_tokens(prompt, p.get("max_tokens"))
            if n <= 0:
                return []
            r = await complete(client, mid, prompt, self.retry_delays, max_tokens=n, temperature=p.get("temperature", 0.0),
                                      top_p=p.get("top_p", 1.0), top_k=p.get("top_k", 0), seed=p.get("seed"),
                                      stop_token_ids=end, ignore_eos=True, return_token_ids=True)
            return r["choices"][0]["token_ids"]

        progress.start(self.name)
        try:
            generated = await asyncio.gather(*[one(pr) for pr in batch.prompts])
        except (RouterError, Transient) as exc:
            self.failed += 1
            print(f"error: {self.name} batch {batch.number} ({self.processor.path}) failed: {exc}; "
                  "rerun predict to retry it", file=sys.stderr, flush=True)
            return
        write_npz_atomic(path, batch.number, self.processor.predictions(batch, generated))
        progress.advance(self.name, samples=real, tokens=sum(len(g) for g in generated if g))

    async def run(self, client: AsyncClient, progress: Progress) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        gate = asyncio.Semaphore(len(self.model_ids))  # one batch in flight per copy

        async def guarded(batch):
            async with gate:
                await self._batch(client, batch, progress)

        await asyncio.gather(*[guarded(b) for b in self.processor.batches()])


# --- JSONL ------------------------------------------------------------------------------------------

def _request_params(req: dict) -> dict:
    return {k: v for k, v in req.items() if k not in ("prompt", "model", "engine")}


def _error(line: JsonlLine, code: str, message: str) -> dict:
    return {"request": line.request, "error": {"code": code, "message": message}}


@dataclass(slots=True)
class JsonlJob:
    file: JsonlFile
    out: Path
    batch_size: int
    in_flight: int  # batches sent at once
    retry_delays: tuple[float, ...] = ()
    failed: int = 0  # lines left unwritten after transient failures: a rerun retries them

    @property
    def output(self) -> Path:
        return self.out

    def _owner(self, line: JsonlLine) -> str:
        return line.variant or self.file.default_variant

    def totals(self) -> Counter:
        return Counter(self._owner(ln) for ln in self.file.lines)

    async def _line(self, client: AsyncClient, line: JsonlLine, progress: Progress) -> tuple[dict | None, int]:
        """(output record, tokens generated); record None after a transient failure."""
        if line.error is not None:
            return _error(line, "bad_request", line.error), 0
        progress.start(line.variant)
        where = f"{self.file.path.name} line {line.number}"
        try:
            resp = await complete(client, line.variant, line.request["prompt"], self.retry_delays,
                                  **_request_params(line.request))
        except RouterError as exc:
            return _error(line, exc.code, f"{where}: {exc}"), 0
        except Transient as exc:
            print(f"error: {self.file.path} line {line.number} failed: {exc}; rerun predict to retry it",
                  file=sys.stderr, flush=True)
            return None, 0
        return {"request": line.request, "result": resp}, resp["usage"]["completion_tokens"]

    async def run(self, client: AsyncClient, progress: Progress) -> None:
        writer = ResumableWriter(self.out)
        lines = self.file.lines
        for ln in lines[: writer.done]:
            progress.advance(self._owner(ln), skipped=1)
        todo = list(enumerate(lines))[writer.done:]
        batches = [todo[i: i + self.batch_size] for i in range(0, len(todo), self.batch_size)]
        ready: dict[int, dict] = {}
        next_out = writer.done
        gate = asyncio.Semaphore(self.in_flight)

        async def run_batch(batch: list[tuple[int, JsonlLine]]) -> None:
            nonlocal next_out
            async with gate:
                t0 = time.perf_counter()
                results = await asyncio.gather(*[self._line(client, ln, progress) for _, ln in batch])
                took = round(time.perf_counter() - t0, 6)
            for (pos, ln), (record, tokens) in zip(batch, results):
                if record is None:
                    self.failed += 1
                    progress.advance(self._owner(ln), errors=1)
                    continue  # never written: the lines after it wait for a rerun too (input order)
                if "result" in record:
                    record["result"]["request_time"] = {"batch_time": took, "batch_size": len(batch)}
                    progress.advance(ln.variant, samples=1, tokens=tokens)
                else:
                    progress.advance(self._owner(ln), errors=1)
                ready[pos] = record
            while next_out in ready:  # input order: write only once every earlier line is written
                writer.write(ready.pop(next_out))
                next_out += 1
            writer.flush()

        try:
            await asyncio.gather(*[run_batch(b) for b in batches])
        finally:
            writer.close()
        if not self.failed:
            writer.finish()


def build_jobs(fusion: MultiModelFusion, model_dir: str | Path, inference_steps: int | None,
               retry_delays: tuple[float, ...] = (0.5, 2.0, 8.0)) -> list:
    """Every predict job; reads and checks all input data, loads nothing."""
    groups = variant_groups(fusion)
    pred_dir = Path(model_dir) / "predictions"
    jobs: list = []
    for name, mids in groups.items():
        if processor_name(fusion, name) == HDF5:
            jobs.append(HDF5Job(name, mids, hdf5_processor(fusion, name, inference_steps),
                                fusion.models[mids[0]].params, pred_dir / name, retry_delays))
    for f in jsonl_files(fusion):
        inp = fusion.models[groups[f.default_variant][0]].params.get("inference_input") or {}
        bs = inp.get("batch_size", 8)
        if isinstance(bs, bool) or not isinstance(bs, int) or bs < 1:
            raise DataError(f"variant {f.default_variant!r}: inference_input.batch_size must be a positive "
                            f"integer, got {bs!r}")
        jobs.append(JsonlJob(f, output_path(pred_dir, f.path), bs, in_flight=len(fusion.models),
                             retry_delays=retry_delays))
    return jobs


def run_jobs(frontend: str, jobs: list, progress: Progress, timeout: float = 3600,
             client_kw: dict | None = None) -> list[str]:
    """Run jobs (each with `async run(client, progress)`) concurrently over one connection to the
    router; returns the per-model summary lines."""
    async def go():
        async with AsyncClient(frontend, timeout=timeout, **(client_kw or {})) as client:
            await asyncio.gather(*[j.run(client, progress) for j in jobs])

    try:
        asyncio.run(go())
    finally:
        summary = progress.close()
    return summary


def run_predict(frontend: str, jobs: list, timeout: float = 3600, stream=None,
                bars: bool | None = None, client_kw: dict | None = None) -> tuple[list, list[str]]:
    """Run the jobs against a router; returns (jobs, per-model summary lines)."""
    totals: Counter = Counter()
    for j in jobs:
        totals.update(j.totals())
    progress = Progress(dict(totals), stream=stream, bars=bars)
    return jobs, run_jobs(frontend, jobs, progress, timeout, client_kw)

"""run_mm.py --mode predict: the variants' input data through the router, outputs on disk.

Jobs are built (and every input file checked) before any model loads:
- GptHDF5MapDataProcessor: one job per variant. Batch X goes to copy (X-1) mod count, one batch
  in flight per copy. Each finished row is logged (fsynced) beside the outputs at once, so a row
  that fails never costs the batch's finished rows; the batch's .npz is written atomically when
  all its rows are done, and its row log removed.
- JsonlCompletions: one job per input file. Lines go to the variant their `model`/`engine` field
  names; output lines are written in input order as they finish (see fusion.data.jsonl). A line
  whose request kept failing for a transient reason gets an error record marked `retry` and the
  lines after it go on; a rerun serves the marked lines again.
A rerun skips batches, rows and lines already done, so an interrupted run resumes where it stopped.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from fusion.data.files import DataError, RecordLog
from fusion.data.hdf5 import GptHDF5MapDataProcessor, as_list, write_npz_atomic
from fusion.data.jsonl import RETRY, JsonlFile, JsonlLine, ResumableWriter, output_path
from fusion.inputs import hdf5_processor, jsonl_files
from fusion.jobs import HDF5, Transient, complete, job_totals, processor_name, run_jobs, variant_groups
from fusion.model_info import MultiModelFusion
from fusion.params import RUNCONFIG_DEFAULTS, input_value
from fusion.progress import Progress
from routing.client import AsyncClient, RouterError
from workers.spec import ModelSpec

# --- HDF5 -------------------------------------------------------------------------------------------


@dataclass(slots=True)
class HDF5Job:
    name: str
    model_ids: list[int]
    processor: GptHDF5MapDataProcessor
    spec: ModelSpec  # the variant's model settings
    out_dir: Path
    retry_delays: tuple[float, ...] = ()
    failed: int = 0  # batches left incomplete for a transient reason: a rerun finishes them
    refused: int = 0  # rows a model refused (their data): their batches wait for the data to be fixed

    @property
    def output(self) -> Path:
        return self.out_dir

    def totals(self) -> Counter:
        return Counter({self.name: sum(p is not None for b in self.processor.batches() for p in b.prompts)})

    async def _row(self, client: AsyncClient, mid: int, prompt: list[int]) -> list[int]:
        p = self.spec
        end_token = list(p.end_token) if isinstance(p.end_token, tuple) else p.end_token
        end = [t for t in as_list(end_token, "end_token") if t >= 0] if end_token is not None else []
        n = self.processor.max_new_tokens(prompt, p.max_tokens)
        if n <= 0:
            return []
        # HDF5 rows are greedy unless the variant sets a temperature; unset filters stay off
        sampling = {k: getattr(p, k) for k in ("temperature", "top_p", "top_k")}
        sampling = {"temperature": 0.0, **{k: v for k, v in sampling.items() if v is not None}}
        r = await complete(client, mid, prompt, self.retry_delays, max_tokens=n, **sampling,
                           stop_token_ids=end, ignore_eos=True, return_token_ids=True)
        return r["choices"][0]["token_ids"]

    async def _batch(self, client: AsyncClient, batch, progress: Progress) -> None:
        real = sum(p is not None for p in batch.prompts)
        path = self.out_dir / f"predictions_{batch.number}.npz"
        if path.exists():
            progress.advance(self.name, skipped=real)
            return
        mid = self.model_ids[(batch.number - 1) % len(self.model_ids)]
        rows = RecordLog(self.out_dir / f".predictions_{batch.number}.rows.jsonl")
        done = {r["row"]: r["tokens"] for r in rows.records}
        progress.start(self.name)
        if done:
            progress.advance(self.name, skipped=len(done))

        async def one(r: int, prompt):
            if prompt is None or r in done:
                return
            tokens = await self._row(client, mid, prompt)
            rows.append({"row": r, "tokens": tokens})
            done[r] = tokens
            progress.advance(self.name, samples=1, tokens=len(tokens))

        results = await asyncio.gather(*[one(r, pr) for r, pr in enumerate(batch.prompts)], return_exceptions=True)
        rows.close()
        errors = {r: e for r, e in zip(batch.sample_indices, results) if isinstance(e, BaseException)}
        for e in errors.values():
            if not isinstance(e, (RouterError, Transient)):
                raise e
        if errors:
            progress.advance(self.name, errors=len(errors))
            # a RouterError reaching here is the row's own (a transient one is a Transient): a rerun
            # would send the same row again, so say which row, and that its data must change
            refused = {r: e for r, e in errors.items() if not isinstance(e, Transient)}
            where = f"{self.name} batch {batch.number} ({self.processor.path})"
            for r, e in refused.items():
                print(f"error: {where}: row {r} refused ({e}); its batch is written once the row is fixed in "
                      "the file", file=sys.stderr, flush=True)
            if len(refused) < len(errors):
                first = next(e for e in errors.values() if isinstance(e, Transient))
                print(f"error: {where}: {len(errors) - len(refused)} rows failed ({first}); rerun predict to "
                      "finish them", file=sys.stderr, flush=True)
            print(f"{where}: its {len(done)} finished rows are kept", file=sys.stderr, flush=True)
            self.refused += len(refused)
            self.failed += len(refused) < len(errors)
            return
        generated = [done.get(r) if pr is not None else None for r, pr in enumerate(batch.prompts)]
        write_npz_atomic(path, batch.number, self.processor.predictions(batch, generated))
        rows.remove()

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


def _error(line: JsonlLine, code: str, message: str, retry: bool = False) -> dict:
    err = {"code": code, "message": message}
    if retry:
        err[RETRY] = True
    return {"request": line.request, "error": err}


@dataclass(slots=True)
class JsonlJob:
    file: JsonlFile
    out: Path
    batch_size: int
    in_flight: int  # batches sent at once
    retry_delays: tuple[float, ...] = ()
    failed: int = 0  # lines whose transient failure is recorded for a rerun to retry

    @property
    def output(self) -> Path:
        return self.out

    def _owner(self, line: JsonlLine) -> str:
        return line.variant or self.file.default_variant

    def totals(self) -> Counter:
        return Counter(self._owner(ln) for ln in self.file.lines)

    async def _line(self, client: AsyncClient, line: JsonlLine, progress: Progress) -> tuple[dict, int]:
        """(output record, tokens generated)."""
        if line.error is not None:
            return _error(line, "bad_request", line.error), 0
        progress.start(line.variant)
        where = f"{self.file.path.name} line {line.number}"
        try:
            resp = await complete(client, line.variant, line.body["prompt"], self.retry_delays,
                                  **_request_params(line.body))
        except RouterError as exc:
            return _error(line, exc.code, f"{where}: {exc}"), 0
        except Transient as exc:
            print(f"error: {self.file.path} line {line.number} failed: {exc}; rerun predict to retry it",
                  file=sys.stderr, flush=True)
            return _error(line, exc.code, f"{where}: {exc}", retry=True), 0
        # the router's timing stays out of the record: a rerun (or a resumed run) writes the same file
        resp["usage"].pop("timing", None)
        return {"request": line.request, "result": resp}, resp["usage"]["completion_tokens"]

    async def run(self, client: AsyncClient, progress: Progress) -> None:
        writer = ResumableWriter(self.out)
        lines = self.file.lines
        retry = set(writer.retry)
        for pos, ln in enumerate(lines[: writer.done]):
            if pos not in retry:
                progress.advance(self._owner(ln), skipped=1)
        todo = [(pos, lines[pos]) for pos in writer.retry if pos < len(lines)] + list(enumerate(lines))[writer.done:]
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
                if "result" in record:
                    record["result"]["request_time"] = {"batch_time": took, "batch_size": len(batch)}
                    progress.advance(ln.variant, samples=1, tokens=tokens)
                else:
                    self.failed += bool(record["error"].get(RETRY))
                    progress.advance(self._owner(ln), errors=1)
                if pos in retry:
                    writer.replace(pos, record)
                else:
                    ready[pos] = record
            while next_out in ready:  # input order: write only once every earlier line is written
                writer.write(ready.pop(next_out))
                next_out += 1
            writer.flush()

        try:
            await asyncio.gather(*[run_batch(b) for b in batches])
        finally:
            writer.close()
        writer.finish()


def build_jobs(fusion: MultiModelFusion, model_dir: str | Path, inference_steps: int | None,
               retry_delays: tuple[float, ...] = tuple(RUNCONFIG_DEFAULTS["retry_delays"])) -> list:
    """Every predict job; reads and checks all input data, loads nothing."""
    groups = variant_groups(fusion)
    pred_dir = Path(model_dir) / "predictions"
    jobs: list = []
    for name, mids in groups.items():
        if processor_name(fusion, name) == HDF5:
            jobs.append(HDF5Job(name, mids, hdf5_processor(fusion, name, inference_steps),
                                fusion.models[mids[0]].spec, pred_dir / name, retry_delays))
    for f in jsonl_files(fusion):
        bs = input_value(fusion.models[groups[f.default_variant][0]].inference_input, "batch_size")
        if isinstance(bs, bool) or not isinstance(bs, int) or bs < 1:
            raise DataError(f"variant {f.default_variant!r}: inference_input.batch_size must be a positive "
                            f"integer, got {bs!r}")
        jobs.append(JsonlJob(f, output_path(pred_dir, f.path), bs, in_flight=len(fusion.models),
                             retry_delays=retry_delays))
    return jobs


def run_predict(frontend: str, jobs: list, timeout: float = 3600, stream=None,
                bars: bool | None = None, client_kw: dict | None = None) -> tuple[list, list[str]]:
    """Run the jobs against a router; returns (jobs, per-model summary lines)."""
    progress = Progress(job_totals(jobs), stream=stream, bars=bars)
    return jobs, run_jobs(frontend, jobs, progress, timeout, client_kw)

"""Each variant's input data, read and checked before any model loads (errors name file and row/line)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from fusion.data.files import DataError
from fusion.data.hdf5 import GptHDF5MapDataProcessor
from fusion.data.jsonl import JsonlFile, find_files, parse_file
from fusion.jobs import HDF5, JSONL, processor_name, variant_groups, variant_info
from fusion.model_info import MultiModelFusion
from fusion.params import input_value


def hdf5_processor(fusion: MultiModelFusion, name: str, inference_steps: int | None) -> GptHDF5MapDataProcessor:
    info = variant_info(fusion, name)
    inp, spec = info.inference_input, info.spec
    if spec.start_token is None:
        raise DataError(f"variant {name!r}: model.start_token is required for {HDF5}")
    start = list(spec.start_token) if isinstance(spec.start_token, tuple) else spec.start_token
    return GptHDF5MapDataProcessor(input_value(inp, "data_dir") or "", input_value(inp, "batch_size"),
                                   start, spec.loop_dim, inference_steps)


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
    for name in groups:
        if processor_name(fusion, name) != JSONL:
            continue
        data_dir = input_value(variant_info(fusion, name).inference_input, "data_dir") or ""
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


@dataclass(slots=True)
class Sample:
    where: str  # "prompts.h5 row 3", "requests.jsonl line 7"
    prompt: str | list[int] | None
    error: str | None = None


def variant_samples(fusion: MultiModelFusion, name: str, inference_steps: int | None) -> list[Sample]:
    """Every prompt of the variant's own input (whatever a JSONL line's `model` says), in order."""
    if processor_name(fusion, name) == HDF5:
        proc = hdf5_processor(fusion, name, inference_steps)
        return [Sample(f"{proc.path.name} row {i}", p) for b in proc.batches()
                for i, p in zip(b.sample_indices, b.prompts) if p is not None]
    data_dir = variant_info(fusion, name).inference_input.get("data_dir", "")
    out = []
    for path in find_files(data_dir):
        for ln in parse_file(path, name, {name}, {}, routed=False).lines:
            where = f"{path.name} line {ln.number}"
            out.append(Sample(where, ln.body["prompt"]) if ln.error is None else Sample(where, None, ln.error))
    if not out:
        raise DataError(f"variant {name!r}: no samples to score in {data_dir}")
    return out

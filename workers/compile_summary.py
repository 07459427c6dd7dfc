"""One phrase for logs from a compile report (workers.engine.compiled.CompileInfo.as_dict, as workers
and compile_only report it); apart from the engine, so that a command line can print it without
importing torch's compiler."""

from __future__ import annotations


def summary(info: dict | None) -> str:
    if not info or not info.get("compiled"):
        return f"eager ({info['reason']})" if info else "eager"
    how = "loaded from" if info.get("warm") else "compiled and saved to"
    return f"forward {how} {info['cache']} in {info['seconds']:.1f}s (token buckets {info['buckets']})"

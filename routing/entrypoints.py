"""The project's processes, each named once: what a subprocess of the project runs.

routing is the package every other one imports, so the names live here; `command` builds the
argument list that starts one with this interpreter.
"""

from __future__ import annotations

import sys

CLI = "fusion.cli"  # run_mm.py, the `mmfusion` console script
WORKER = "workers.worker"
WEIGHT_OWNER = "workers.weights.owner"
GATEWAY = "routing.http"
ROUTER = "routing.router"
KEYS = "wire.security"
CLIENT = "routing.client"
PREPARE = "fusion.data.prepare"  # text prompts to an HDF5 input file
DEMO = "fusion.demo"


def command(module: str, *args: str) -> list[str]:
    """The argv that runs `module`'s command line with this interpreter."""
    return [sys.executable, "-m", module, *args]

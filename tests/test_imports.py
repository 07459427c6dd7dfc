"""The project's imports run one way: no cycle between its modules (imports inside functions
count too), and no private name taken from another module."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("wire", "workers", "routing", "fusion")


def modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imports(path: Path, known: dict[str, Path]) -> list[tuple[str, list[str]]]:
    """(imported project module, names taken from it) for every import in the file."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(a.name, []) for a in node.names if a.name in known]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                if sub in known:  # `from workers import tiny`: the submodule itself
                    out.append((sub, []))
                elif node.module in known:
                    out.append((node.module, [a.name]))
    return out


def test_no_import_cycle():
    known = modules()
    graph = {m: set() for m in known}
    for m, path in known.items():
        for dep, _ in imports(path, known):
            # importing a.b.c runs a/__init__ and a/b/__init__ first: those are imported too
            parts = dep.split(".")
            graph[m] |= {".".join(parts[:i]) for i in range(1, len(parts) + 1)} & known.keys()
        graph[m].discard(m)
        graph[m] -= {pkg for pkg in graph[m] if m.startswith(pkg + ".")}  # a module's own packages are loaded already
    cycles, state = [], {}

    def visit(m: str, stack: list[str]) -> None:
        state[m] = "open"
        for dep in sorted(graph[m]):
            if state.get(dep) == "open":
                cycles.append(stack[stack.index(dep):] + [dep] if dep in stack else [m, dep])
            elif dep not in state:
                visit(dep, [*stack, dep])
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_no_private_name_imported_across_modules():
    known = modules()
    bad = [f"{known_path.relative_to(ROOT)}: {name} from {mod}"
           for m, known_path in known.items() for mod, names in imports(known_path, known)
           for name in names if name.startswith("_") and mod != m]
    assert not bad, bad


def test_the_command_line_gateway_and_clients_start_without_torch():
    """run_mm's command line, the HTTP gateway and the clients import neither torch nor transformers
    (seconds of CPU at every start, and more at exit): the workers' fork server imports those. The
    modules predict and eval run on (the plan read back, the local deployment, the jobs) do not
    either: their plan is made in a process forked from that server (fusion.launcher.call_in_server)."""
    import subprocess
    import sys

    probe = ("import sys, fusion.cli, routing.http.server, routing.client, routing.openai_objects, "
             "routing.openai_requests, fusion.plan, fusion.local, fusion.predict, fusion.evaluate; "
             "print(sorted({'torch', 'transformers'} & set(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr


def _package_edges() -> list[tuple[str, str]]:
    known = modules()
    return [(m, dep) for m, path in known.items() for dep, _ in imports(path, known)]


def test_workers_import_nothing_of_routing_and_the_wire_nothing_of_either():
    edges = _package_edges()
    taken = sorted({f"{m} -> {dep}" for m, dep in edges if m.startswith("workers") and dep.split(".")[0] == "routing"})
    assert not taken, taken
    wire_deps = sorted({f"{m} -> {dep}" for m, dep in edges
                        if m.split(".")[0] == "wire" and dep.split(".")[0] in ("workers", "routing", "fusion")})
    assert not wire_deps, wire_deps
    assert any(m.startswith("workers") and dep.startswith("wire") for m, dep in edges)  # the worker speaks the wire
    # the rest of routing/ may use workers/ (the specs it assigns, the checks it shares); never the reverse
    both = {(m, dep) for m, dep in edges if m.split(".")[0] != dep.split(".")[0]
            and (dep, m) in set(edges)}
    assert not both, sorted(both)


def _reached(start: str, edges: list[tuple[str, str]]) -> set[str]:
    graph: dict[str, set[str]] = {}
    for m, dep in edges:
        parts = dep.split(".")
        graph.setdefault(m, set()).update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    seen, todo = set(), [start]
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo.extend(graph.get(m, ()))
    return seen


CPU_ROOM, CUDA_ROOM = "workers.engine.cpu", "workers.engine.cuda"


def test_a_device_room_imports_nothing_of_another():
    """What runs on one device never imports the other's modules, at any depth: the CPU's runner
    reaches no CUDA module and the CUDA runner no CPU module; the shared engine imports neither (the
    runners are found by name, workers.engine.runners.ROOMS)."""
    edges = _package_edges()
    known = modules()
    for room, other in ((CPU_ROOM, CUDA_ROOM), (CUDA_ROOM, CPU_ROOM)):
        for m in [m for m in known if m.startswith(room)]:
            crossed = sorted(r for r in _reached(m, edges) if r.startswith(other))
            assert not crossed, f"{m} reaches {crossed}"
    for m in ("workers.engine.engine", "workers.engine.runners", "workers.worker", "workers.platform"):
        assert not {r for r in _reached(m, edges) if r.startswith((CPU_ROOM, CUDA_ROOM))}, m


def test_an_engine_on_the_cpu_loads_no_cuda_module():
    """At run time as well: a CPU engine serving a request has imported no module of the CUDA room."""
    import subprocess
    import sys

    probe = ("import sys\nfrom workers.models import load_model\nfrom workers.engine import Engine, EngineConfig\n"
             "from workers.engine.params import SamplingParams\n"
             "eng = Engine(load_model('tiny:llama', dtype='float32'), EngineConfig(max_batch_size=2))\n"
             "eng.generate([[1, 2, 3]], SamplingParams(max_tokens=2))\n"
             "print(sorted(m for m in sys.modules if m.startswith('workers.engine.')))")
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    loaded = ast.literal_eval(out.stdout.strip().splitlines()[-1])
    assert any(m.startswith(CPU_ROOM) for m in loaded), loaded
    assert not [m for m in loaded if m.startswith(CUDA_ROOM)], loaded

"""runconfig.gpu_sharing: the decision for a plan, and the deployment's own MPS daemon, run here
with a stand-in for NVIDIA's control program (the real one needs a GPU) that starts a process as
its daemon and stops it on `quit`."""

from __future__ import annotations

import os
import stat
import subprocess
import tempfile
from pathlib import Path

import psutil
import pytest
import yaml
from support.cluster import wait_for

from fusion.deploy import build_fusion
from fusion.gpu_sharing import MPS_CONTROL, MpsDaemon, decide
from fusion.local import LocalDeployment
from fusion.params import load_params
from fusion.plan import make_plan
from routing.client import Client
from routing.entrypoints import CLI, command

ROOT = Path(__file__).resolve().parents[1]
# -d: a "daemon" (a sleep, its pid in the pipe directory), nothing held of the caller's pipes; on
# stdin, `quit`: that process stopped
STAND_IN = """#!/bin/sh
if [ "$1" = "-d" ]; then
  [ -d "$CUDA_MPS_PIPE_DIRECTORY" ] && [ -d "$CUDA_MPS_LOG_DIRECTORY" ] || { echo "no pipe directory" >&2; exit 3; }
  sleep 600 </dev/null >/dev/null 2>&1 &
  echo $! > "$CUDA_MPS_PIPE_DIRECTORY/daemon.pid"
  exit 0
fi
read cmd
[ "$cmd" = quit ] && kill "$(cat "$CUDA_MPS_PIPE_DIRECTORY/daemon.pid")"
"""


def _program(tmp_path: Path, text: str = STAND_IN) -> Path:
    path = tmp_path / "bin" / MPS_CONTROL
    path.parent.mkdir(exist_ok=True)
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path


def _params(tmp_path: Path, **run) -> dict:
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump({"variants": {"llama": {"model": {"source": "tiny:llama", "dtype": "float32",
                                                                     "max_batch_size": 4, "max_batch_tokens": 64}}},
                                    "runconfig": {"threads_per_worker": 1, "frontend": "tcp://127.0.0.1:*",
                                                  "backend": "tcp://127.0.0.1:*", **run}}))
    return load_params(path)


def _mps_dirs() -> set[str]:
    return {p.name for p in Path(tempfile.gettempdir()).glob("mmfusion-mps-*")}


@pytest.fixture()
def own_tmp(tmp_path, monkeypatch) -> Path:
    """The daemons of this process make their directories in a temporary directory of the test's own:
    in the shared one, a test that checks that its deployment leaves nothing there (tests/test_ray.py)
    found them, when it ran at the same time."""
    root = tmp_path / "tmp"
    root.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(root))
    return root


def test_the_setting_comes_to_mps_only_where_a_gpu_is_shared_and_the_control_program_is_there(tmp_path):
    params = _params(tmp_path)
    fusion = build_fusion(params, ["llama,2"])
    on_cpu, on_gpu = make_plan(fusion, None, "cpu", 1), make_plan(fusion, None, "cuda:0", 1)
    one_gpu = make_plan(build_fusion(params, ["llama,1"]), None, "cuda:0", 1)
    control = str(_program(tmp_path))
    assert decide("timeslice", on_gpu, control).mode == "timeslice"
    assert decide("auto", on_cpu, control).describe() == "gpu sharing: timeslice (no GPU has two or more workers)"
    assert decide("auto", one_gpu, control).mode == "timeslice"
    assert decide("auto", on_gpu, control).describe() == "gpu sharing: mps (cuda:0 shared by several workers)"
    assert decide("mps", one_gpu, control).mode == "mps"
    with pytest.raises(ValueError, match="no worker of this deployment runs on one"):
        decide("mps", on_cpu, control)
    if not any((Path(d) / MPS_CONTROL).exists() for d in os.environ.get("PATH", "").split(os.pathsep) if d):
        assert "not on PATH" in decide("auto", on_gpu).why
        with pytest.raises(ValueError, match=f"mps needs NVIDIA's {MPS_CONTROL} on PATH"):
            decide("mps", on_gpu)
    with pytest.raises(ValueError, match="must be one of auto, mps, timeslice"):
        decide("shared", on_gpu, control)
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"variants": {"x": {"model": {"source": "tiny:llama"}}},
                                   "runconfig": {"gpu_sharing": "always"}}))
    with pytest.raises(ValueError, match="runconfig.gpu_sharing must be"):
        load_params(bad)


def test_the_daemon_gets_private_directories_and_leaves_nothing(tmp_path, own_tmp):
    before = _mps_dirs()
    daemon = MpsDaemon(str(_program(tmp_path)))
    daemon.start()
    env = daemon.env()
    pid = int((Path(env["CUDA_MPS_PIPE_DIRECTORY"]) / "daemon.pid").read_text())
    assert psutil.pid_exists(pid) and Path(env["CUDA_MPS_LOG_DIRECTORY"]).is_dir()
    assert oct(Path(env["CUDA_MPS_PIPE_DIRECTORY"]).parent.stat().st_mode & 0o777) == "0o700"  # ours alone
    assert Path(env["CUDA_MPS_PIPE_DIRECTORY"]).is_relative_to(own_tmp)
    daemon.stop()
    wait_for(lambda: not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE, 10)
    assert daemon.env() == {} and _mps_dirs() == before
    # a control program that fails is refused by name, and leaves nothing either
    failing = MpsDaemon(str(_program(tmp_path, "#!/bin/sh\necho 'no device supports MPS' >&2\nexit 1\n")))
    with pytest.raises(RuntimeError, match="-d failed \\(exit code 1\\): no device supports MPS"):
        failing.start()
    assert _mps_dirs() == before


def test_a_deployment_with_mps_starts_its_daemon_shows_it_and_stops_it(tmp_path, monkeypatch, own_tmp):
    """The CPU workers do not use it, but the deployment's part is the same: the daemon before the
    workers, `status` says so, and nothing of it after the exit."""
    before = _mps_dirs()
    monkeypatch.setenv("PATH", f"{_program(tmp_path).parent}{os.pathsep}{os.environ['PATH']}")
    params = _params(tmp_path)
    fusion = build_fusion(params, ["llama,1"])
    plan = make_plan(fusion, None, "cpu", 1)
    dep = LocalDeployment.from_runconfig(fusion, plan, params["runconfig"])
    assert dep.sharing.mode == "timeslice"  # auto, on the CPU
    dep = LocalDeployment(fusion, plan, "tcp://127.0.0.1:*", "tcp://127.0.0.1:*",
                          sharing=decide("mps", make_plan(fusion, None, "cuda:0", 1)))
    with dep:
        pid = int((Path(dep.mps.env()["CUDA_MPS_PIPE_DIRECTORY"]) / "daemon.pid").read_text())
        dep.wait_loaded(timeout=120)
        with Client(dep.frontend, timeout=60) as c:
            assert c.status()["gpu_sharing"] == "mps"
            assert c.complete(model="llama", prompt=[1, 2, 3], max_tokens=2)["choices"]
    wait_for(lambda: not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE, 10)
    assert _mps_dirs() == before


def test_validate_only_says_how_and_mps_where_it_cannot_be_is_refused(tmp_path):
    path = tmp_path / "v.yaml"
    run = {"threads_per_worker": 1, "devices": "cpu"}
    path.write_text(yaml.safe_dump({"variants": {"llama": {"model": {"source": "tiny:llama"}}}, "runconfig": run}))
    out = subprocess.run([*command(CLI), "--mode", "validate_only", "--params", str(path), "--variants", "llama,2"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "gpu sharing: timeslice (no GPU has two or more workers)" in out.stdout, out.stderr
    path.write_text(yaml.safe_dump({"variants": {"llama": {"model": {"source": "tiny:llama"}}},
                                    "runconfig": {**run, "gpu_sharing": "mps"}}))
    out = subprocess.run([*command(CLI), "--mode", "serve", "--params", str(path), "--variants", "llama,1"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "runconfig.gpu_sharing: mps shares a CUDA GPU between processes" in out.stderr

"""The `rnnserve` command (rnnserve_cli.py): argv in, exit code out, heavy imports only to run."""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from rnnserve_cli import SUBCOMMANDS, main

REPO = Path(__file__).resolve().parents[1]
HAS_RAY = importlib.util.find_spec("ray") is not None
NO_RAY = "Ray Serve is not installed: pip install -e '.[ray]' (.ci/run installs it)"

# Prints, per subcommand, whether its help came out and which heavy modules were imported by then.
HELP_PROBE = """
import contextlib, io, json, sys
from rnnserve_cli import SUBCOMMANDS, main
found = {}
for name in SUBCOMMANDS:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            main([name, "--help"])
        except SystemExit as exc:
            code = exc.code
    found[name] = {"code": code, "usage": out.getvalue().startswith(f"usage: rnnserve {name}"),
                   "imported": sorted(m for m in ("torch", "fastapi", "uvicorn", "matplotlib") if m in sys.modules)}
print(json.dumps(found))
"""


def test_help_of_every_subcommand_answers_without_importing_torch():
    done = subprocess.run([sys.executable, "-c", HELP_PROBE], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout)
    assert (
        set(found)
        == set(SUBCOMMANDS)
        == {
            "serve",
            "build-kernels",
            "ray-status",
            "train",
            "import",
            "linearize",
            "eval",
            "bench",
            "pictures",
            "curves",
            "train-classifier",
        }
    )
    for name, result in found.items():
        assert result == {"code": 0, "usage": True, "imported": []}, name


def test_main_runs_the_argv_it_is_given_and_leaves_sys_argv_alone(tmp_path, capsys):
    before = list(sys.argv)
    missing = tmp_path / "missing.safetensors"
    assert main(["eval", str(missing), "--data", str(tmp_path), "--device", "cpu", "--no-progress"]) == 2
    assert sys.argv == before
    assert f"rnnserve eval: error: {missing}" in capsys.readouterr().err


def test_python_m_server_is_the_same_command():
    done = subprocess.run(
        [sys.executable, "-m", "server", "--help"], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: rnnserve") and all(name in done.stdout for name in SUBCOMMANDS)


def test_serve_names_a_missing_model_file_before_importing_torch(tmp_path):
    missing = tmp_path / "nope.safetensors"
    probe = (
        "import sys; from rnnserve_cli import main; "
        f"code = main(['serve', '--model', {str(missing)!r}, '--port', '0']); "
        "print(code, 'torch' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.stdout.split() == ["2", "False"], done.stderr
    assert f"--model file not found: {missing}" in done.stderr


def ray_status(tmp_path: Path, *flags: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "RAY_TMPDIR": str(tmp_path), "RAY_ADDRESS": ""}
    command = [str(Path(sys.executable).parent / "rnnserve"), "ray-status", *flags]
    return subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)


def one_line_error(done: subprocess.CompletedProcess) -> str:
    """The one line a command that could not run says: exit code 2, nothing on stdout."""
    assert done.returncode == 2, done.stderr
    assert done.stdout == ""
    (line,) = done.stderr.strip().splitlines()
    return line


def ray_node_host() -> str:
    """The address Ray itself would dial for this machine (it rewrites 127.0.0.1 to it)."""
    import ray.util

    return ray.util.get_node_ip_address()


@pytest.mark.skipif(not HAS_RAY, reason=NO_RAY)
def test_ray_status_without_a_cluster_says_so_in_one_line(tmp_path):
    """Ray's own `serve status` needs the dashboard; ours asks the cluster, and names the missing one."""
    done = ray_status(tmp_path)
    line = one_line_error(done)
    assert line.startswith("rnnserve ray-status: no Ray cluster at 'auto'") and "rnnserve serve --ray" in line


@pytest.mark.skipif(not HAS_RAY, reason=NO_RAY)
def test_ray_status_with_a_head_that_refuses_says_so_at_once(tmp_path):
    """A cluster's address left behind by a head that is gone: Ray's client would wait minutes on it."""
    with socket.socket() as free:
        free.bind((ray_node_host(), 0))
        host, port = free.getsockname()[:2]
    done = ray_status(tmp_path, "--address", f"{host}:{port}", "--timeout", "30")
    line = one_line_error(done)
    assert line.startswith(f"rnnserve ray-status: no Ray cluster at '{host}:{port}' (nothing answers at {host}:{port}")


@pytest.mark.skipif(not HAS_RAY, reason=NO_RAY)
def test_ray_status_with_a_head_that_never_answers_gives_up_at_its_deadline(tmp_path):
    """A head whose port is open but which says nothing (a cluster shutting down): the deadline ends the wait."""
    with socket.socket() as silent:
        silent.bind((ray_node_host(), 0))
        silent.listen(8)
        host, port = silent.getsockname()[:2]
        done = ray_status(tmp_path, "--address", f"{host}:{port}", "--timeout", "2")
    line = one_line_error(done)
    assert line.startswith(f"rnnserve ray-status: the Ray cluster at '{host}:{port}' did not answer within 2 s")


@pytest.mark.parametrize("timeout", ["0", "-1", "soon", "inf"])
def test_ray_status_refuses_a_timeout_that_is_not_a_positive_number(tmp_path, timeout):
    done = ray_status(tmp_path, "--timeout", timeout)
    assert done.returncode == 2
    assert f"argument --timeout: expected a positive number of seconds, got '{timeout}'" in done.stderr


@pytest.mark.skipif(HAS_RAY, reason="Ray is installed: the missing extra cannot be seen")
def test_ray_status_without_the_ray_extra_says_so_in_one_line(tmp_path):
    done = ray_status(tmp_path)
    line = one_line_error(done)
    assert line == "rnnserve ray-status: Ray Serve is not installed: pip install 'rnnserve[ray]'"

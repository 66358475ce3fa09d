"""deploy/ray/ and the Ray configuration checks, without starting Ray.

The Serve configs (the file and each RayService's serveConfigV2) are checked
with Ray's own schema plus the unknown-keys and settings checks of
`server.rayserve.config`, which must also catch a misspelt copy. The manifests are
cross-checked against the pinned Ray version, the images and the PodMonitor;
kubernetes-validate checks their pod templates in .ci/checks.sh. Bad
`rnnserve serve --ray` configurations must stop with one line. Tests that
need Ray skip with the reason when the extra is not installed.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from server.settings import SettingsError, build_settings
from server_support import free_port

ROOT = Path(__file__).resolve().parents[1]
RAY_DIR = ROOT / "deploy" / "ray"
SERVE_CONFIG = RAY_DIR / "serve-config.yaml"
MANIFESTS = sorted(RAY_DIR.glob("rayservice-*.yaml"))
DASHBOARDS = ROOT / "deploy" / "grafana" / "dashboards"
HAS_RAY = importlib.util.find_spec("ray") is not None
needs_ray = pytest.mark.skipif(
    not HAS_RAY, reason="Ray Serve is not installed: pip install -e '.[ray]' (.ci/run installs it)"
)


def pinned_ray_version() -> str:
    text = (ROOT / "pyproject.toml").read_text()
    return re.search(r'"ray\[serve\]==([\d.]+)"', text).group(1)


def manifest(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def serve_config_of(path: Path) -> dict:
    return yaml.safe_load(manifest(path)["spec"]["serveConfigV2"])


def pod_templates(doc: dict) -> list[dict]:
    cluster = doc["spec"]["rayClusterConfig"]
    return [cluster["headGroupSpec"]["template"]] + [g["template"] for g in cluster["workerGroupSpecs"]]


# --------------------------------------------------------------------------- Serve configs


@needs_ray
@pytest.mark.parametrize("path", [SERVE_CONFIG, *MANIFESTS], ids=lambda p: p.name)
def test_serve_config_passes_rays_schema_and_the_unknown_key_check(path):
    from server.rayserve.config import problems, serve_configs

    configs = serve_configs(path)
    assert len(configs) == 1
    assert problems(configs[0][1]) == []


@needs_ray
def test_the_checker_catches_what_rays_schema_lets_through(tmp_path):
    from ray.serve.schema import ServeDeploySchema

    config = yaml.safe_load(SERVE_CONFIG.read_text())
    bad = copy.deepcopy(config)
    app = bad["applications"][0]
    app["deployments"] = [{"name": "rnnserve", "num_replica": 3, "ray_actor_options": {"num_cpu": 2}}]
    app["args"]["replicaz"] = 2
    ServeDeploySchema.model_validate(bad)  # Ray's schema accepts all of it
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(bad))
    result = subprocess.run(
        [sys.executable, "-m", "server.rayserve.config", str(path)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert result.returncode == 1
    lines = result.stdout.splitlines()
    assert len(lines) == 3, result.stdout
    assert "applications.0.deployments.0.num_replica: unknown key (did you mean num_replicas?)" in lines[0] + lines[1]
    assert "ray_actor_options.num_cpu: unknown key (did you mean num_cpus?)" in lines[0] + lines[1]
    assert "applications.0.args: unknown setting 'replicaz'" in lines[2]


def test_serve_config_and_manifests_run_the_same_application():
    expected = yaml.safe_load(SERVE_CONFIG.read_text())["applications"][0]
    for path in MANIFESTS:
        app = serve_config_of(path)["applications"][0]
        assert (app["name"], app["import_path"], app["route_prefix"]) == (
            expected["name"],
            expected["import_path"],
            expected["route_prefix"],
        ), path.name
        assert build_settings(**app["args"]).autoscaling(), f"{path.name} does not autoscale"


# --------------------------------------------------------------------------- manifests


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_manifest_matches_the_pinned_ray_and_its_images(path):
    doc = manifest(path)
    assert (doc["apiVersion"], doc["kind"]) == ("ray.io/v1", "RayService")
    assert doc["spec"]["rayClusterConfig"]["rayVersion"] == pinned_ray_version()
    dockerfile = (RAY_DIR / "Dockerfile").read_text()
    assert f"rayproject/ray:{pinned_ray_version()}-py311-" in dockerfile
    for template in pod_templates(doc):
        container = template["spec"]["containers"][0]
        assert container["image"].startswith("rnnserve:ray-")
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert ports["metrics"] == 8080 and ports["serve"] == 8000


def test_the_ray_image_copies_every_module_pyproject_installs():
    import tomllib

    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    top_level = {name.split(".")[0] for name in setuptools["packages"]}  # server.api lives in server/
    installed = top_level | {f"{m}.py" for m in setuptools.get("py-modules", [])}
    copies = [
        line.split()[1:-1] for line in (RAY_DIR / "Dockerfile").read_text().splitlines() if line.startswith("COPY ")
    ]
    copied = {Path(source).name for sources in copies for source in sources if not source.startswith("--")}
    assert installed <= copied, f"`pip install` in the Ray image would miss {sorted(installed - copied)}"


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_workers_hold_the_replicas_the_settings_ask_for(path):
    doc = manifest(path)
    settings = build_settings(**serve_config_of(path)["applications"][0]["args"])
    cluster = doc["spec"]["rayClusterConfig"]
    assert cluster["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0", "replicas belong on workers"
    cpus = gpus = 0.0
    for group in cluster["workerGroupSpecs"]:
        limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
        cpus += float(limits["cpu"]) * group["maxReplicas"]
        gpus += float(limits.get("nvidia.com/gpu", 0)) * group["maxReplicas"]
        # a pod must outlive its replicas' drain
        assert group["template"]["spec"]["terminationGracePeriodSeconds"] > settings.drain_seconds + 10
    assert settings.max_replicas * settings.cpus_per_replica <= cpus
    assert settings.max_replicas * settings.gpus_per_replica <= gpus
    assert (settings.device == "cuda") == (settings.gpus_per_replica > 0)


def test_podmonitor_scrapes_the_metrics_port_of_ray_pods():
    monitor = yaml.safe_load((RAY_DIR / "podmonitor.yaml").read_text())
    assert monitor["spec"]["selector"]["matchLabels"] == {"ray.io/is-ray-node": "yes"}
    assert [e["port"] for e in monitor["spec"]["podMetricsEndpoints"]] == ["metrics"]


# --------------------------------------------------------------------------- dashboard variant


def test_ray_dashboard_is_the_generated_variant():
    spec = importlib.util.spec_from_file_location("ray_dashboard", ROOT / "deploy" / "grafana" / "ray_dashboard.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert (DASHBOARDS / "rnnserve-ray.json").read_text() == module.render(), (
        "run `python deploy/grafana/ray_dashboard.py` after changing rnnserve.json"
    )


def test_ray_dashboard_queries_the_prefixed_metrics_filtered_by_replica():
    from test_deploy import promql_metric_names

    def names(dashboard: dict) -> set[str]:
        return {n for p in dashboard["panels"] for t in p["targets"] for n in promql_metric_names(t["expr"])}

    plain = json.loads((DASHBOARDS / "rnnserve.json").read_text())
    ray = json.loads((DASHBOARDS / "rnnserve-ray.json").read_text())
    assert names(ray) == {f"ray_{n}" for n in names(plain)}
    assert all('replica=~"$replica"' in t["expr"] for p in ray["panels"] for t in p["targets"])
    assert "replica" in [v["name"] for v in ray["templating"]["list"]]


# --------------------------------------------------------------------------- bad configuration, one line


def run_serve_ray(args: list[str], tmp_path: Path, without_ray: bool = False) -> tuple[int, list[str]]:
    """`rnnserve serve --ray ARGS` through `python -m server`; without_ray: as if the extra were missing."""
    hide = "sys.modules['ray'] = None; " if without_ray else ""  # `import ray` then raises ImportError
    code = (
        f"import runpy, sys; {hide}sys.argv = ['rnnserve', 'serve', '--ray', *{args!r}]; "
        "runpy.run_module('server', run_name='__main__')"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    return result.returncode, (result.stdout + result.stderr).strip().splitlines()


def test_missing_extra_is_one_line(tmp_path):
    code, lines = run_serve_ray(["--port", str(free_port())], tmp_path, without_ray=True)
    assert code == 2
    assert lines == [
        "rnnserve serve: error: --ray needs Ray Serve, which is not installed: pip install 'rnnserve[ray]'"
    ]


@needs_ray
def test_more_replicas_than_cpus_is_one_line(tmp_path):
    import os

    replicas = (os.cpu_count() or 1) + 1
    code, lines = run_serve_ray(
        ["--weights", str(ROOT / "weights"), "--port", str(free_port()), "--replicas", str(replicas)], tmp_path
    )
    assert code == 2
    assert lines == [
        f"rnnserve serve: error: --replicas {replicas} x --cpus-per-replica 1 needs {replicas} CPUs "
        f"and this machine has {os.cpu_count()}; lower one of them"
    ]


@needs_ray
def test_a_port_in_use_stops_ray_start_up_in_one_line(tmp_path):
    """--ray checks its port before Ray starts and before any model file is read (a broken one is given)."""
    (tmp_path / "broken.safetensors").write_bytes(b"\x00" * 64)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, lines = run_serve_ray(["--weights", str(tmp_path), "--port", str(port)], tmp_path)
    assert code == 2
    assert lines == [
        f"rnnserve serve: error: cannot listen on 127.0.0.1:{port}: "
        "the address is already in use (another server?); pass another --port"
    ]


def test_replicas_and_autoscaling_together_is_one_line(tmp_path):
    code, lines = run_serve_ray(["--replicas", "2", "--max-replicas", "3"], tmp_path, without_ray=True)
    assert code == 2 and len(lines) == 1
    assert "give either --replicas (a fixed count) or --min-replicas/--max-replicas (autoscaling), not both" in lines[0]


@needs_ray
def test_builder_refuses_unknown_args_in_one_line():
    from server.rayserve.app import settings_for_serve

    with pytest.raises(SettingsError) as caught:
        settings_for_serve({"weights": "weights", "replicaz": 2})
    assert "\n" not in str(caught.value) and "unknown setting 'replicaz'" in str(caught.value)
    with pytest.raises(SettingsError, match="--device cuda needs --gpus-per-replica above 0"):
        settings_for_serve({"device": "cuda"})


@needs_ray
def test_serve_run_with_a_bad_arg_says_one_line_and_exits_2(tmp_path):
    """`serve run server.rayserve.app:build replicaz=2` fails before Ray starts: our line, not Ray's CLI traceback."""
    serve_cli = Path(sys.executable).with_name("serve")
    result = subprocess.run(
        [str(serve_cli), "run", "server.rayserve.app:build", "replicaz=2", "--app-dir", str(ROOT)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )
    assert result.returncode == 2
    assert "Traceback" not in result.stdout + result.stderr
    assert (
        result.stderr.strip()
        .splitlines()[-1]
        .startswith("rnnserve on Ray Serve: invalid settings: unknown setting 'replicaz'")
    )


def test_config_check_without_the_extra_is_one_line(tmp_path):
    code = (
        "import runpy, sys; sys.modules['ray'] = None; sys.argv = ['ray_config', 'x.yaml']; "
        "runpy.run_module('server.rayserve.config', run_name='__main__')"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert result.returncode == 2
    assert (result.stdout + result.stderr).strip().splitlines() == [
        "server.rayserve.config needs Ray Serve, which is not installed: pip install 'rnnserve[ray]'"
    ]


@needs_ray
def test_builder_turns_settings_into_deployment_options():
    from server.rayserve.app import deployment_options

    fixed = deployment_options(build_settings(replicas=3, cpus_per_replica=0.5, max_batch=8, max_waiting=4))
    assert fixed["num_replicas"] == 3 and "autoscaling_config" not in fixed
    assert fixed["ray_actor_options"] == {"num_cpus": 0.5, "num_gpus": 0.0}
    assert fixed["max_ongoing_requests"] == 12  # the engine's own queue limit answers 429, not Serve's
    scaled = deployment_options(build_settings(max_replicas=4, target_ongoing_requests=16, drain_seconds=10))
    assert scaled["autoscaling_config"] == {
        "min_replicas": 1,
        "max_replicas": 4,
        "target_ongoing_requests": 16,
        "downscale_delay_s": 60.0,
        "upscale_delay_s": 5.0,
    }
    quick = deployment_options(build_settings(max_replicas=2, downscale_delay=3, upscale_delay=1))["autoscaling_config"]
    from ray.serve.config import AutoscalingConfig

    checked = AutoscalingConfig(**quick)  # Ray's own schema takes every key, with the values given
    assert (checked.downscale_delay_s, checked.upscale_delay_s) == (3, 1)
    assert "num_replicas" not in scaled and scaled["graceful_shutdown_timeout_s"] > 10

"""Container and monitoring files: Dockerfile, docker-compose.yml, deploy/.

The dashboard is checked against a real `python -m server serve` process
with tiny random-weight models: every metric its PromQL names must be in the
server's /metrics scrape, with the labels the queries group by. The static
files are cross-checked (scrape target = compose service and port, Grafana
mounts = provisioning paths, datasource uid = dashboard uid). The linters run
when their binaries are here; `.ci/checks.sh` installs and runs them for real.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
import torch
import yaml
from prometheus_client.parser import text_string_to_metric_families

from model import ModelConfig, build_model
from model.io.weights import save_model
from server_support import stop_process, wait_healthy

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "rnnserve.json"
PROMETHEUS_CONFIG = ROOT / "deploy" / "prometheus.yml"
COMPOSE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "Dockerfile"
GRAFANA_PROVISIONING = ROOT / "deploy" / "grafana" / "provisioning"
# Where .ci/checks.sh installs hadolint and promtool when they are not on PATH.
TOOLS_BIN = Path(os.environ.get("RNNSERVE_TOOLS_DIR", Path.home() / ".cache" / "rnnserve-tools")) / "bin"
SERVER_START_SECONDS = 90  # model loading on a busy 2-core machine


# --------------------------------------------------------------------------- PromQL

PROMQL_KEYWORDS = {
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "bool",
    "and",
    "or",
    "unless",
    "offset",
    "inf",
    "nan",
}
LABEL_LIST = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")


def promql_metric_names(expr: str) -> set[str]:
    """Metric names a PromQL expression selects (not functions, keywords, labels or numbers)."""
    expr = re.sub(r'"(?:\\.|[^"\\])*"', '""', expr)  # string literals
    expr = re.sub(r"\{[^}]*\}", "", expr)  # label matchers
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # range and subquery durations
    expr = LABEL_LIST.sub("", expr)  # grouping and matching label lists
    names = set()
    for match in re.finditer(r"(?<![\w.$])[A-Za-z_:][\w:]*", expr):
        called = expr[match.end() :].lstrip().startswith("(")
        if not called and match.group().lower() not in PROMQL_KEYWORDS:
            names.add(match.group())
    return names


def promql_grouping_labels(expr: str) -> set[str]:
    """Labels named in `by (...)` clauses: each must exist on the metrics aggregated."""
    return {
        label.strip()
        for kind, labels in LABEL_LIST.findall(expr)
        if kind == "by"
        for label in labels.split(",")
        if label.strip()
    }


def dashboard_expressions(dashboard: dict) -> list[str]:
    """Every PromQL expression of the dashboard: panel targets and query variables."""
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel.get("targets", []) if t.get("expr")]
    for variable in dashboard.get("templating", {}).get("list", []):
        if variable.get("type") != "query":
            continue
        query = variable["query"] if isinstance(variable["query"], str) else variable["query"]["query"]
        selector = re.fullmatch(r"\s*label_values\((.*),\s*\w+\s*\)\s*", query)  # label_values(SELECTOR, label)
        exprs.append(selector.group(1) if selector else query)
    return exprs


def test_promql_metric_names_skips_functions_labels_and_numbers():
    expr = (
        'histogram_quantile(0.9, sum by (le, model) (rate(a_seconds_bucket{model=~"$model", x="y z"}[$__rate_interval])))'
        " / on (model) group_left b_total offset 5m > bool 1e3"
    )
    assert promql_metric_names(expr) == {"a_seconds_bucket", "b_total"}
    assert promql_grouping_labels(expr) == {"le", "model"}


# --------------------------------------------------------------------------- live server


@dataclass
class Scrape:
    """Sample name -> label names seen on it, and the raw samples."""

    labels: dict[str, set[str]] = field(default_factory=dict)
    samples: list = field(default_factory=list)

    @classmethod
    def parse(cls, text: str) -> "Scrape":
        scrape = cls()
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                scrape.labels.setdefault(sample.name, set()).update(sample.labels)
                scrape.samples.append(sample)
        return scrape

    def value(self, name: str, **labels: str) -> float:
        return sum(
            s.value for s in self.samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
        )


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _tiny_config(attention: str, task: str, max_len: int) -> ModelConfig:
    return ModelConfig(
        attention=attention,
        task=task,
        d_model=32,
        n_layers=2,
        n_heads=4,
        d_ff=64,
        max_len=max_len,
        linformer_k=8,
        reformer_buckets=4,
    )


def _write_tiny_models(folder: Path) -> dict[str, ModelConfig]:
    """One mnist model and one text model, random weights, as real safetensors files."""
    configs = {
        "digits-linear": _tiny_config("linear", "mnist", 784),
        "text-softmax": _tiny_config("softmax", "text", 64),
    }
    torch.manual_seed(0)
    for name, cfg in configs.items():
        save_model(build_model(cfg).eval(), folder / f"{name}.safetensors", info={"test": "deploy"})
    return configs


def _serve(weights: Path, port: int, log: Path) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RNNSERVE_")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")  # the test machine's 2 cores are shared
    command = [
        sys.executable,
        "-m",
        "server",
        "serve",
        "--weights",
        str(weights),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--device",
        "cpu",
        "--log-level",
        "warning",
        "--no-compile-decode",
    ]  # compiling is covered by tests/test_compiled_decode.py
    # Output to a file, not a pipe: nobody reads a pipe while tests run, and a full one blocks the server.
    with log.open("w") as out:
        return subprocess.Popen(command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)


def _send_traffic(base_url: str) -> None:
    """One image and one text completion, so the latency histograms have samples."""
    digit = [[(r * 28 + c) % 256 for c in range(28)] for r in range(28)]
    image = httpx.post(
        f"{base_url}/v1/images/completions",
        timeout=120,
        json={"model": "digits-linear", "pixels": digit, "keep_rows": 27, "n": 1, "seed": 1},
    )
    assert image.status_code == 200, image.text
    text = httpx.post(
        f"{base_url}/v1/completions",
        timeout=120,
        json={"model": "text-softmax", "prompt": "hello", "max_tokens": 5, "seed": 1},
    )
    assert text.status_code == 200, text.text


@pytest.fixture(scope="module")
def live_server(tmp_path_factory):
    """(base URL, /metrics scrape after traffic) of a real server process, kept running for the module."""
    weights = tmp_path_factory.mktemp("weights")
    _write_tiny_models(weights)
    port = _free_port()
    base_url = f"http://127.0.0.1:{port}"
    log = weights / "server.log"
    process = _serve(weights, port, log)
    try:
        wait_healthy(process, base_url, log, SERVER_START_SECONDS)
        _send_traffic(base_url)
        response = httpx.get(f"{base_url}/metrics", timeout=10)
        assert response.status_code == 200
        yield base_url, Scrape.parse(response.text)
    finally:
        stop_process(process)


def _dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def test_dashboard_metrics_are_exported_by_a_running_server(live_server):
    _, scrape = live_server
    exprs = dashboard_expressions(_dashboard())
    referenced = set().union(*(promql_metric_names(e) for e in exprs))
    assert referenced, "no metric names found in the dashboard's queries"
    missing = sorted(referenced - set(scrape.labels))
    assert not missing, (
        f"dashboard queries metrics the server does not export: {missing}; exported: {sorted(scrape.labels)}"
    )


def test_dashboard_groups_only_by_labels_the_metrics_carry(live_server):
    _, scrape = live_server
    problems = []
    for expr in dashboard_expressions(_dashboard()):
        for name in promql_metric_names(expr):
            absent = promql_grouping_labels(expr) - scrape.labels.get(name, set())
            if absent:
                problems.append(f"{name} has no label(s) {sorted(absent)} in: {expr}")
    assert not problems, "\n".join(problems)


def test_dashboard_latency_histograms_have_samples_after_traffic(live_server):
    _, scrape = live_server
    histograms = {
        name.removesuffix("_bucket")
        for e in dashboard_expressions(_dashboard())
        for name in promql_metric_names(e)
        if name.endswith("_bucket")
    }
    assert histograms, "the dashboard has no histogram_quantile panels"
    for histogram in sorted(histograms):
        for model in ("digits-linear", "text-softmax"):
            assert scrape.value(f"{histogram}_count", model=model) > 0, f"{histogram} has no samples for {model}"


def _healthcheck_code() -> str:
    """The Python program of the Dockerfile's HEALTHCHECK CMD (exec form)."""
    runtime = dockerfile_target("cpu")
    command = json.loads(re.sub(r"^.*?\bCMD\s+", "", runtime.last("HEALTHCHECK")))
    assert command[:2] == ["python", "-c"], f"HEALTHCHECK should run `python -c` (slim has no curl), got {command}"
    return command[2]


def _run_healthcheck(port: int) -> int:
    env = {**os.environ, "RNNSERVE_PORT": str(port)}
    return subprocess.run(
        [sys.executable, "-c", _healthcheck_code()], env=env, capture_output=True, timeout=30
    ).returncode


def test_dockerfile_healthcheck_passes_against_a_healthy_server(live_server):
    base_url, _ = live_server
    assert _run_healthcheck(int(base_url.rsplit(":", 1)[1])) == 0


def test_dockerfile_healthcheck_fails_when_nothing_answers():
    assert _run_healthcheck(_free_port()) != 0


# --------------------------------------------------------------------------- dashboard content


def test_dashboard_shows_the_required_panels_per_model_and_attention():
    exprs = dashboard_expressions(_dashboard())

    def queries(metric: str) -> list[str]:
        return [e for e in exprs if metric in promql_metric_names(e)]

    for counter in ("rnnserve_generated_tokens_total", "rnnserve_completed_images_total"):
        per_kind = [e for e in queries(counter) if "rate(" in e and {"model", "attention"} <= promql_grouping_labels(e)]
        assert per_kind, f"no per-second rate of {counter} by model and attention"
    for histogram in ("rnnserve_time_to_first_token_seconds", "rnnserve_inter_token_latency_seconds"):
        quantiles = [
            e
            for e in queries(f"{histogram}_bucket")
            if "histogram_quantile(" in e and "le" in promql_grouping_labels(e)
        ]
        assert len(quantiles) >= 2, f"expected several quantiles of {histogram}, got {quantiles}"
    for gauge in ("rnnserve_batch_size", "rnnserve_waiting_sequences", "rnnserve_decode_state_in_use_bytes"):
        assert queries(gauge), f"no panel shows {gauge}"


# --------------------------------------------------------------------------- compose and Prometheus


def _compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def _mounts(service: dict) -> dict[str, Path]:
    """Container path -> host path of a service's bind mounts (named volumes have bare names)."""
    mounts = {}
    for volume in service.get("volumes", []):
        source, target = volume.split(":")[:2]
        if source.startswith((".", "/")):
            mounts[target] = (ROOT / source).resolve()
    return mounts


def test_compose_has_server_monitoring_and_a_gpu_profile():
    services = _compose()["services"]
    assert {"server", "prometheus", "grafana"} <= set(services)
    assert "profiles" not in services["server"], "the CPU server must start with a plain `up`"
    gpu = [s for s in services.values() if "gpu" in s.get("profiles", [])]
    assert len(gpu) == 1, "expected one service in the `gpu` profile"
    devices = gpu[0]["deploy"]["resources"]["reservations"]["devices"]
    assert any(d.get("driver") == "nvidia" and "gpu" in d.get("capabilities", []) for d in devices)
    assert gpu[0]["environment"]["RNNSERVE_DEVICE"] == "cuda"


def test_compose_publishes_ports_on_loopback_only():
    for name, service in _compose()["services"].items():
        for port in service.get("ports", []):
            assert str(port).startswith("127.0.0.1:"), f"{name} publishes {port} on every host interface"


def test_compose_build_targets_are_dockerfile_stages():
    stages = parse_dockerfile()
    for name, service in _compose()["services"].items():
        if "build" in service:
            assert service["build"]["target"] in stages, f"{name} builds unknown target {service['build']['target']}"


def test_prometheus_scrapes_every_server_service_at_its_port():
    services = _compose()["services"]
    jobs = yaml.safe_load(PROMETHEUS_CONFIG.read_text())["scrape_configs"]
    targets = {
        t
        for job in jobs
        if job.get("metrics_path", "/metrics") == "/metrics"
        for group in job["static_configs"]
        for t in group["targets"]
    }
    server_services = {name for name, s in services.items() if "build" in s}
    assert "server" in server_services
    for name in server_services:
        port = services[name]["environment"]["RNNSERVE_PORT"]
        assert f"{name}:{port}" in targets, f"prometheus.yml does not scrape {name}:{port}; targets {sorted(targets)}"
    for target in targets:
        assert target.split(":")[0] in services, f"scrape target {target} is not a compose service"
    mounts = _mounts(services["prometheus"])
    assert mounts.get("/etc/prometheus/prometheus.yml") == PROMETHEUS_CONFIG


def test_grafana_provisioning_matches_the_mounts_and_the_dashboard():
    grafana = _compose()["services"]["grafana"]
    mounts = _mounts(grafana)
    assert mounts.get("/etc/grafana/provisioning") == GRAFANA_PROVISIONING
    datasources = [
        d
        for f in (GRAFANA_PROVISIONING / "datasources").glob("*.yml")
        for d in yaml.safe_load(f.read_text())["datasources"]
    ]
    prometheus = [d for d in datasources if d["type"] == "prometheus"]
    assert len(prometheus) == 1 and prometheus[0]["url"] == "http://prometheus:9090"
    providers = [
        p
        for f in (GRAFANA_PROVISIONING / "dashboards").glob("*.yml")
        for p in yaml.safe_load(f.read_text())["providers"]
    ]
    assert mounts.get(providers[0]["options"]["path"]) == DASHBOARD.parent, (
        "dashboard provider path is not the mounted folder"
    )
    used_uids = {p["datasource"]["uid"] for p in _dashboard()["panels"]}
    assert used_uids == {prometheus[0]["uid"]}, f"dashboard uses datasource uids {used_uids}"


# --------------------------------------------------------------------------- Dockerfile


@dataclass
class Stage:
    base: str
    instructions: list[tuple[str, str]]  # (KEYWORD, whole line), continuations joined

    def all(self, keyword: str) -> list[str]:
        return [line for kw, line in self.instructions if kw == keyword]

    def last(self, keyword: str) -> str:
        found = self.all(keyword)
        assert found, f"no {keyword} instruction"
        return found[-1]


def parse_dockerfile() -> dict[str, Stage]:
    """Stages by name (the last one also as ''), continuation lines joined."""
    text = re.sub(r"\\\n\s*", " ", DOCKERFILE.read_text())
    stages: dict[str, Stage] = {}
    current = None
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        keyword = line.split()[0].upper()
        if keyword == "FROM":
            match = re.match(r"FROM\s+(?:--\S+\s+)*(\S+)(?:\s+AS\s+(\S+))?", line, re.IGNORECASE)
            current = Stage(match.group(1), [])
            stages[match.group(2) or f"stage{len(stages)}"] = current
        elif current is not None:
            current.instructions.append((keyword, line))
    stages[""] = current
    return stages


def dockerfile_target(name: str) -> Stage:
    """A target with the instructions of the stages it is built FROM, oldest first."""
    stages = parse_dockerfile()
    chain = [stages[name]]
    while chain[0].base in stages:
        chain.insert(0, stages[chain[0].base])
    return Stage(chain[0].base, [i for stage in chain for i in stage.instructions])


@pytest.mark.parametrize("target", ["", "cpu", "cuda"])
def test_dockerfile_target_runs_as_non_root_with_weights_and_healthcheck(target):
    image = dockerfile_target(target)
    user = image.last("USER").split()[1].split(":")[0]
    assert user not in ("root", "0"), f"runs as {user}"
    assert "/health" in image.last("HEALTHCHECK")
    assert any(re.search(r"\sweights/?\s", line) for line in image.all("COPY")), "weights/ is not copied into the image"
    env = " ".join(image.all("ENV"))
    assert "RNNSERVE_HOST=0.0.0.0" in env and "RNNSERVE_WEIGHTS=/app/weights" in env
    port = re.search(r"RNNSERVE_PORT=(\d+)", env).group(1)
    assert image.last("EXPOSE").split()[1] == port


def test_the_source_stage_copies_every_module_pyproject_installs():
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    top_level = {name.split(".")[0] for name in setuptools["packages"]}  # server.api lives in server/
    installed = top_level | {f"{m}.py" for m in setuptools.get("py-modules", [])}
    copied = {
        Path(source).name
        for line in parse_dockerfile()["source"].all("COPY")
        for source in line.split()[1:-1]
        if not source.startswith("--")
    }  # COPY SOURCE... DEST
    assert installed <= copied, f"`pip install .` in the image would miss {sorted(installed - copied)}"


def test_default_target_is_the_cpu_image():
    stages = parse_dockerfile()
    assert stages[""] is stages["cpu"]
    venv_source = re.search(r"--from=(\S+)", " ".join(stages["cpu"].all("COPY"))).group(1)
    assert any("download.pytorch.org/whl/cpu" in line for line in stages[venv_source].all("ARG")), (
        f"the CPU image's venv ({venv_source}) does not install torch from the CPU index"
    )


# --------------------------------------------------------------------------- linters (when installed)


def _tool(name: str) -> str:
    found = shutil.which(name) or shutil.which(name, path=str(TOOLS_BIN))
    if not found:
        pytest.skip(f"{name} is not installed; `bash .ci/checks.sh` installs it and runs this check")
    return found


def test_hadolint_reports_nothing():
    result = subprocess.run(
        [_tool("hadolint"), "--no-color", "--failure-threshold", "style", str(DOCKERFILE)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0 and not result.stdout.strip(), result.stdout + result.stderr


@pytest.mark.parametrize("profile", [[], ["--profile", "gpu"]])
def test_docker_compose_config_is_valid(profile):
    result = subprocess.run(
        [_tool("docker-compose"), "-f", str(COMPOSE), *profile, "config", "-q"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert result.returncode == 0 and not (result.stdout + result.stderr).strip(), result.stdout + result.stderr


def test_promtool_accepts_prometheus_config():
    result = subprocess.run(
        [_tool("promtool"), "check", "config", str(PROMETHEUS_CONFIG)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr

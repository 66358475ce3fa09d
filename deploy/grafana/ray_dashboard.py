"""Write the Ray Serve variant of the rnnserve dashboard: `python deploy/grafana/ray_dashboard.py`.

Under Ray Serve each replica's series reach Prometheus through Ray's metrics
export: the same names with a `ray_` prefix, and a `replica` label (plus
`deployment` and `application`). The variant (dashboards/rnnserve-ray.json) is
rnnserve.json with every metric renamed, every selector filtered by a
`replica` variable, and two per-replica panels; tests/test_ray_deploy.py checks
that the committed file is what this script writes.
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

HERE = Path(__file__).resolve().parent / "dashboards"
SOURCE, VARIANT = HERE / "rnnserve.json", HERE / "rnnserve-ray.json"
SELECTOR = re.compile(r"\brnnserve_(\w+)(\{([^}]*)\})?")
FILTERS = 'model=~"$model", attention=~"$attention", replica=~"$replica"'
REPLICA_MATCHER = 'replica=~"$replica"'
# (title, description, unit, expr) of the panels only the variant has
PER_REPLICA = (
    (
        "Tokens/s by replica",
        "Generated tokens per second of each replica: how evenly the proxy spreads the load.",
        "suffix: tok/s",
        f"sum by (replica) (rate(ray_rnnserve_generated_tokens_total{{{FILTERS}}}[$__rate_interval]))",
    ),
    (
        "Running sequences by replica",
        "Sequences holding a decode slot in each replica.",
        "short",
        f"sum by (replica) (ray_rnnserve_running_sequences{{{FILTERS}}})",
    ),
)


def under_ray(expr: str) -> str:
    """Rename every rnnserve_ metric to ray_rnnserve_ and filter it by the replica variable."""

    def rename(match: re.Match) -> str:
        matchers = [m for m in (match.group(3) or "").split(", ") if m] + [REPLICA_MATCHER]
        return "ray_rnnserve_" + match.group(1) + "{" + ", ".join(matchers) + "}"

    return SELECTOR.sub(rename, expr)


def variant(dashboard: dict) -> dict:
    out = copy.deepcopy(dashboard)
    out.update(
        uid="rnnserve-ray",
        title="rnnserve on Ray Serve",
        description=dashboard["description"] + " Every replica's series, from Ray's metrics export (ray_ prefix).",
    )
    for panel in out["panels"]:
        for target in panel.get("targets", []):
            target["expr"] = under_ray(target["expr"])
    variables = out["templating"]["list"]
    for variable in variables:
        variable["query"] = variable["definition"] = variable["query"].replace("rnnserve_", "ray_rnnserve_")
    replica = copy.deepcopy(variables[0])
    replica.update(
        name="replica", label="replica", query='label_values(ray_rnnserve_running_sequences{model=~"$model"}, replica)'
    )
    replica["definition"] = replica["query"]
    variables.append(replica)
    out["panels"] += per_replica_panels(out["panels"])
    return out


def per_replica_panels(panels: list[dict]) -> list[dict]:
    """Two timeseries panels in one new row under the others, shaped like the first panel."""
    bottom = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in panels)
    new = []
    for i, (title, description, unit, expr) in enumerate(PER_REPLICA):
        panel = copy.deepcopy(panels[0])
        panel.update(id=max(p["id"] for p in panels) + 1 + i, title=title, description=description)
        panel["fieldConfig"]["defaults"]["unit"] = unit
        panel["gridPos"] = {"x": 12 * i, "y": bottom, "w": 12, "h": panel["gridPos"]["h"]}
        panel["targets"] = [{**panel["targets"][0], "expr": expr, "legendFormat": "{{replica}}", "refId": "A"}]
        new.append(panel)
    return new


def render() -> str:
    return json.dumps(variant(json.loads(SOURCE.read_text())), indent=2) + "\n"


if __name__ == "__main__":
    VARIANT.write_text(render())
    print(f"wrote {VARIANT}")

"""Check a Ray Serve config before deploying it: `python -m server.rayserve.config FILE...`.

FILE is a Serve config (deploy/ray/serve-config.yaml) or a KubeRay RayService
manifest, whose `spec.serveConfigV2` is checked. Three checks:
 1. Ray's own schema (`ray.serve.schema.ServeDeploySchema`), as `serve deploy` applies it;
 2. unknown keys, at every level that schema describes: it ignores them, so a
    misspelt `num_replica` or `autoscaling_confg` would deploy without effect;
 3. the `args` of every rnnserve application against rnnserve's settings.
Prints one line per problem and exits 1 if there is any.
"""

from __future__ import annotations

import difflib
import sys
import typing
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from server.settings import Settings, describe_validation_error

IMPORT_PATH = "server.rayserve.app:build"


def serve_configs(path: Path) -> list[tuple[str, Any]]:
    """(where, Serve config) of every YAML document of `path`; a RayService gives its serveConfigV2."""
    found = []
    for number, document in enumerate(yaml.safe_load_all(path.read_text())):
        where = f"{path}" if number == 0 else f"{path} (document {number + 1})"
        if isinstance(document, dict) and document.get("kind") == "RayService":
            found.append((f"{where} spec.serveConfigV2", yaml.safe_load(document["spec"]["serveConfigV2"])))
        elif isinstance(document, dict) and "applications" in document:
            found.append((where, document))
    return found


def problems(config: Any) -> list[str]:
    """Everything wrong with one Serve config, one line each (empty: it is fine)."""
    from ray.serve.schema import ServeDeploySchema

    if not isinstance(config, dict):
        return [f"a Serve config is a mapping with `applications`, got {type(config).__name__}"]
    found = unknown_keys(config, ServeDeploySchema, "")
    try:
        ServeDeploySchema.model_validate(config)
    except ValidationError as exc:
        found += [f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()]
    for index, app in enumerate(config.get("applications") or []):
        if isinstance(app, dict) and app.get("import_path") == IMPORT_PATH:
            found += [f"applications.{index}.args: {p}" for p in settings_problems(app.get("args") or {})]
    return found


def unknown_keys(value: Any, model: type[BaseModel], where: str) -> list[str]:
    """Keys of `value` that `model` (a pydantic model of Ray's schema) has no field for, recursively."""
    if not isinstance(value, dict):
        return []
    fields = model.model_fields
    found = [f"{where}{key}: unknown key{_did_you_mean(key, fields)}" for key in value if key not in fields]
    for key, field in fields.items():
        if key not in value:
            continue
        inner = _models_in(field.annotation)
        items = value[key] if isinstance(value[key], list) else [value[key]]
        for i, item in enumerate(items):
            place = f"{where}{key}.{i}." if isinstance(value[key], list) else f"{where}{key}."
            found += [p for m in inner[:1] for p in unknown_keys(item, m, place)]
    return found


def _did_you_mean(key: Any, known) -> str:
    close = difflib.get_close_matches(str(key), list(known), n=1)
    return f" (did you mean {close[0]}?)" if close else f"; known here: {', '.join(known)}"


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    """The pydantic models an annotation can hold: Optional[M], List[M], Union[Dict, M], ..."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _models_in(arg)]


def settings_problems(args: dict[str, Any]) -> list[str]:
    """rnnserve settings that are unknown or invalid (environment variables play no part here)."""
    try:
        Settings.model_validate(args)
    except ValidationError as exc:
        return [describe_validation_error(exc).removeprefix("invalid settings: ")]
    return []


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: python -m server.rayserve.config SERVE_CONFIG_OR_RAYSERVICE.yaml...", file=sys.stderr)
        return 2
    try:
        import ray.serve.schema  # noqa: F401  (the schema every config is checked against)
    except ImportError:
        print(
            "server.rayserve.config needs Ray Serve, which is not installed: pip install 'rnnserve[ray]'",
            file=sys.stderr,
        )
        return 2
    failed = False
    for name in argv:
        configs = serve_configs(Path(name))
        if not configs:
            print(f"{name}: no Serve config (a mapping with `applications`) or RayService in it")
            failed = True
        for where, config in configs:
            found = problems(config)
            failed = failed or bool(found)
            print("\n".join(f"{where}: {p}" for p in found) if found else f"{where}: ok")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

"""``gradtrace inspect PATH``: what a gradient store or a score directory holds."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.table import Table

from ..common.paths import why_missing
from ..common.provenance import resolve_paths
from .collect import projection_label
from .commands import QUIET_PROGRESS, cli, progress_flag
from .config import META_KEY
from .console import console, human_bytes
from .errors import CliError

__all__ = ["OPTIONS", "InspectCommand", "describe", "run", "store_checks"]


@dataclass(kw_only=True)
class InspectCommand:
    """Options of ``gradtrace inspect``."""

    path: Path = field(metadata=cli("A gradient store, a score directory, a fitted curvature or a method fit (trak, "
                                    "trackstar).", argument=True, metavar="PATH"))
    json: bool = field(default=False, metadata=cli("Print machine-readable JSON instead of a table.", "--json"))
    verify: bool = field(default=False, metadata=cli(
        "Also check every shard's data checksum (reads the whole store); the manifest, the shard lists and the "
        "records are always checked.", "--verify"))
    progress: bool = progress_flag(QUIET_PROGRESS)


OPTIONS = InspectCommand


def run(opts: InspectCommand) -> None:
    """Show what a gradient store or a score directory holds (shape, dtype, projection, provenance).

    Example: gradtrace inspect ./store --json
    """
    info = describe(opts.path, verify=opts.verify)
    if opts.json:
        sys.stdout.write(json.dumps(info, indent=1, default=str) + "\n")
        return
    table = Table(title=f"{info['kind']}: {opts.path}", title_justify="left", show_header=False, box=None,
                  pad_edge=False)
    table.add_column(style="bold")
    table.add_column(overflow="fold")
    for key, value in _display(info):
        table.add_row(key, value)
    console().print(table)


def describe(path: Path, verify: bool = False) -> dict[str, Any]:
    """A JSON-able summary of a store (``kind: "gradient store"``), saved scores (``"scores"``), a fitted curvature
    (``"curvature"``) or a method fit (``"method fit"``: trak, trackstar)."""
    if not path.exists():
        raise CliError(f"{path} {why_missing(path)}")
    if (path / "manifest.json").exists():
        from ..store import GradientStore

        store = GradientStore.open(path, verify=verify, allow_incomplete=True)
        info = store.info()
        info["ranks"] = {str(rank): status for rank, status in info["ranks"].items()}
        if isinstance(info.get("config"), dict):  # paths recorded relative to the store's folder (older: absolute)
            info["config"] = resolve_paths(info["config"], path)
        from ..capture.coverage import recorded_coverage

        coverage = recorded_coverage(store.manifest)  # None: a store written before coverage was recorded
        return {"kind": "gradient store", **info, "complete": store.complete, "checksums_verified": verify,
                "checked": store_checks(info["schema_version"], verify), "param_dims": dict(store.spec.params),
                "coverage": coverage.to_dict() if coverage is not None else None}
    if (path / "scores.json").exists():
        from ..score import Scores

        scores = Scores.load(path)
        combines = {"combines": scores.combination} if scores.combination else {}  # several stores: how
        return {"kind": "scores", "path": str(path), "method": scores.method, "queries": len(scores.query_ids),
                "train": len(scores.train_ids), "matrix": scores.matrix is not None,
                "top_k": int(scores.top[0].shape[1]) if scores.top is not None else None,
                "bottom_k": int(scores.bottom[0].shape[1]) if scores.bottom is not None else None, **combines,
                "units": scores.units, "meta": scores.meta, "environment": _environment_of(path / "scores.json")}
    if (path / "curvature.json").exists():
        from ..fit.curvature import Curvature

        fit = Curvature.load(path)
        record = json.loads((path / "curvature.json").read_text())
        return {"kind": "curvature", "path": str(path), "method": fit.kind, "fisher": fit.fisher,
                "damping": fit.damping, "blocks": len(fit.blocks), "precision": fit.precision(),
                "environment": record.get("environment"), "meta": fit.meta}
    if (path / "fit.json").exists():
        from ..fit.methods import load_fit

        try:
            method = load_fit(path)
        except (ValueError, OSError) as err:
            raise CliError(str(err)) from None
        record = json.loads((path / "fit.json").read_text())
        options = {k: v for k, v in method.options().items() if k != "lambda"}
        return {"kind": "method fit", "path": str(path), "method": method.name, "options": options,
                "dim": method.spec.dim, "rows": record.get("rows"), "environment": record.get("environment"),
                "meta": getattr(method, "meta", {})}
    raise CliError(f"{path} is neither a gradient store (no manifest.json), a score directory (no scores.json), a "
                   "curvature (no curvature.json) nor a method fit (no fit.json)")


def store_checks(schema_version: int, verify: bool) -> list[str]:
    """What opening a store of ``schema_version`` checked (see docs/store.md)."""
    checks = ["manifest checksum"] if schema_version >= 2 else []
    checks += ["shard list of every rank" if schema_version >= 2 else "shard and row counts of finished ranks",
               "record checksums" if schema_version >= 2 else "record consistency (schema 1: no record checksums)",
               "unique ids", "file names and sizes"]
    return checks + (["data checksums"] if verify else [])


def _environment_of(manifest: Path) -> dict[str, Any] | None:
    """The package versions an artifact's JSON manifest records (None for one saved before they were)."""
    try:
        return json.loads(manifest.read_text()).get("environment")
    except (OSError, ValueError):
        return None


def _provenance_rows(info: dict[str, Any], config: dict[str, Any]) -> list[tuple[str, str]]:
    """``software`` (the versions recorded with the artifact) and ``data`` (the data file read: path, rows, size
    and hash), where recorded."""
    rows = []
    environment = info.get("environment") or (config.get(META_KEY) or {}).get("environment")
    if environment:
        rows.append(("software", ", ".join(f"{name} {version}" for name, version in environment.items()
                                           if version is not None)))
    data = (config.get(META_KEY) or {}).get("data") if isinstance(config.get(META_KEY), dict) else None
    if data:
        size = human_bytes(data.get("bytes", 0))
        counted = f"{data['rows']:,} rows" if "rows" in data else "rows not counted"
        rows.append(("data", f"{data.get('path')} ({counted}, {size}, blake2b {data.get('blake2b')})"))
    return rows


def _display(info: dict[str, Any]) -> list[tuple[str, str]]:
    if info["kind"] == "method fit":
        meta = dict(info.get("meta") or {})
        config = meta.pop("config", {}) or {}
        rows = [("method", info["method"]), ("dim", f"{info['dim']:,}")]
        rows += [(key, _short(value)) for key, value in info["options"].items() if value is not None]
        if info.get("rows"):
            rows.append(("reads store", f"{info['rows'].get('absolute')} (fingerprint {info['rows'].get('digest')})"))
        return rows + _provenance_rows(info, config) + _config_rows(config)
    if info["kind"] == "curvature":
        meta = dict(info.get("meta") or {})
        rows = [("method", str(info["method"])), ("fisher", str(info["fisher"])), ("damping", _short(info["damping"])),
                ("blocks", f"{info['blocks']:,}"), ("precision", _precision(info.get("precision") or {}))]
        return rows + [(key, _short(value)) for key, value in meta.items()] + \
            _provenance_rows(info, meta.get("config") or {})
    if info["kind"] == "scores":
        meta = dict(info["meta"])
        config = meta.pop("config", {}) or {}
        kept = ["full matrix" if info["matrix"] else "", f"top {info['top_k']}" if info["top_k"] else "",
                f"bottom {info['bottom_k']}" if info["bottom_k"] else ""]
        rows = [("method", info["method"]),
                ("shape", f"{info['queries']:,} queries x {info['train']:,} training examples"),
                ("kept", ", ".join(k for k in kept if k)), ("sign", str(meta.pop("sign", ""))),
                ("units", str(info.get("units", "")))]  # an ensemble's: normalised ensemble scores, not cosines
        if info.get("combines"):
            rows.append(("combines", info["combines"]))
        spec = meta.pop("spec", {}) or {}
        if spec:
            rows.append(("projection", projection_label(spec.get("projection"))))
            rows.append(("dim", f"{spec.get('dim', 0):,}"))
            rows.append(("model", _model(spec.get("model") or {})))
        meta.pop("method", None)
        profile = meta.pop("profile", None) or {}
        meta.pop("distribution", None)  # per-query numbers: summarised by the diagnostics
        diagnostics = meta.pop("diagnostics", None)
        if diagnostics:
            from ..score.diagnostics import Diagnosis

            found = Diagnosis.from_dict(diagnostics)
            rows += [("diagnostics", line) for line in found.lines()]
            rows += [("warning", warning) for warning in found.warnings]
        rows += [(key, _short(value)) for key, value in meta.items()]
        if profile:
            rows.append(("profile", ", ".join(_profile_item(k, v) for k, v in profile.items())))
        return rows + _provenance_rows(info, config) + _config_rows(config)
    ranks = ", ".join(f"{r}: {s}" for r, s in info["ranks"].items())
    rows = [("rows", f"{info['rows']:,}"), ("dim", f"{info['dim']:,}"), ("dtype", info["dtype"]),
            ("parameters", f"{info['params']:,}"), ("coverage", _coverage(info.get("coverage"))),
            ("projection", projection_label(info["projection"])),
            ("convention", _short(info["convention"])), ("model", _model(info["model"] or {})),
            ("shards", f"{info['shards']:,}"), ("ranks", ranks),
            ("complete", "yes" if info["complete"] else "no (resume the run to finish it)"),
            ("size", human_bytes(info["bytes"])), ("created", str(info["created"])),
            ("checked", ", ".join(info["checked"])),
            ("checksums", "verified" if info["checksums_verified"] else "data not checked (--verify)")]
    if info.get("repeated_ids"):
        rows.append(("repeated ids", f"{info['repeated_ids']:,} stored by two ranks (same content; first row used)"))
    config = info.get("config") or {}
    return rows + _provenance_rows(info, config) + _config_rows(config)


def _precision(precision: dict[str, Any]) -> str:
    """A curvature's precision settings on one line (``Curvature.precision()``), saying which were assumed."""
    if not precision:
        return "?"
    assumed = precision.get("assumed") or []
    return (f"statistics {precision.get('covariance_dtype')}, eigendecompositions {precision.get('eigen_dtype')}"
            f"{', offloaded' if precision.get('offload') else ''}"
            f"{' (not recorded: defaults assumed)' if assumed else ''}")


def _coverage(recorded: dict[str, Any] | None) -> str:
    """``97.3% of trainable parameters (N of M elements); left out: ...`` (partial captures say so)."""
    from ..capture.coverage import Coverage

    if recorded is None:
        return "not recorded (a store written before gradtrace recorded the share of parameters captured)"
    coverage = Coverage.from_dict(recorded)
    partial = " (collected with --partial / partial=True)" if coverage.partial and coverage.uncovered else ""
    return coverage.line() + partial


def _config_rows(config: dict[str, Any]) -> list[tuple[str, str]]:
    config = dict(config)
    meta = config.pop(META_KEY, None)
    rows = []
    if isinstance(meta, dict) and meta.get("command"):
        rows.append(("written by", f"gradtrace {meta.get('version')} {meta.get('command')} ({meta.get('written')})"))
    elif isinstance(meta, dict):  # the Python API and the Trainer callback record their options, not a command
        rows.append(("written by", "gradtrace's Python API or Trainer callback (no command line recorded)"))
    rows += [(f"config.{key}", _short(value)) for key, value in config.items()]
    return rows


def _profile_item(key: str, value: Any) -> str:
    if not isinstance(value, (int, float)):
        return f"{key} {value}"
    if key.endswith("_per_s"):
        return f"{value:,.0f} {key.removesuffix('_per_s')}/s"
    return f"{key.removesuffix('_s')} {value:.3f} s" if key.endswith("_s") else f"{key} {value:g}"


def _model(model: dict[str, Any]) -> str:
    if not model:
        return "unknown"
    return f"{model.get('class')} (arch {model.get('arch')}, weights {model.get('weights')})"


def _short(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, default=str)

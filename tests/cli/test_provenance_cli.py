"""Every artifact records the software that wrote it and the data file it read (hash, size, rows), and
``gradtrace inspect`` shows them for stores, scores and curvature (issue #17, repeatable runs)."""

from __future__ import annotations

import hashlib
import json

from gradtrace.common.provenance import environment
from tests.cli.conftest import invoke


def _blake2b(path) -> str:
    return hashlib.blake2b(path.read_bytes(), digest_size=16).hexdigest()


def _software(env: dict) -> str:
    return ", ".join(f"{name} {version}" for name, version in env.items() if version is not None)


def test_store_scores_and_curvature_record_data_and_versions(ws, runner, store, scores_dir, tmp_path):
    env = environment()
    manifest = json.loads((store / "manifest.json").read_text())
    assert manifest["environment"] == env
    data = manifest["config"]["gradtrace"]["data"]
    assert data == {"path": "../train.jsonl", "bytes": ws.train.stat().st_size,
                    "blake2b": _blake2b(ws.train), "rows": 24}
    assert manifest["config"]["gradtrace"]["environment"] == env  # paths: relative to the store (read back by
    # inspect against it, below)

    scores = json.loads((scores_dir / "scores.json").read_text())
    assert scores["environment"] == env
    queries = scores["meta"]["config"]["gradtrace"]["data"]
    assert queries == {"path": "../queries.txt", "bytes": ws.queries.stat().st_size,
                       "blake2b": _blake2b(ws.queries), "rows": 3}

    invoke(runner, "fit", store, "--method", "logra", "--fisher", "empirical", "--out", tmp_path / "c", "--no-progress")
    assert json.loads((tmp_path / "c" / "curvature.json").read_text())["environment"] == env

    flat = lambda text: "".join(text.split())  # rich folds long rows anywhere: compare without whitespace
    shown = flat(invoke(runner, "inspect", store).stdout)
    assert flat(f"software gradtrace {env['gradtrace']}, torch {env['torch']}") in shown
    assert flat(f"data {ws.train.absolute()} (24 rows") in shown and _blake2b(ws.train) in shown
    shown = flat(invoke(runner, "inspect", scores_dir).stdout)
    assert flat(f"torch {env['torch']}") in shown and "(3rows" in shown and _blake2b(ws.queries) in shown
    shown = flat(invoke(runner, "inspect", tmp_path / "c").stdout)
    assert "curvature" in shown and flat(f"torch {env['torch']}") in shown and "methodfisherfisherempirical" in shown
    described = json.loads(invoke(runner, "inspect", tmp_path / "c", "--json").stdout)
    assert described["kind"] == "curvature" and described["environment"] == env


def test_fit_records_the_data_it_fitted_on(ws, runner, store, tmp_path):
    """``gradtrace fit`` on data records its hash and rows like collect and score; --method logra reads no data."""
    invoke(runner, "fit", store, ws.train, "--method", "kfac", "--out", tmp_path / "c", "--no-progress")
    meta = json.loads((tmp_path / "c" / "curvature.json").read_text())["meta"]
    assert meta["config"]["gradtrace"]["data"] == {"path": str(ws.train.absolute()), "bytes": ws.train.stat().st_size,
                                                   "blake2b": _blake2b(ws.train), "rows": 24}
    assert meta["config"]["gradtrace"]["environment"] == environment()
    shown = "".join(invoke(runner, "inspect", tmp_path / "c").stdout.split())
    assert "(24rows" in shown and _blake2b(ws.train) in shown
    invoke(runner, "fit", store, "--method", "logra", "--out", tmp_path / "l", "--no-progress")
    assert "data" not in json.loads((tmp_path / "l" / "curvature.json").read_text())["meta"]["config"]["gradtrace"]

"""``gradtrace index`` and ``gradtrace score --index --rerank``: the same top-k as exact scoring when the shortlist
covers it, and one clear error line for a changed or another store, a mismatched index, bad options, no FAISS."""

from __future__ import annotations

import json
import shutil
import sys

import numpy as np
import pytest
import torch
import yaml

import gradtrace
from gradtrace.common.provenance import relative_path
from gradtrace.store.artifact import artifact_file, checksum
from tests.cli.conftest import copy_store, error_line, flat, invoke
from tests.score.legacy_index import save_v1
from tests.store.common import reseal_record

pytest.importorskip("faiss")


@pytest.fixture(scope="module")
def flat_index(ws, runner, store):
    out = ws.root / "index-flat"
    if not (out / "index.json").exists():
        invoke(runner, "index", store, "--out", out, "--kind", "flat", "--no-progress")
    return out


def test_index_writes_index_and_config(ws, runner, store, flat_index):
    info = json.loads((flat_index / "index.json").read_text())
    assert info["format"] == "gradtrace-index" and info["rows"] == 24 and info["params"]["kind"] == "flat"
    assert info["fingerprint"]["digest"] == \
        gradtrace.score.index.store_fingerprint(gradtrace.GradientStore.open(store))["digest"]
    resolved = yaml.safe_load((flat_index / "gradtrace-index.yaml").read_text())
    assert resolved["kind"] == "flat" and resolved["store"] == relative_path(store, flat_index)


def test_score_through_index_equals_exact_topk(ws, runner, store, scores_dir, flat_index, fresh):
    """A shortlist of 5 rows from a flat index: the exact top-5 and bottom-5, with the exact values."""
    result = invoke(runner, "score", store, ws.queries, "--model", ws.model, "--index", flat_index, "--rerank", 5,
                    "--topk", 5, "--out", fresh / "sc", "--no-progress")
    assert "top/bottom 5" in result.stdout
    got, exact = gradtrace.Scores.load(fresh / "sc"), gradtrace.Scores.load(scores_dir)
    assert got.matrix is None and got.meta["index"]["rerank"] == 5 and got.meta["index"]["kind"] == "flat"
    assert got.topk(5).ids == exact.topk(5).ids and got.topk(5, largest=False).ids == exact.topk(5, largest=False).ids
    scale = float(exact.matrix.abs().max())
    torch.testing.assert_close(got.top[0], exact.matrix.gather(1, got.top[1]), rtol=1e-5, atol=1e-5 * scale)
    assert yaml.safe_load((fresh / "sc" / "gradtrace-score.yaml").read_text())["index"] == \
        relative_path(flat_index, fresh / "sc")


def test_no_bottom_keeps_the_top_k_only(ws, runner, store, scores_dir, flat_index, fresh):
    """--no-bottom: the exact top-k with its values and no bottom-k; --modules splits the top pairs alone; topk
    --bottom and the report say the bottom-k was not kept; without --index it is refused."""
    result = invoke(runner, "score", store, ws.queries, "--model", ws.model, "--index", flat_index, "--rerank", 5,
                    "--topk", 5, "--no-bottom", "--modules", "--out", fresh / "sc", "--no-progress")
    assert "no matrix, top 5" in flat(result.stdout)
    got, exact = gradtrace.Scores.load(fresh / "sc"), gradtrace.Scores.load(scores_dir)
    assert got.bottom is None and not got.has_bottom and got.topk(5).ids == exact.topk(5).ids
    scale = float(exact.matrix.abs().max())
    torch.testing.assert_close(got.top[0], exact.matrix.gather(1, got.top[1]), rtol=1e-5, atol=1e-5 * scale)
    assert {(r["query_id"], r["train_id"]) for r in got.meta["modules"]} == \
        {(q, t) for q, row in zip(got.query_ids, got.topk(5).ids) for t in row}
    with pytest.raises(ValueError, match=r"lowest scores were not kept .*--no-bottom"):
        got.topk(5, largest=False)
    line = error_line(invoke(runner, "topk", fresh / "sc", "--bottom", code=2))
    assert "lowest scores were not kept" in line
    invoke(runner, "report", fresh / "sc", "--out", fresh / "r.html", "--k", 3)
    text = " ".join((fresh / "r.html").read_text(encoding="utf-8").split())
    assert "top 3 helpful per query" in text and "the most harmful examples were not kept" in text
    assert text.count("Not kept: these scores hold the top-k only") == len(got.query_ids)
    assert text.count("only the top scores were kept") == len(got.query_ids)
    line = error_line(invoke(runner, "score", store, ws.queries, "--model", ws.model, "--no-bottom", "--out",
                             fresh / "sc2", "--no-progress", code=2))
    assert "--no-bottom applies to the shortlist of --index" in line and not (fresh / "sc2" / "scores.json").exists()


def test_ivfpq_index_from_the_cli(ws, runner, store, scores_dir, fresh):
    dim = gradtrace.GradientStore.open(store).dim
    m = next(d for d in (4, 3, 2, 1) if dim % d == 0)
    out = flat(invoke(runner, "index", store, "--out", fresh / "ivf", "--nlist", 2, "--m", m, "--nbits", 4,
                      "--no-progress").stdout)
    assert "Indexed 24 rows" in out and f"PQ {m}x4 bits" in out and "nprobe 2 by default" in out
    invoke(runner, "score", store, ws.queries, "--model", ws.model, "--index", fresh / "ivf", "--rerank", 24,
           "--topk", 5, "--nprobe", 2, "--bottom-nprobe", 2, "--out", fresh / "sc", "--no-progress")
    # every row is a candidate (2 of 2 cells, rerank 24 = rows): exact top-5
    got = gradtrace.Scores.load(fresh / "sc")
    assert got.topk(5).ids == gradtrace.Scores.load(scores_dir).topk(5).ids
    assert got.meta["index"]["nprobe"] == 2 and got.meta["index"]["bottom_nprobe"] == 2


def test_fast_scan_index_from_the_cli(ws, runner, store, scores_dir, fresh):
    out = flat(invoke(runner, "index", store, "--out", fresh / "fs", "--nlist", 2, "--fast-scan",
                      "--no-progress").stdout)
    assert "Indexed 24 rows" in out and "x4 bits fast-scan" in out
    invoke(runner, "score", store, ws.queries, "--model", ws.model, "--index", fresh / "fs", "--rerank", 24,
           "--topk", 5, "--out", fresh / "sc", "--no-progress")
    assert gradtrace.Scores.load(fresh / "sc").topk(5).ids == gradtrace.Scores.load(scores_dir).topk(5).ids
    line = error_line(invoke(runner, "index", store, "--out", fresh / "fs8", "--fast-scan", "--nbits", 8,
                             "--no-progress", code=2))
    assert "fast-scan PQ codes are 4 bits wide" in line and not (fresh / "fs8" / "index.json").exists()


def _changed_copy(store, target):
    """A copy of ``store`` with one value changed (checksums resealed): another store of the same layout."""
    other = copy_store(store, target)
    record = json.loads((other / "shards" / "r00000-000000.json").read_text())
    data = other / "shards" / record["files"]["data"]["name"]
    values = np.fromfile(data, dtype=np.float32)
    values[0] += 1.0
    values.tofile(data)
    record["files"]["data"]["blake2b"] = checksum(values.tobytes())
    reseal_record(other, record)
    return other


def test_index_of_changed_store_is_refused(ws, runner, store, flat_index, fresh):
    other = _changed_copy(store, fresh / "store")
    line = error_line(invoke(runner, "score", other, ws.queries, "--model", ws.model, "--index", flat_index,
                             "--out", fresh / "sc", "--no-progress", code=2))
    assert "was built from another store" in line and "shard r00000-000000 differs" in line
    assert "gradtrace index" in line and not (fresh / "sc" / "scores.json").exists()


def test_index_option_errors(ws, runner, store, flat_index, fresh):
    def error(*args):
        return error_line(invoke(runner, "score", store, ws.queries, "--model", ws.model, "--out", fresh / "sc",
                                 "--no-progress", *args, code=2))

    assert "--rerank applies to the shortlist of --index" in error("--rerank", 10)
    assert "--nprobe applies to the shortlist of --index" in error("--nprobe", 2)
    assert "--bottom-nprobe applies to the shortlist of --index" in error("--bottom-nprobe", 2)
    assert "--rerank 3 is smaller than --topk 5" in error("--index", flat_index, "--rerank", 3, "--topk", 5)
    assert "needs an index built with --normalize" in error("--index", flat_index, "--method", "grad_cos")
    assert "not the full matrix" in error("--index", flat_index, "--matrix", "yes")
    assert "holds no gradtrace index" in error("--index", fresh)
    assert "already holds an index: pass --overwrite" in error_line(
        invoke(runner, "index", store, "--out", flat_index, "--kind", "flat", "--no-progress", code=2))
    assert "needs at least 256 training rows" in error_line(
        invoke(runner, "index", store, "--out", fresh / "i", "--nlist", 2, "--m", 1, "--no-progress", code=2))
    assert not (fresh / "i" / "index.json").exists()


def test_missing_faiss_names_the_extra(ws, runner, store, fresh, monkeypatch):
    monkeypatch.setitem(sys.modules, "faiss", None)
    line = error_line(invoke(runner, "index", store, "--out", fresh / "i", "--kind", "flat", "--no-progress",
                             code=2))
    assert "pip install 'gradtrace[index]'" in line


def _strip_norms(index_dir) -> None:
    """Make ``index_dir`` an index as saved before row norms were recorded (version 1, no row_norms.npy)."""
    index = gradtrace.score.Index.load(index_dir)
    shutil.rmtree(index_dir)
    save_v1(index, index_dir, norms=False)


def test_add_norms_upgrades_an_old_index_and_norm_rows_scores_through_it(ws, runner, store, scores_dir, fresh):
    """--add-norms writes the norms of an index saved without them (no rebuild); score --norm-rows covering the
    store then gives the exact top and bottom from a shortlist of one row, with the exact values."""
    out = fresh / "idx"
    invoke(runner, "index", store, "--out", out, "--kind", "flat", "--no-progress")
    built = gradtrace.score.Index.load(out).row_norms
    _strip_norms(out)
    faiss_bytes = (out / "index.faiss").read_bytes()
    line = error_line(invoke(runner, "score", store, ws.queries, "--model", ws.model, "--index", out, "--norm-rows",
                             24, "--topk", 5, "--out", fresh / "sc", "--no-progress", code=2))
    assert "records no row norms" in line and f"--out {out} --add-norms" in line
    assert "Added the L2 norms of 24 rows" in flat(invoke(runner, "index", store, "--out", out, "--add-norms",
                                                          "--no-progress").stdout)
    loaded = gradtrace.score.Index.load(out)  # saved again, now checksummed; the FAISS data as it was
    assert artifact_file(out, json.loads((out / "index.json").read_text()), "faiss").read_bytes() == faiss_bytes
    dim = gradtrace.GradientStore.open(store).dim
    torch.testing.assert_close(loaded.row_norms, built, rtol=(dim + 2) * 2.0**-24, atol=0)
    assert "nothing to do" in invoke(runner, "index", store, "--out", out, "--add-norms", "--no-progress").stdout
    invoke(runner, "score", store, ws.queries, "--model", ws.model, "--index", out, "--rerank", 5, "--topk", 5,
           "--norm-rows", 24, "--out", fresh / "sc", "--no-progress")
    got, exact = gradtrace.Scores.load(fresh / "sc"), gradtrace.Scores.load(scores_dir)
    assert got.meta["index"]["norm_rows"] == 24
    assert got.topk(5).ids == exact.topk(5).ids and got.topk(5, largest=False).ids == exact.topk(5, largest=False).ids
    scale = float(exact.matrix.abs().max())
    torch.testing.assert_close(got.bottom[0], exact.matrix.gather(1, got.bottom[1]), rtol=1e-5, atol=1e-5 * scale)


def test_norm_rows_and_add_norms_errors(ws, runner, store, flat_index, fresh):
    def error(*args):
        return error_line(invoke(runner, "score", store, ws.queries, "--model", ws.model, "--out", fresh / "sc",
                                 "--no-progress", *args, code=2))

    assert "--norm-rows applies to the shortlist of --index" in error("--norm-rows", 3)
    normalized = fresh / "norm"
    invoke(runner, "index", store, "--out", normalized, "--kind", "flat", "--normalize", "--no-progress")
    assert "every row has norm 1" in error("--index", normalized, "--method", "grad_cos", "--norm-rows", 3)
    assert not (fresh / "sc" / "scores.json").exists()
    other = _changed_copy(store, fresh / "other")
    line = error_line(invoke(runner, "index", other, "--out", flat_index, "--add-norms", "--no-progress", code=2))
    assert "was built from another store" in line
    assert "holds none" in error_line(invoke(runner, "index", store, "--out", fresh / "none", "--add-norms",
                                             "--no-progress", code=2))

"""Fault injection into saved curvature and scores, and the scoring engine's refusals: every corruption is
refused on load with a one-line error naming the file (or block, or query), never scored as good; a save
that fails on a full disk leaves the previous artifact intact; version-1 artifacts (no checksums) still load."""

from __future__ import annotations

import errno
import json
import re
import shutil
import struct
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import gradtrace
from gradtrace.fit.curvature import Curvature, CurvatureError
from gradtrace.fit.methods.influence import CurvatureWeightsWarning
from gradtrace.options import CaptureOptions
from gradtrace.score.engine import ScoringError
from gradtrace.score.scores import ScoresError
from gradtrace.store import artifact
from gradtrace.store.artifact import UncheckedArtifactWarning, checksum
from tests import tiny
from tests.cli import conftest as cli_fixtures
from tests.cli.conftest import error_line, invoke

ws, runner, store, scores_dir = cli_fixtures.ws, cli_fixtures.runner, cli_fixtures.store, cli_fixtures.scores_dir


# -- helpers -----------------------------------------------------------------------------------------
def _lm_data(seed: int = 1, n: int = 16, t: int = 8):
    torch.manual_seed(seed)
    ids = torch.randint(1, tiny.VOCAB, (n + 4, t))
    return [{"input_ids": ids[i:i + 8]} for i in range(0, n, 8)], [{"input_ids": ids[n:]}]


@pytest.fixture(scope="module")
def fit():
    """A K-FAC fit in LoGra space of a tiny Llama, with its training and query gradients."""
    torch.manual_seed(0)
    model = tiny.llama()
    train_batches, query_batches = _lm_data()
    logra = gradtrace.LoGra(rank=4)
    train = gradtrace.collect(model, train_batches, options=CaptureOptions(projection=logra))
    queries = gradtrace.collect(model, query_batches, options=CaptureOptions(projection=logra))
    attr = gradtrace.Attributor("kfac", train, fisher="empirical").fit(model, train_batches)
    return {"model": model, "batches": train_batches, "logra": logra, "train": train, "queries": queries,
            "curvature": attr.method.curvature, "scores": attr.score(queries).matrix}


def _tensor_file(directory: Path, stem: str) -> Path:
    files = sorted(directory.glob(f"{stem}*.safetensors"))
    assert len(files) == 1, files
    return files[0]


def _tensor_offset(path: Path, name: str) -> int:
    """Byte offset in a safetensors file of the first value of tensor ``name``."""
    raw = path.read_bytes()
    (size,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + size])
    return 8 + size + header[name]["data_offsets"][0]


def _flip_bit(path: Path, offset: int, mask: int) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset] ^= mask
    path.write_bytes(bytes(raw))


def _edit_json(path: Path, edit, *, reseal: bool = False) -> None:
    """Edit a manifest in place; ``reseal``: recompute its own checksum (an edit the checksum cannot see)."""
    data = json.loads(path.read_text())
    edit(data)
    if reseal:
        body = {k: v for k, v in data.items() if k != "manifest_blake2b"}
        data["manifest_blake2b"] = checksum(artifact.canonical_json(body))
    path.write_text(json.dumps(data, indent=1))


def _as_version_1(directory: Path, stem: str) -> None:
    """Rewrite a saved artifact the way gradtrace wrote it before checksums (version 1)."""
    manifest = json.loads((directory / f"{stem}.json").read_text())
    tensor_file = directory / manifest.pop("tensors")["file"]
    manifest.pop("manifest_blake2b")
    manifest["version"] = 1
    tensor_file.rename(directory / f"{stem}.safetensors")
    (directory / f"{stem}.json").write_text(json.dumps(manifest, indent=1))


def _load_v1(load, path: Path):
    with pytest.warns(UncheckedArtifactWarning, match="no checksums"):
        return load(path)


def _refused_edits(source: Path, stem: str, cases: dict, load, error: type[Exception]) -> None:
    """Each case ``{name: (edit(tensors, manifest), message)}`` applied to a copy of the version-1 artifact
    ``source`` (``<stem>.safetensors`` + ``<stem>.json``): loading the copy raises ``error`` matching ``message``."""
    from safetensors.torch import load_file, save_file

    for case, (edit, message) in cases.items():
        directory = Path(shutil.copytree(source, source.parent / case.replace(" ", "-")))
        tensors = load_file(directory / f"{stem}.safetensors")
        manifest = json.loads((directory / f"{stem}.json").read_text())
        edit(tensors, manifest)
        save_file(tensors, directory / f"{stem}.safetensors")
        (directory / f"{stem}.json").write_text(json.dumps(manifest))
        with pytest.raises(error, match=message):
            _load_v1(load, directory)


def _disk_full_at(monkeypatch, target: str) -> None:
    """Make the write of the ``target`` file (suffix ``.safetensors``: the tensors, written to a temporary file; or
    ``.json``: the manifest's atomic write) fail with ENOSPC after writing part of it, as a full disk does."""
    real_bytes, real_tensors = artifact.atomic_write_bytes, artifact.write_tensors

    def write(path: Path, data) -> None:
        if path.name.endswith(target):
            path.with_name(f".tmp-{path.name}").write_bytes(bytes(data)[: len(data) // 2])
            path.with_name(f".tmp-{path.name}").unlink()
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        real_bytes(path, data)

    def write_tensors(path: Path, tensors) -> None:
        if target == ".safetensors":
            real_tensors(path, tensors)  # then cut short: the partial temporary file is left for the save to remove
            with open(path, "r+b") as f:
                f.truncate(path.stat().st_size // 2)
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        real_tensors(path, tensors)

    monkeypatch.setattr(artifact, "atomic_write_bytes", write)
    monkeypatch.setattr(artifact, "write_tensors", write_tensors)


# -- curvature ---------------------------------------------------------------------------------------
def test_saved_curvature_is_checksummed_and_scores_exactly_as_in_memory(fit, tmp_path):
    fit["curvature"].save(tmp_path / "c")
    manifest = json.loads((tmp_path / "c" / "curvature.json").read_text())
    assert manifest["version"] == 2 and len(manifest["manifest_blake2b"]) == 32
    assert manifest["tensors"]["file"] == _tensor_file(tmp_path / "c", "curvature").name
    loaded = gradtrace.Attributor("kfac", fit["train"], curvature=tmp_path / "c").score(fit["queries"]).matrix
    assert torch.equal(loaded, fit["scores"])  # same contiguous eigendata: same BLAS paths, same bits
    # a re-save replaces the tensor file, leaves none behind
    fit["curvature"].with_damping(0.5).save(tmp_path / "c", overwrite=True)
    assert Curvature.load(tmp_path / "c").damping == 0.5 and _tensor_file(tmp_path / "c", "curvature")


def test_flipped_bit_in_an_eigenvector_is_refused(fit, tmp_path):
    """Before checksums: all-NaN scores with exit 0."""
    fit["curvature"].save(tmp_path / "c")
    path = _tensor_file(tmp_path / "c", "curvature")
    name = next(k for k in fit["curvature"].blocks if fit["curvature"].blocks[k].__class__.__name__ == "KronEigen")
    _flip_bit(path, _tensor_offset(path, f"{name}::q_rows") + 3, 0x40)  # the top exponent bit of one value
    with pytest.raises(CurvatureError, match=r"corrupted or was replaced \(blake2b checksum mismatch\)"):
        Curvature.load(tmp_path / "c")
    # the same flip in a version-1 save (no checksum) loads, but is never scored as good
    _as_version_1(tmp_path / "c", "curvature")
    curvature = _load_v1(Curvature.load, tmp_path / "c")
    names = str(list(fit["queries"].ids))
    with pytest.raises(ScoringError, match=rf"prepared \(preconditioned\) gradients of queries {re.escape(names)}"):
        gradtrace.Attributor("kfac", fit["train"], curvature=curvature).score(fit["queries"])


def test_saving_equal_tensors_again_repairs_a_damaged_tensor_file(fit, tmp_path):
    """A re-save of the same fit names the same tensor file; it is rewritten when the file on disk was damaged
    since (it used to be kept, so the artifact stayed unreadable after being saved again)."""
    fit["curvature"].save(tmp_path / "c")
    path = _tensor_file(tmp_path / "c", "curvature")
    _flip_bit(path, path.stat().st_size - 2, 0x01)
    with pytest.raises(CurvatureError, match="corrupted or was replaced"):
        Curvature.load(tmp_path / "c")
    fit["curvature"].save(tmp_path / "c", overwrite=True)
    assert _tensor_file(tmp_path / "c", "curvature") == path
    loaded = Curvature.load(tmp_path / "c")
    for name, eig in fit["curvature"].blocks.items():
        torch.testing.assert_close(loaded.blocks[name].eigenvalues, eig.eigenvalues, rtol=0, atol=0)


def test_edited_truncated_replaced_or_missing_curvature_files_are_refused(fit, tmp_path):
    curvature = fit["curvature"]
    original = tmp_path / "c"
    curvature.save(original)

    def copy(name: str) -> Path:
        return Path(shutil.copytree(original, tmp_path / name))

    removed = copy("removed")  # a block removed from curvature.json
    _edit_json(removed / "curvature.json", lambda d: d["blocks"].pop(0))
    with pytest.raises(CurvatureError, match=r"curvature\.json was edited or corrupted"):
        Curvature.load(removed)
    truncated = copy("truncated")
    path = _tensor_file(truncated, "curvature")
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(CurvatureError, match=r"has \d+ bytes, the manifest records \d+ \(truncated or replaced\)"):
        Curvature.load(truncated)
    replaced = copy("replaced")  # another fit's eigendata, a file of the same size
    path = _tensor_file(replaced, "curvature")
    doubled = Curvature(curvature.kind, curvature.spec, dict(curvature.blocks), curvature.fisher)
    first = next(iter(doubled.blocks))
    doubled.blocks[first] = replace(doubled.blocks[first], eigenvalues=doubled.blocks[first].eigenvalues * 2)
    doubled.save(tmp_path / "doubled")
    shutil.copyfile(_tensor_file(tmp_path / "doubled", "curvature"), path)
    with pytest.raises(CurvatureError, match="blake2b checksum mismatch"):
        Curvature.load(replaced)
    missing = copy("missing")
    _tensor_file(missing, "curvature").unlink()
    with pytest.raises(CurvatureError, match=r"is missing \(the curvature manifest names it\)"):
        Curvature.load(missing)
    outside = copy("outside")  # a manifest (checksum recomputed) naming a file outside the directory
    _edit_json(outside / "curvature.json", lambda d: d["tensors"].update(file="../c/" + path.name), reseal=True)
    with pytest.raises(CurvatureError, match=r"names the tensor file '\.\./c/.*not a file of"):
        Curvature.load(outside)
    future = copy("future")
    _edit_json(future / "curvature.json", lambda d: d.update(version=3))
    with pytest.raises(CurvatureError, match="curvature of version 3; this gradtrace reads versions 1 and 2"):
        Curvature.load(future)


def test_version_1_curvature_loads_with_a_warning_and_its_structure_is_checked(fit, tmp_path):
    curvature = fit["curvature"]
    curvature.save(tmp_path / "c")
    _as_version_1(tmp_path / "c", "curvature")
    scores = gradtrace.Attributor("kfac", fit["train"], curvature=_load_v1(Curvature.load, tmp_path / "c"))
    assert torch.equal(scores.score(fit["queries"]).matrix, fit["scores"])

    kron = next(n for n, e in curvature.blocks.items() if e.__class__.__name__ == "KronEigen")
    cases = {  # what a version-1 directory can hold, and the one-line refusal of each
        "missing tensor": (lambda t, m: t.pop(f"{kron}::eigenvalues"), f"eigenvalues of block {kron} are missing"),
        "edited shape": (lambda t, m: m["blocks"][[b["name"] for b in m["blocks"]].index(kron)].update(n_rows=3),
                         f"of block {kron} is torch.float32 .* expected float32"),
        "removed block": (lambda t, m: m["blocks"].pop([b["name"] for b in m["blocks"]].index(kron)),
                          "tensors of no block listed in curvature.json"),
        "removed block and tensors": (lambda t, m: [m["blocks"].pop([b["name"] for b in m["blocks"]].index(kron)),
                                                    [t.pop(k) for k in list(t) if k.startswith(f"{kron}::")]],
                                      rf"no block for \['{kron}'\]"),
        "NaN eigenvector": (lambda t, m: t[f"{kron}::q_rows"].view(-1)[0].fill_(float("nan")),
                            f"q_rows of block {kron} holds NaN/inf"),
    }
    _refused_edits(tmp_path / "c", "curvature", cases, Curvature.load, CurvatureError)
    truncated = Path(shutil.copytree(tmp_path / "c", tmp_path / "truncated"))
    (truncated / "curvature.safetensors").write_bytes((truncated / "curvature.safetensors").read_bytes()[:50])
    with pytest.raises(CurvatureError, match="is not a readable safetensors file"):
        _load_v1(Curvature.load, truncated)


def test_curvature_bound_to_gradients_must_cover_their_parameters_and_be_of_the_method_kind(fit):
    curvature = fit["curvature"]
    name = next(iter(curvature.blocks))
    partial = Curvature(curvature.kind, curvature.spec, {k: v for k, v in curvature.blocks.items() if k != name},
                        curvature.fisher)
    with pytest.raises(CurvatureError, match=rf"kfac: the curvature blocks do not cover .*no block for \['{name}'\]"):
        gradtrace.Attributor("kfac", fit["train"], curvature=partial).score(fit["queries"])
    ekfac = Curvature("ekfac", curvature.spec, curvature.blocks, curvature.fisher)
    with pytest.raises(CurvatureError, match="'ekfac' fit; kfac uses 'kfac' curvature: use it with method 'ekfac'"):
        gradtrace.Attributor("kfac", fit["train"], curvature=ekfac)
    with pytest.raises(CurvatureError, match="'kfac' fit; ggn uses 'fisher'"):
        gradtrace.Attributor("ggn", fit["train"], curvature=curvature)
    gradtrace.Attributor("logra", fit["train"], curvature=curvature).score(fit["queries"])  # logra takes any kind


def test_curvature_fitted_at_other_weights_warns(fit):
    model = tiny.llama()
    model.load_state_dict(fit["model"].state_dict())
    with torch.no_grad():
        model.model.norm.weight.mul_(1.5)
    train = gradtrace.collect(model, fit["batches"], options=CaptureOptions(projection=fit["logra"]))
    attr = gradtrace.Attributor("kfac", train, curvature=fit["curvature"])
    with pytest.warns(CurvatureWeightsWarning, match="fitted at other weights"):
        attr.score(train)


# -- scores ------------------------------------------------------------------------------------------
def _scores(matrix: torch.Tensor | None = None) -> gradtrace.Scores:
    gen = torch.Generator().manual_seed(0)
    matrix = torch.randn(3, 8, generator=gen) if matrix is None else matrix
    return gradtrace.Scores(train_ids=[f"t{i}" for i in range(8)], query_ids=["a", "b", "c"], method="grad_dot",
                            matrix=matrix, top=torch.topk(matrix, 2, dim=1), bottom=None)


def test_saved_scores_are_checksummed_and_round_trip(tmp_path):
    scores = _scores()
    scores.save(tmp_path / "s")
    back = gradtrace.Scores.load(tmp_path / "s")
    assert torch.equal(back.matrix, scores.matrix) and torch.equal(back.top[1], scores.top[1])
    assert back.train_ids == scores.train_ids and back.query_ids == scores.query_ids
    assert json.loads((tmp_path / "s" / "scores.json").read_text())["version"] == 2


def test_corrupted_scores_are_refused(tmp_path):
    _scores().save(tmp_path / "s")
    flipped = Path(shutil.copytree(tmp_path / "s", tmp_path / "flipped"))
    path = _tensor_file(flipped, "scores")
    _flip_bit(path, _tensor_offset(path, "matrix") + 3, 0x40)  # before: 3.5e36 at rank 1
    with pytest.raises(ScoresError, match="blake2b checksum mismatch"):
        gradtrace.Scores.load(flipped)
    reversed_ids = Path(shutil.copytree(tmp_path / "s", tmp_path / "reversed"))
    _edit_json(reversed_ids / "scores.json", lambda d: d["train_ids"].reverse())
    with pytest.raises(ScoresError, match=r"scores\.json was edited or corrupted"):
        gradtrace.Scores.load(reversed_ids)
    truncated = Path(shutil.copytree(tmp_path / "s", tmp_path / "truncated"))
    path = _tensor_file(truncated, "scores")
    path.write_bytes(path.read_bytes()[:-7])
    with pytest.raises(ScoresError, match=r"truncated or replaced"):
        gradtrace.Scores.load(truncated)
    garbage = Path(shutil.copytree(tmp_path / "s", tmp_path / "garbage"))
    (garbage / "scores.json").write_text("{not json")
    with pytest.raises(ScoresError, match="is not readable JSON"):
        gradtrace.Scores.load(garbage)


def test_version_1_scores_load_with_a_warning_and_are_checked(tmp_path):

    _scores().save(tmp_path / "s")
    _as_version_1(tmp_path / "s", "scores")
    assert torch.equal(_load_v1(gradtrace.Scores.load, tmp_path / "s").matrix, _scores().matrix)
    cases = {
        "NaN score": (lambda t, m: t["matrix"].__setitem__((1, 4), float("nan")),
                      r"scores of 1 queries hold NaN/inf \(query ids \['b'\]\)"),
        "missing indices": (lambda t, m: t.pop("top_indices"), "top-k has values or indices missing"),
        "edited ids": (lambda t, m: m["train_ids"].pop(), r"matrix of shape \(3, 8\) for 3 queries and 7"),
        "index out of range": (lambda t, m: t["top_indices"].__setitem__((0, 0), 99), "top indices must be int64"),
    }
    _refused_edits(tmp_path / "s", "scores", cases, gradtrace.Scores.load, ScoresError)


def test_non_finite_scores_are_refused_so_topk_never_ranks_nan_first():
    matrix = torch.randn(3, 8)
    matrix[2, 5] = float("nan")
    with pytest.raises(ScoresError, match=r"query ids \['c'\]"):
        _scores(matrix)
    with pytest.raises(ValueError, match="k must be a non-negative integer, got -3"):
        _scores().topk(-3)


@pytest.mark.parametrize("stem_of", ["curvature", "scores"])
@pytest.mark.parametrize("fails_at", [".safetensors", ".json"])
def test_a_save_that_fails_on_a_full_disk_keeps_the_previous_artifact(fit, tmp_path, monkeypatch, stem_of, fails_at):
    if stem_of == "curvature":
        first, second, load = fit["curvature"], fit["curvature"].with_damping(7.0), Curvature.load
        same = lambda a, b: a.damping == b.damping
    else:
        first, second, load = _scores(), _scores(torch.zeros(3, 8)), gradtrace.Scores.load
        same = lambda a, b: torch.equal(a.matrix, b.matrix)
    first.save(tmp_path / "a")
    if fails_at == ".safetensors" and stem_of == "curvature":  # same eigendata: the tensor file is reused
        second = Curvature(first.kind, first.spec, dict(first.blocks), first.fisher, 7.0)
        name = next(iter(second.blocks))
        second.blocks[name] = replace(second.blocks[name], eigenvalues=second.blocks[name].eigenvalues * 2)
    before = sorted(p.name for p in (tmp_path / "a").iterdir())
    _disk_full_at(monkeypatch, fails_at)
    with pytest.raises(OSError, match="No space left on device"):
        second.save(tmp_path / "a", overwrite=True)
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == before  # nothing half-written left behind
    assert same(load(tmp_path / "a"), first)


def test_tensors_sharing_memory_are_saved_each_with_its_own_bytes(tmp_path):
    """safetensors refuses two names for one storage; write_artifact copies the later ones (views, repeats, a
    transposed eigenbasis) and writes the others from their own memory."""
    base = torch.arange(12.0).reshape(3, 4)
    tensors = {"a": base, "view": base[1:], "again": base, "transposed": base.t()}
    artifact.write_artifact(tmp_path / "x", "x", "gradtrace-test", 2, {}, tensors)
    _, loaded = artifact.read_artifact(tmp_path / "x", "x", "gradtrace-test", 2, what="test")
    for name, tensor in tensors.items():  # bytes read back: no arithmetic between the sides
        assert torch.equal(loaded[name], tensor), name
    assert not list((tmp_path / "x").glob(".tmp-*"))  # the temporary file was renamed


# -- the scoring engine ------------------------------------------------------------------------------
def test_engine_refuses_non_finite_scores_naming_queries_and_training_rows():
    model = tiny.MLP()
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(12, 7, generator=gen), torch.randint(0, 4, (12,), generator=gen)
    train = gradtrace.collect(model, [(x[:6], y[:6]), (x[6:], y[6:])])
    vectors = train.vectors.clone()
    vectors[7, 3] = float("inf")
    poisoned = gradtrace.GradientSet(vectors, list(train.ids), train.spec)
    with pytest.raises(ScoringError, match=rf"queries \['{train.ids[0]}', .* training rows 7\.\.7 "
                                           rf"\(ids \['{train.ids[7]}'\]\) of the block starting at row 6"):
        gradtrace.Attributor("grad_dot", poisoned, block_rows=6).score(train)
    with pytest.raises(ScoringError, match=rf"gradients of queries \['{train.ids[7]}'\] hold NaN/inf"):
        gradtrace.Attributor("grad_dot", train).score(poisoned)


def test_engine_options_out_of_range_are_clear_errors():
    model = tiny.MLP()
    train = gradtrace.collect(model, [(torch.randn(4, 7), torch.randint(0, 4, (4,)))])
    for bad in (-1, 0, 2.5):
        with pytest.raises(ValueError, match=f"block_rows must be an integer >= 1, got {bad}"):
            gradtrace.Attributor("grad_dot", train, block_rows=bad)
    with pytest.raises(ValueError, match="matrix_bytes must be an integer >= 0, got -1"):
        gradtrace.Attributor("grad_dot", train, matrix_bytes=-1)
    attr = gradtrace.Attributor("grad_dot", train)
    with pytest.raises(ValueError, match="topk must be an integer >= 0, got -3"):
        attr.score(train, topk=-3)
    with pytest.raises(ValueError, match="matrix must be True, False or 'auto', got 'yes'"):
        attr.score(train, matrix="yes")


# -- the command line --------------------------------------------------------------------------------
def test_cli_score_on_a_full_disk_is_one_line_and_keeps_saved_scores(ws, runner, store, scores_dir, tmp_path,
                                                                     monkeypatch):
    out = Path(shutil.copytree(scores_dir, tmp_path / "scores"))
    before = gradtrace.Scores.load(out)
    _disk_full_at(monkeypatch, ".safetensors")
    result = invoke(runner, "score", store, ws.queries, "--model", ws.model, "--out", out, "--topk", 3,
                    "--overwrite", "--no-progress", code=1)
    assert "could not save the scores in" in error_line(result) and "No space left on device" in error_line(result)
    monkeypatch.undo()
    assert torch.equal(gradtrace.Scores.load(out).top[0], before.top[0])


def test_cli_refuses_corrupted_scores_and_curvature(ws, runner, store, scores_dir, tmp_path):
    flipped = Path(shutil.copytree(scores_dir, tmp_path / "scores"))
    path = _tensor_file(flipped, "scores")
    _flip_bit(path, _tensor_offset(path, "top_values") + 3, 0x40)
    assert "blake2b checksum mismatch" in error_line(invoke(runner, "topk", flipped, code=2))
    invoke(runner, "fit", store, "--method", "logra", "--out", tmp_path / "c", "--no-progress")
    _edit_json(tmp_path / "c" / "curvature.json", lambda d: d["blocks"].pop())
    result = invoke(runner, "score", store, ws.queries, "--method", "logra", "--curvature", tmp_path / "c", "--out",
                    tmp_path / "s", "--no-progress", code=2)
    assert "curvature.json was edited or corrupted" in error_line(result)

"""Provenance records: versions, data fingerprints and relative paths (issue #17, repeatable runs)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from gradtrace.common.provenance import environment, file_fingerprint, relative_path


def test_environment_names_the_versions_that_shape_an_artifact():
    env = environment()
    assert env["torch"] == torch.__version__.split("+")[0] or env["torch"] == torch.__version__
    assert env["gradtrace"] and env["python"].count(".") == 2
    assert environment(["no-such-package-xyz"])["no-such-package-xyz"] is None


def test_file_fingerprint_changes_with_one_byte_and_not_with_the_name(tmp_path):
    a = tmp_path / "a.jsonl"
    a.write_bytes(b'{"text": "one"}\n{"text": "two"}\n')
    b = tmp_path / "b.jsonl"
    b.write_bytes(a.read_bytes())
    fa, fb = file_fingerprint(a, rows=2), file_fingerprint(b)
    assert fa["blake2b"] == fb["blake2b"] and fa["bytes"] == 32 and fa["rows"] == 2 and "rows" not in fb
    b.write_bytes(b'{"text": "one"}\n{"text": "twO"}\n')
    assert file_fingerprint(b)["blake2b"] != fa["blake2b"]


def test_folder_fingerprint_covers_names_and_bytes(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "x.arrow").write_bytes(b"12")
    (tmp_path / "d" / "y.json").write_bytes(b"{}")
    first = file_fingerprint(tmp_path / "d")
    assert first["bytes"] == 4
    (tmp_path / "d" / "y.json").rename(tmp_path / "d" / "z.json")
    assert file_fingerprint(tmp_path / "d")["blake2b"] != first["blake2b"]
    with pytest.raises(FileNotFoundError, match="no such file"):
        file_fingerprint(tmp_path / "missing")


def test_relative_path_under_beside_and_far(tmp_path):
    run = tmp_path / "project" / "run"
    run.mkdir(parents=True)
    assert relative_path(run / "store", run) == "store"
    assert relative_path(tmp_path / "project" / "data.jsonl", run) == "../data.jsonl"
    far = relative_path(tmp_path / "elsewhere" / "data.jsonl", run)
    assert os.path.isabs(far) and Path(far) == (tmp_path / "elsewhere" / "data.jsonl").resolve()

"""Every failure of the machine is one line naming the file and the real cause, and loses nothing already saved.

A full disk, a read-only file system, an I/O error or a quota, a symbolic link loop: every command that writes
reports them as one ``Error:`` line with the path the user gave (never a temporary name) and the ``errno`` name,
never a traceback, and what was saved there before is byte-identical afterwards. Two ways to fail the machine:

* ``os.fsync`` made to fail with each errno (every write of an artifact, a store, a report or an export ends in
  one): runs anywhere;
* a real tmpfs that is full or mounted read-only, where this machine lets a test mount one (root with
  CAP_SYS_ADMIN); skipped elsewhere.
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from gradtrace.cli.errors import os_error_line
from gradtrace.common.paths import why_missing
from tests.cli import conftest as cli_fixtures
from tests.cli.conftest import error_line, invoke
from tests.reliability.test_outputs import _snapshot

ws, runner, store, scores_dir = cli_fixtures.ws, cli_fixtures.runner, cli_fixtures.store, cli_fixtures.scores_dir


def _writes(ws, store, scores_dir, out: Path) -> dict[str, tuple[list[object], int]]:
    """Each writing command with its output under ``out`` (and the exit code a failed save ends with: ``score``
    has done its work when the save fails, so it ends with 1, as a run that failed does)."""
    return {
        "collect": (["collect", ws.model, ws.train, "--out", out / "store", "--rank", 4, "--no-progress"], 2),
        "score": (["score", store, ws.queries, "--model", ws.model, "--out", out / "scores", "--no-progress"], 1),
        "score --export": (["score", store, ws.queries, "--model", ws.model, "--out", out / "s2", "--export",
                            out / "e.csv", "--no-progress"], 1),
        "fit": (["fit", store, "--method", "logra", "--out", out / "curvature", "--no-progress"], 2),
        "index": (["index", store, "--out", out / "index", "--kind", "flat", "--no-progress"], 2),
        "report": (["report", scores_dir, "--out", out / "report.html"], 2),
        "self-influence": (["self-influence", store, "--out", out / "self.csv"], 2),
    }


def _output_of(args: list[object]) -> Path:
    flag = "--export" if "--export" in args else "--out"
    return Path(str(args[args.index(flag) + 1]))


def _fail_fsync(monkeypatch, code: int) -> None:
    def fsync(fd: int) -> None:
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(os, "fsync", fsync)


CASES = [("collect", errno.ENOSPC)] + [(c, e) for c in ("score", "score --export", "fit", "index", "report",
                                                        "self-influence")
                                       for e in (errno.ENOSPC, errno.EROFS, errno.EIO, errno.EDQUOT)]


@pytest.mark.parametrize("command,code", CASES, ids=[f"{c}-{errno.errorcode[e]}" for c, e in CASES])
def test_a_failing_write_is_one_line_naming_the_output_and_keeps_what_was_there(ws, runner, store, scores_dir,
                                                                                 tmp_path, monkeypatch, command, code):
    args, exit_code = _writes(ws, store, scores_dir, tmp_path)[command]
    invoke(runner, *args)  # a first save, to be kept whole
    output = _output_of(args)
    before = _snapshot(tmp_path)
    with monkeypatch.context() as failing:
        _fail_fsync(failing, code)
        result = invoke(runner, *args, "--overwrite" if command != "collect" else "--resume", code=exit_code) \
            if command != "collect" else invoke(runner, *args[:-1], "--overwrite", "--no-progress", code=exit_code)
    line = error_line(result)
    assert os.strerror(code) in line and errno.errorcode[code] in line, line
    assert str(output) in line or str(output.parent) in line, line
    assert ".tmp-" not in line, line  # the user's path, not a temporary name
    if command != "collect":  # a store being overwritten is replaced as it is written (its own tests cover that)
        assert _snapshot(tmp_path) == before, "a failed save changed what was saved before"


def test_a_full_disk_during_a_new_save_leaves_no_partial_file(ws, runner, store, scores_dir, tmp_path, monkeypatch):
    for command, (args, exit_code) in _writes(ws, store, scores_dir, tmp_path).items():
        if command == "collect":
            continue
        with monkeypatch.context() as failing:
            _fail_fsync(failing, errno.ENOSPC)
            error_line(invoke(runner, *args, code=exit_code))
        left = [p for p in tmp_path.rglob("*") if p.is_file()]
        assert left == [], (command, left)


# --------------------------------------------------------------------------------------- symbolic link loops
def _loop(tmp_path: Path) -> Path:
    loop = tmp_path / "loop"
    os.symlink(loop, loop)
    return loop


def test_every_input_that_is_a_symbolic_link_loop_is_named_as_one(ws, runner, store, scores_dir, tmp_path):
    loop = _loop(tmp_path)
    out = tmp_path / "out"
    cases = {
        "collect MODEL": ["collect", loop, ws.train, "--out", out / "a", "--no-progress"],
        "collect DATA": ["collect", ws.model, loop, "--out", out / "b", "--no-progress"],
        "score STORE": ["score", loop, ws.queries, "--model", ws.model, "--out", out / "c", "--no-progress"],
        "score QUERIES": ["score", store, loop, "--model", ws.model, "--out", out / "d", "--no-progress"],
        "fit STORE": ["fit", loop, "--method", "logra", "--out", out / "e", "--no-progress"],
        "index STORE": ["index", loop, "--out", out / "f", "--no-progress"],
        "topk SCORES": ["topk", loop],
        "inspect PATH": ["inspect", loop],
        "self-influence STORE": ["self-influence", loop],
        "report SCORES": ["report", loop, "--out", out / "r.html"],
    }
    for what, args in cases.items():
        line = error_line(invoke(runner, *args, code=2))
        assert str(loop) in line and ("symbolic link loop" in line or "Too many levels of symbolic links" in line), \
            (what, line)
        assert "does not exist" not in line, (what, line)
    assert not out.exists()


@pytest.mark.parametrize("flag", ["--out", "--export"])
def test_every_output_under_a_symbolic_link_loop_is_refused_before_any_work(ws, runner, store, scores_dir, tmp_path,
                                                                           flag):
    loop = _loop(tmp_path)
    for command, (args, _) in _writes(ws, store, scores_dir, loop).items():
        if flag == "--export" and "--export" not in args:
            continue
        line = error_line(invoke(runner, *args, code=2))
        assert "symbolic link loop (ELOOP)" in line and str(loop) in line, (command, line)


def test_an_output_under_a_file_names_the_file(ws, runner, store, tmp_path):
    blocking = tmp_path / "afile"
    blocking.write_text("mine")
    for args in (["collect", ws.model, ws.train, "--out", blocking / "store", "--no-progress"],
                 ["fit", store, "--method", "logra", "--out", blocking / "c", "--no-progress"]):
        line = error_line(invoke(runner, *args, code=2))
        assert f"{blocking} is a file, not a directory (ENOTDIR)" in line, line
    assert blocking.read_text() == "mine"


def test_why_missing_names_the_real_cause(tmp_path):
    assert why_missing(tmp_path / "nothing") == "does not exist"
    assert why_missing(_loop(tmp_path)) == "is a symbolic link loop (ELOOP)"
    dangling = tmp_path / "dangling"
    os.symlink(tmp_path / "gone", dangling)
    assert why_missing(dangling) == f"is a symbolic link to {tmp_path / 'gone'}, which does not exist"


def test_os_error_line_names_the_file_the_errno_and_what_to_do():
    line = os_error_line(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "/data/scores"))
    assert line == "/data/scores: No space left on device (ENOSPC); free space there, or write elsewhere"
    line = os_error_line(OSError(errno.EXDEV, os.strerror(errno.EXDEV), "/a", None, "/b"))
    assert line == f"/a -> /b: {os.strerror(errno.EXDEV)} (EXDEV)"
    assert os_error_line(FileNotFoundError("no store at /x")) == "no store at /x"


# ------------------------------------------------------------------------------ a real full or read-only disk
@pytest.fixture
def tmpfs(tmp_path):
    """``mount(kind)``: a tmpfs of 8 KiB with 4 KiB already used (``full``) or mounted read-only (``ro``)."""
    mounted: list[Path] = []

    def mount(kind: str) -> Path:
        target = tmp_path / f"tmpfs-{kind}"
        target.mkdir()
        options = "size=8k" if kind == "full" else "size=64k,ro"
        if shutil.which("mount") is None or subprocess.run(
                ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(target)], capture_output=True).returncode != 0:
            pytest.skip("this machine does not let a test mount a tmpfs")
        mounted.append(target)
        if kind == "full":
            (target / "filler").write_bytes(b"x" * 4096)
        return target

    yield mount
    for target in mounted:
        subprocess.run(["umount", str(target)], capture_output=True)


@pytest.mark.parametrize("kind", ["full", "ro"])
def test_a_real_full_or_read_only_file_system_is_one_line_for_every_command(ws, runner, store, scores_dir, tmpfs,
                                                                           kind):
    root = tmpfs(kind)
    for command, (args, _) in _writes(ws, store, scores_dir, root).items():
        result = runner.invoke(cli_fixtures.app, [str(a) for a in args])
        if result.exit_code == 0:  # small enough to fit in what is left
            assert kind == "full", (command, result.output)
            continue
        line = error_line(result)
        cause = "No space left on device" if kind == "full" else "Read-only file system"
        if kind == "full" and " free: free space" in line:  # refused up front from the planned size
            assert str(root) in line, (command, line)
            continue
        assert cause in line and str(root) in line and ".tmp-" not in line, (command, line)
    left = sorted(p.name for p in root.rglob("*") if p.is_file())
    assert all(not name.startswith(".tmp") for name in left), left

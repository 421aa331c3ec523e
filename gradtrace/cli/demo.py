"""``gradtrace demo``: run the bundled end-to-end demo (:mod:`gradtrace.demo`)."""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from pathlib import Path

from .commands import QUIET_PROGRESS, cli, progress_flag
from .errors import CliError

__all__ = ["OPTIONS", "DemoCommand", "run"]


@dataclass(kw_only=True)
class DemoCommand:
    """Options of ``gradtrace demo``."""

    out: Path = field(default=Path("gradtrace-demo"), metadata=cli(
        "Directory for the demo's model, stores and scores.", "--out", "-o", metavar="DIR"))
    progress: bool = progress_flag(QUIET_PROGRESS)


OPTIONS = DemoCommand


def run(opts: DemoCommand) -> None:
    """Run a small end-to-end demo (train a tiny model, collect, score, show the top examples).

    Example: gradtrace demo --out ./demo
    """
    try:
        demo = importlib.import_module("gradtrace.demo")
    except ImportError as err:
        raise CliError(f"the demo is not available in this installation of gradtrace ({err})", exit_code=1) from None
    demo.main(out_dir=opts.out)

"""The ``gradtrace`` command line: one typer app, one module per command.

Commands are generated from their options dataclasses (:mod:`gradtrace.cli.commands`), so ``--help``,
config files and the resolved configuration written next to every output all come from one place.
"""

from __future__ import annotations

import typer

from . import attribute, collect, demo, fit, index, inspect, metagrad, report, score, self_influence, topk
from .commands import make_command
from .console import set_width

__all__ = ["app", "main"]

app = typer.Typer(
    name="gradtrace",
    help="Training data attribution for language models: which training examples made my model do this?\n\n"
         "Typical run: gradtrace collect (training gradients) -> gradtrace score (queries against them) -> "
         "gradtrace topk (the most influential examples). Scores: positive = the training example helps the "
         "query (lowers its loss).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version(value: bool) -> None:
    if value:
        from ..version import __version__

        typer.echo(f"gradtrace {__version__}")
        raise typer.Exit()


@app.callback()
def _root(version: bool = typer.Option(False, "--version", "-V", callback=_version, is_eager=True,
                                       help="Print the gradtrace version and exit."),
          width: int | None = typer.Option(None, "--width", min=20, metavar="N", help=(
              "Columns of the commands' output (before the command: gradtrace --width 120 topk ...). Default: the "
              "terminal's width; output to a pipe or a file is not cut or wrapped."))) -> None:
    """Training data attribution for language models."""
    set_width(width)


for _name, _module in (("collect", collect), ("fit", fit), ("score", score), ("topk", topk), ("inspect", inspect),
                       ("report", report), ("index", index), ("self-influence", self_influence), ("demo", demo),
                       ("attribute", attribute), ("metagrad", metagrad)):
    app.command(_name)(make_command(_name, _module.OPTIONS, _module.run))


def main() -> None:
    """Entry point of the ``gradtrace`` console script."""
    app(prog_name="gradtrace")

"""Command options as typed, documented dataclasses; the typer commands are generated from them.

Each command declares one dataclass whose fields are its options (nested dataclasses group options by
concern: model, data, projection, store...; a group may nest a Python API option object of
:mod:`gradtrace.options`, whose fields' ``help`` metadata becomes their ``--help``, so that the command builds
the very object the Python call takes). A field's ``metadata=cli(...)`` carries its one-line help and
flags (:func:`cli`). :func:`make_command` turns the dataclass into a typer command
(every field becomes a parameter, each group a help panel), adds ``--config FILE`` (values from a YAML or
TOML file, overridden by the command line) and calls the command's function with a filled-in instance.
The same dataclass gives the fully resolved configuration written next to every output
(:func:`resolved`), so the help text, the config-file keys and the saved configuration cannot drift apart.

Every numeric option is checked by :func:`check_values` before the command runs (so before any model or store
work), from its range (:class:`gradtrace.common.checks.Range`: ``min`` / ``max`` / ``valid`` in its metadata; a
float must be finite even without bounds): a value outside it -- ``nan``, ``inf`` and ``-1`` included, which the
float parser takes -- ends the command with one ``Error: --flag must be ..., got ...`` line and exit code 2.
"""

from __future__ import annotations

import inspect
import typing
from collections.abc import Callable
from dataclasses import MISSING, dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer

from ..common.checks import Range, range_from
from .config import CONFIG_HELP, load_config, resolve_against
from .errors import CliError, fail, reported_errors

__all__ = ["COMMANDS", "QUIET_PROGRESS", "Group", "api_field", "check_values", "cli", "config_keys", "flat_fields",
           "make_command", "numeric_kind", "progress_flag", "resolved"]

T = TypeVar("T")

COMMANDS: dict[str, type] = {}
"""command name -> its options dataclass (for config-file validation across commands)."""


def cli(help: str, *flags: str, argument: bool = False, **typer_kwargs: Any) -> dict[str, Any]:
    """``field(metadata=cli(...))``: how a dataclass field appears on the command line.

    ``help``: its one-line doc; ``flags``: its option flags (default ``--field-name``); ``argument``: a
    positional argument instead of an option; ``typer_kwargs``: more typer settings (``metavar``), except the
    range of a numeric option -- ``min`` / ``max`` (``min_open``: strictly above ``min``) or ``valid`` (a
    :class:`~gradtrace.common.checks.Range`) -- which :func:`check_values` checks, NaN and inf included.
    The field's default is the option's default; a field without one is a required option or argument.
    """
    kind = "argument" if argument else "option"
    bounds = {key: typer_kwargs.pop(key) for key in ("min", "max", "min_open", "valid") if key in typer_kwargs}
    return {"cli": {"kind": kind, "decls": flags, "help": help, "kwargs": typer_kwargs, "bounds": bounds}}


def api_field(cls: type, name: str, *flags: str) -> dict[str, Any]:
    """``field(metadata=api_field(IndexOptions, "nlist"))``: the ``cli()`` metadata of an option that sets field
    ``name`` of the Python API option object ``cls`` (:mod:`gradtrace.options`), for a command that builds that
    object from its options: the field's ``help`` and range, one definition for both; ``flags`` as for
    :func:`cli`."""
    spec = next(f for f in fields(cls) if f.name == name)
    bounds = {key: spec.metadata[key] for key in ("min", "max", "min_open", "valid") if key in spec.metadata}
    return cli(spec.metadata["help"], *flags, **bounds)


QUIET_PROGRESS = ("Show progress (this command has no long loop, so there is none to show; --no-progress is "
                  "accepted, as by every command).")
"""The ``--progress/--no-progress`` help of a command that shows no progress."""


def progress_flag(help: str = "Show progress bars and the time profile.") -> Any:
    """The ``progress: bool`` field of a command's options: ``--progress/--no-progress``, on by default. Every
    command has one (a script may pass ``--no-progress`` to all); the bars are tqdm on a terminal and plain lines
    in a log (:func:`gradtrace.common.progress.progress_bar`)."""
    return field(default=True, metadata=cli(help, "--progress/--no-progress"))


class Group:
    """Base of the dataclasses grouping options by concern; ``panel`` titles their block in ``--help``."""

    panel: typing.ClassVar[str | None] = None


@dataclass(frozen=True)
class FlatField:
    """One command-line parameter: its field name, type, default (``MISSING``: required), ``cli()`` info
    and help panel."""

    name: str
    type: Any
    default: Any
    info: dict[str, Any]
    panel: str | None

    @property
    def range(self) -> Range | None:
        """The values the option accepts (None: not numeric, or an integer option without bounds)."""
        kind = numeric_kind(self.type)
        return None if kind is None else range_from(kind, self.info.get("bounds", {}))

    @property
    def flag(self) -> str:
        """How errors name the option: its first long flag (``--damping``), or an argument's metavar."""
        if self.info["kind"] == "argument":
            return self.info["kwargs"].get("metavar", self.name.upper())
        longs = [decl.split("/")[0] for decl in self.info["decls"] if decl.startswith("--")]
        return longs[0] if longs else f"--{self.name.replace('_', '-')}"


def numeric_kind(kind: Any) -> type | None:
    """``int`` / ``float`` for an option of type ``int``, ``float``, ``X | None`` or ``list[X]`` of them, else
    None (``bool`` is not numeric)."""
    if kind in (int, float):
        return kind
    args = [arg for arg in typing.get_args(kind) if arg is not type(None)]
    return args[0] if len(args) == 1 and args[0] in (int, float) else None


def check_values(specs: list[FlatField], values: dict[str, Any]) -> None:
    """Refuse a numeric option's value outside its range (every item of a repeated one): a ValueError naming the
    flag and the range, which the command reports on one line (exit 2). None (an option not given) passes."""
    for spec in specs:
        rule, value = spec.range, values.get(spec.name)
        if rule is None or value is None:
            continue
        for item in value if isinstance(value, (list, tuple)) else [value]:
            rule.check(item, spec.flag)


def flat_fields(cls: type, panel: str | None = None) -> list[FlatField]:
    """The parameters of options dataclass ``cls`` in declaration order, nested groups flattened."""
    hints = typing.get_type_hints(cls, include_extras=True)
    out: list[FlatField] = []
    for f in fields(cls):
        if f.metadata.get("python_only"):  # a setting of the Python API only (a dict of the user's configuration)
            continue
        kind = hints[f.name]
        if is_dataclass(kind):
            out += flat_fields(kind, getattr(kind, "panel", None) or panel)
            continue
        default = f.default_factory() if f.default_factory is not MISSING else f.default
        out.append(FlatField(f.name, kind, default, _cli_info(f), getattr(cls, "panel", None) or panel))
    names = [x.name for x in out]
    duplicates = {n for n in names if names.count(n) > 1}
    if duplicates:
        raise TypeError(f"{cls.__name__}: option names used twice: {sorted(duplicates)}")
    return out


def _cli_info(f: Any) -> dict[str, Any]:
    """A field's ``cli()`` info: its own, or, for a field of a Python API option object (:mod:`gradtrace.options`,
    which cannot know the command line), one made from its ``help`` metadata and bounds (``min``)."""
    if "cli" in f.metadata:
        return f.metadata["cli"]
    bounds = {key: f.metadata[key] for key in ("min", "max", "min_open", "valid") if key in f.metadata}
    return cli(f.metadata["help"], **bounds)["cli"]


def _typer_parameter(spec: FlatField) -> inspect.Parameter:
    info = spec.info
    kwargs = dict(info["kwargs"])
    rule = spec.range
    text = info["help"] if rule is None else f"{info['help']} [{rule.brief()}]"
    if spec.panel and info["kind"] == "option":
        kwargs.setdefault("rich_help_panel", spec.panel)
    if info["kind"] == "argument":
        marker = typer.Argument(help=text, show_default=spec.default is not MISSING, **kwargs)
    else:
        marker = typer.Option(*info["decls"], help=text, **kwargs)
    default = inspect.Parameter.empty if spec.default is MISSING else spec.default
    return inspect.Parameter(spec.name, inspect.Parameter.KEYWORD_ONLY, default=default,
                             annotation=Annotated[spec.type, marker])


def _build(cls: type[T], values: dict[str, Any]) -> T:
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for f in fields(cls):
        if f.metadata.get("python_only"):
            continue
        kwargs[f.name] = _build(hints[f.name], values) if is_dataclass(hints[f.name]) else values[f.name]
    return cls(**kwargs)


def resolved(options: Any) -> dict[str, Any]:
    """The flat ``{option name: value}`` of a filled-in options dataclass, every path absolute (as a string).

    Paths are made absolute here, for every option alike, so a resolved configuration never holds a path relative
    to the working directory of the run that wrote it (:func:`gradtrace.cli.config.write_resolved` then writes them
    relative to the configuration's own folder)."""
    out: dict[str, Any] = {}
    for f in fields(options):
        if f.metadata.get("python_only"):
            continue
        value = getattr(options, f.name)
        if is_dataclass(value):
            out.update(resolved(value))
        else:
            out[f.name] = _plain(value)
    return out


def _plain(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value.expanduser().absolute())
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def config_keys(cls: type) -> dict[str, str]:
    """Config-file keys of options dataclass ``cls`` -> field names: the field names, and the long flags as
    aliases where no field has that name (``lr`` for ``--lr``; ``store`` stays the STORE argument)."""
    specs = flat_fields(cls)
    keys = {s.name: s.name for s in specs}
    for s in specs:
        for flag in _long_flags(s):
            keys.setdefault(flag, s.name)
    return keys


def _long_flags(spec: FlatField) -> list[str]:
    """``--batch-size`` -> ``batch_size`` for each long flag of a field (``--progress/--no-progress``: the first)."""
    flags = [decl.split("/")[0] for decl in spec.info["decls"]]
    return [flag[2:].replace("-", "_") for flag in flags if flag.startswith("--")]


def _config_callback(ctx: typer.Context, value: Path | None) -> Path | None:
    """``--config FILE``: its values become the defaults of this run (the command line still wins).

    A list given for a positional argument whose name is also a repeatable flag spills over: in
    ``gradtrace score``, ``store: [a, b]`` means ``STORE=a --store b``.
    """
    if value is None:
        return None
    command = ctx.info_name or ""
    try:
        values = load_config(value, command, {name: list(config_keys(cls)) for name, cls in COMMANDS.items()})
    except CliError as err:
        raise fail(str(err)) from None
    specs = {s.name: s for s in flat_fields(COMMANDS[command])}
    keys = config_keys(COMMANDS[command])
    is_list = lambda name: typing.get_origin(specs[name].type) is list
    spill = {flag: s.name for s in specs.values() if is_list(s.name) for flag in _long_flags(s)
             if flag in specs and flag != s.name and not is_list(flag)}  # "store" (STORE) -> --store's field
    defaults: dict[str, Any] = {}
    for key, item in values.items():
        name = keys[key]
        if _holds_paths(specs[name].type):
            item = resolve_against(item, value.parent)
        if key in spill and isinstance(item, list):
            defaults[name], defaults[spill[key]] = (item[0] if item else None), list(item[1:])
        elif is_list(name) and not isinstance(item, list):
            defaults[name] = [item]
        else:
            defaults[name] = item
    ctx.default_map = {**(ctx.default_map or {}), **defaults}
    return value


def _holds_paths(kind: Any) -> bool:
    """Whether an option of type ``kind`` holds paths: ``Path``, ``Path | None``, ``list[Path]``."""
    if kind is Path:
        return True
    return any(_holds_paths(arg) for arg in typing.get_args(kind))


def make_command(name: str, options_cls: type[T], run: Callable[[T], None]) -> Callable[..., None]:
    """A typer command function (signature generated from ``options_cls``) that calls ``run(options)``.

    ``run``'s docstring is the command's help. Numeric options are checked first (:func:`check_values`); those
    refusals and the bad-input errors raised by ``run`` are printed on one line and exit with code 2 (see
    :mod:`gradtrace.cli.errors`).
    """
    COMMANDS[name] = options_cls
    specs = flat_fields(options_cls)
    parameters = [_typer_parameter(s) for s in specs]
    parameters.append(inspect.Parameter(
        "config", inspect.Parameter.KEYWORD_ONLY, default=None,
        annotation=Annotated[Path | None, typer.Option("--config", help=CONFIG_HELP, is_eager=True,
                                                       callback=_config_callback, metavar="FILE")]))

    def command(**values: Any) -> None:
        values.pop("config", None)
        with reported_errors():
            check_values(specs, values)
            run(_build(options_cls, values))

    command.__signature__ = inspect.Signature(parameters)  # type: ignore[attr-defined]
    command.__doc__ = run.__doc__
    command.__name__ = name
    command.__annotations__ = {}
    return command


"""Every numeric option of every command, option object and method is refused outside its range, before any work.

The walk is generated from the declarations themselves (the commands' option dataclasses, the Python API option
objects), so an option added later is covered without editing this file: it must declare its range, and a value
outside it -- ``nan``, ``inf``, one past a bound -- is refused with one line naming the option."""

from __future__ import annotations

import importlib
import math
import pkgutil
import typing
from dataclasses import MISSING, fields, is_dataclass
from pathlib import Path

import pytest
from typer.testing import CliRunner

import gradtrace.options as api_options
from gradtrace.cli import app
from gradtrace.cli.commands import COMMANDS, flat_fields, numeric_kind
from gradtrace.common.checks import Range, range_from
from tests.cli.conftest import error_line

UNBOUNDED_INTEGERS: dict[str, str] = {}
"""``command:option`` of an integer option that may take any integer, with why (none so far)."""


def _numeric_options() -> list[tuple[str, object]]:
    return [(name, spec) for name, cls in sorted(COMMANDS.items()) for spec in flat_fields(cls)
            if numeric_kind(spec.type) is not None]


def _bad_values(rule: Range) -> list[str]:
    """Values just outside ``rule``, as typed on a command line (an infinite bound has nothing beyond it; a range
    that allows +-inf may still refuse NaN)."""
    bad: list[str] = []
    if rule.kind is float and rule.finite:
        bad += ["nan", "inf", "-inf"]
    elif rule.kind is float and not rule.holds(math.nan):
        bad.append("nan")
    if rule.low is not None and math.isfinite(rule.low):
        low = rule.low
        bad.append(_text(low if rule.open_low else (low - 1 if rule.kind is int else low - 0.5), rule.kind))
    if rule.high is not None and math.isfinite(rule.high):
        bad.append(_text(rule.high + (1 if rule.kind is int else 0.5), rule.kind))
    if rule.nonzero:
        bad.append("0")
    return bad


def _text(value: float, kind: type) -> str:
    return str(int(value)) if kind is int else repr(float(value))


NUMERIC = _numeric_options()


def test_the_walk_sees_every_command_and_their_numeric_options():
    assert {"collect", "score", "fit", "index", "topk", "self-influence"} <= set(COMMANDS)
    assert len(NUMERIC) >= 30, [f"{c}:{s.flag}" for c, s in NUMERIC]


@pytest.mark.parametrize("command,spec", NUMERIC, ids=[f"{c}:{s.flag}" for c, s in NUMERIC])
def test_every_numeric_option_declares_its_range(command, spec):
    if spec.range is None:
        assert f"{command}:{spec.flag}" in UNBOUNDED_INTEGERS, (
            f"gradtrace {command} {spec.flag} accepts any integer: declare min/max/valid in its cli() metadata")


def _required_arguments(command: str, root: Path) -> list[str]:
    """Placeholder values for a command's required arguments and options (the numeric check runs first, so they
    are never opened)."""
    args: list[str] = []
    for spec in flat_fields(COMMANDS[command]):
        if spec.default is not MISSING:
            continue
        value = str(root / spec.name)
        if spec.info["kind"] == "argument":
            args.append(value)
        else:
            args += [spec.flag, value]
    return args


@pytest.mark.parametrize("command,spec", [(c, s) for c, s in NUMERIC if s.range is not None],
                         ids=[f"{c}:{s.flag}" for c, s in NUMERIC if s.range is not None])
def test_every_numeric_option_refuses_values_outside_its_range_before_any_work(command, spec, tmp_path):
    runner = CliRunner()
    bad = _bad_values(spec.range)
    assert bad, f"{command} {spec.flag}: a range with nothing outside it"
    for value in bad:
        args = [command, *_required_arguments(command, tmp_path), spec.flag, value]
        if spec.info["kind"] == "argument":
            pytest.skip("a numeric positional argument")  # none so far; would need its own placement
        result = runner.invoke(app, args)
        assert result.exit_code == 2, (args, result.output)
        line = error_line(result)
        assert spec.flag in line and "must be" in line and spec.range.describe() in line, (args, line)
        assert list(tmp_path.iterdir()) == [], (args, "something was written before the refusal")


# ------------------------------------------------------------------------------------------- Python API objects
def _api_option_classes() -> list[type]:
    """Every option dataclass of the ``gradtrace.options`` package: those it exports, and those of each of its
    modules (one per concern), exported there or not."""
    found = [obj for name in api_options.__all__ if is_dataclass(obj := getattr(api_options, name))
             and isinstance(obj, type)]
    for info in pkgutil.iter_modules(api_options.__path__):
        module = importlib.import_module(f"{api_options.__name__}.{info.name}")
        found += [obj for obj in vars(module).values() if isinstance(obj, type) and is_dataclass(obj)
                  and obj.__module__ == module.__name__]
    return sorted(set(found), key=lambda cls: (cls.__module__, cls.__qualname__))


def _numeric_fields(cls: type) -> list[tuple[str, Range]]:
    hints = typing.get_type_hints(cls)
    out = []
    for f in fields(cls):
        kind = numeric_kind(hints[f.name])
        rule = range_from(kind, f.metadata) if kind is not None or "valid" in f.metadata else None
        if rule is not None and f.init:
            out.append((f.name, rule))
    return out


API_FIELDS = [(cls, name, rule) for cls in _api_option_classes() for name, rule in _numeric_fields(cls)]


def test_the_api_walk_sees_the_option_objects():
    seen = {cls.__name__ for cls, _, _ in API_FIELDS}
    assert {"StoreOptions", "FitOptions", "ReweightingOptions", "SelectionOptions", "LDSOptions"} <= seen, seen


@pytest.mark.parametrize("cls,name,rule", API_FIELDS, ids=[f"{c.__name__}.{n}" for c, n, _ in API_FIELDS])
def test_every_numeric_field_of_an_option_object_refuses_values_outside_its_range(cls, name, rule):
    for text in _bad_values(rule):
        value = float(text) if rule.kind is float or not text.lstrip("-").isdigit() else int(text)
        with pytest.raises(ValueError, match=rf"{name} must be"):
            cls(**{name: value})
    if rule.kind is int:
        with pytest.raises(ValueError, match=rf"{name} must be"):
            cls(**{name: 2.5})  # an integer setting given a float


# ---------------------------------------------------------------------------------------- method constructors
def _methods():
    from gradtrace.fit import methods

    return methods


@pytest.mark.parametrize("build,what", [
    (lambda m: m.TracIn(weights=[0.1, -0.1]), "learning rates"),
    (lambda m: m.TracIn(weights=[0.0, 0.0]), "all 0"),
    (lambda m: m.TracIn(weights=[math.nan]), "learning rates"),
    (lambda m: m.EKFAC(damping=math.inf), "damping"),
    (lambda m: m.EKFAC(damping=-1.0), "damping"),
    (lambda m: m.EKFAC(damping=math.nan), "damping"),
], ids=["tracin-negative-lr", "tracin-zero-lrs", "tracin-nan-lr", "influence-inf-damping",
        "influence-negative-damping", "influence-nan-damping"])
def test_method_constructors_refuse_values_that_would_silently_change_every_score(build, what):
    with pytest.raises(ValueError, match=what):
        build(_methods())


@pytest.mark.parametrize("value", [0, -1, 2.5, True, math.nan])
def test_projection_ranks_and_callback_intervals_must_be_positive_integers(value):
    import gradtrace
    from gradtrace.integrations.hf import GradtraceCallback

    with pytest.raises(ValueError, match=r"LoGra\.rank must be a positive integer"):
        gradtrace.LoGra(rank=value)
    with pytest.raises(ValueError, match="every must be a positive integer"):
        GradtraceCallback("unused-store", every=value)


def test_train_time_settings_refuse_non_finite_and_out_of_range_values():
    from gradtrace.options.train import ReweightingOptions, SelectionOptions

    for bad, name in [({"alpha": math.nan}, "alpha"), ({"alpha": 0.0}, "alpha"), ({"meta_lr": -1.0}, "meta_lr"),
                      ({"interval": 0}, "interval"), ({"init_logit": math.inf}, "init_logit")]:
        with pytest.raises(ValueError, match=f"{name} must be"):
            ReweightingOptions(**bad)
    for bad, name in [({"rule": "bottom", "fraction": math.nan}, "fraction"), ({"min_keep": -1}, "min_keep"),
                      ({"rule": "threshold", "threshold": math.nan}, "threshold")]:
        with pytest.raises(ValueError, match=f"{name} must be"):
            SelectionOptions(**bad)

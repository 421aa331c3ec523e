"""Configuration files: reading ``--config FILE`` (YAML or TOML) and writing the resolved configuration.

A config file holds option values under their option names (``batch_size`` or ``batch-size``)::

    # gradtrace.yaml
    model: ./my-model          # keys shared by several commands apply to each of them
    batch_size: 8
    collect:                   # a section applies to one command only and wins over the shared keys
      rank: 32
      out: ./store

Values from the file replace the option defaults; options given on the command line win over the file.
Relative paths in the file are relative to the file's folder (not to the working directory).
A config file is checked before it is parsed: a regular file (a FIFO or a device is refused unopened) of at
most 1 MiB, in UTF-8 (an error names the byte offset); YAML anchors and aliases (``&a``, ``*a``) are refused, so
a few hundred bytes cannot expand into gigabytes, and so is nesting deeper than 32 levels.
A key that no command knows is an error (with a suggestion); a shared key that only some commands know is
ignored by the others. Every command writes its fully resolved configuration next to its output
(``gradtrace-<command>.yaml``), in the same format and with paths relative to its folder, so a run can be
repeated -- also in a copy of the project folder -- with ``gradtrace <command> --config
STORE/gradtrace-<command>.yaml --overwrite`` (the command its header prints).
"""

from __future__ import annotations

import difflib
import functools
import json
import os
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from .errors import CliError

__all__ = ["CONFIG_HELP", "MAX_CONFIG_BYTES", "META_KEY", "load_config", "load_yaml", "read_resolved",
           "resolve_against", "resolved_name", "write_resolved"]

CONFIG_HELP = "YAML or TOML file of option values (keys = option names); command-line options override it."
META_KEY = "gradtrace"
"""Key of the provenance block (version, command, time) in resolved configuration files."""


def resolved_name(command: str) -> str:
    return f"gradtrace-{command}.yaml"


MAX_CONFIG_BYTES = 1 << 20
"""Largest configuration file read (1 MiB; option values take a few KiB): a larger one is refused unread."""
MAX_DEPTH = 32
"""Deepest nesting of lists and mappings in a YAML configuration (option values nest two or three levels)."""


def _read(path: Path) -> str:
    """The text of configuration file ``path``, checked before it is parsed: a regular file (a FIFO or a device
    is refused unopened) of at most :data:`MAX_CONFIG_BYTES`, in UTF-8."""
    from ..data.errors import DataError
    from ..data.files import check_input

    try:
        info = check_input(path, "config file")
    except DataError as err:
        raise CliError(str(err)) from None
    if info.st_size > MAX_CONFIG_BYTES:
        raise CliError(f"config file {path} holds {info.st_size:,} bytes, more than a configuration can "
                       f"({MAX_CONFIG_BYTES:,}): give the file of option values")
    with open(path, "rb") as handle:
        data = handle.read(MAX_CONFIG_BYTES + 1)  # bounded, also when the file grows after the check
    if len(data) > MAX_CONFIG_BYTES:
        raise CliError(f"config file {path} holds more than {MAX_CONFIG_BYTES:,} bytes: give the file of option "
                       "values")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise CliError(f"config file {path} is not UTF-8 text ({err.reason}: byte 0x{data[err.start]:02x} at byte "
                       f"offset {err.start}); save it as UTF-8") from None


class _NotAllowed(Exception):
    """Valid YAML that a configuration may not hold (an anchor or alias, nesting too deep): ``(problem, mark)``."""


@functools.cache
def _yaml_loader() -> Any:
    """A ``yaml.SafeLoader`` that refuses anchors and aliases (``&a`` / ``*a``: an alias composes its node again,
    so a few hundred bytes of nested aliases -- a "billion laughs" -- expand into gigabytes) and nesting deeper
    than :data:`MAX_DEPTH` (composing recurses), raising :class:`_NotAllowed` at the node."""
    import yaml

    class BoundedLoader(yaml.SafeLoader):
        depth = 0

        def compose_node(self, parent: Any, index: Any) -> Any:
            event = self.peek_event()
            if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None) is not None:
                raise _NotAllowed("anchors and aliases (&name, *name) are not allowed in a configuration; write "
                                  "each value out", event.start_mark)
            if not isinstance(event, (yaml.SequenceStartEvent, yaml.MappingStartEvent)):
                return super().compose_node(parent, index)
            if self.depth >= MAX_DEPTH:
                raise _NotAllowed(f"values nest more than {MAX_DEPTH} levels deep", event.start_mark)
            self.depth += 1
            try:
                return super().compose_node(parent, index)
            finally:
                self.depth -= 1

    return BoundedLoader


def load_yaml(text: str) -> Any:
    """``yaml.safe_load(text)`` refusing anchors, aliases and deep nesting (:class:`_NotAllowed`)."""
    import yaml

    return yaml.load(text, Loader=_yaml_loader())  # a SafeLoader subclass


def _parse(path: Path) -> Any:
    text = _read(path)
    if path.suffix.lower() == ".toml":
        try:
            import tomllib
        except ImportError:  # Python 3.10
            try:
                import tomli as tomllib  # type: ignore[no-redef]
            except ImportError:
                raise CliError(f"reading TOML on Python < 3.11 needs tomli (pip install tomli): {path}") from None
        try:
            return tomllib.loads(text)
        except tomllib.TOMLDecodeError as err:
            raise CliError(f"{path} is not valid TOML: {err}") from None
        except RecursionError:  # arrays nested thousands deep
            raise CliError(f"{path} is not a usable TOML configuration: its values nest too deep") from None
    import yaml

    try:
        return load_yaml(text)
    except _NotAllowed as err:
        problem, mark = err.args
        raise CliError(f"config file {path} line {mark.line + 1}, column {mark.column + 1}: {problem}") from None
    except yaml.YAMLError as err:
        detail = " ".join(str(err).split())
        raise CliError(f"{path} is not valid YAML: {detail}") from None


def load_config(path: Path, command: str, known: dict[str, list[str]]) -> dict[str, Any]:
    """The option values ``path`` gives command ``command``.

    ``known`` maps every command to its option names (to tell a typo from a key for another command).
    Keys are normalized (``batch-size`` -> ``batch_size``); the ``gradtrace`` provenance block of a
    resolved configuration is checked (it must be for the same command) and dropped.
    """
    data = _parse(path)
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise CliError(f"{path} must hold a mapping of option names to values")
    meta = data.pop(META_KEY, None)
    if isinstance(meta, dict) and meta.get("command") not in (None, command):
        raise CliError(f"{path} is the resolved configuration of `gradtrace {meta['command']}`; it cannot "
                                 f"configure `gradtrace {command}`")
    norm = lambda key: str(key).replace("-", "_")
    shared = {norm(k): v for k, v in data.items() if not (k in known and isinstance(v, dict))}
    section = data.get(command) if isinstance(data.get(command), dict) else {}
    mine = set(known.get(command, []))
    everyone = {name for names in known.values() for name in names}
    values: dict[str, Any] = {}
    for where, block in (("", shared), (f"[{command}] ", {norm(k): v for k, v in section.items()})):
        for key, value in block.items():
            if key in mine:
                values[key] = value
            elif where or key not in everyone:
                pool = mine if where else everyone
                close = difflib.get_close_matches(key, sorted(pool), n=1)
                suggestion = f" (did you mean {close[0]!r}?)" if close else ""
                target = f"`gradtrace {command}`" if where else "any gradtrace command"
                raise CliError(f"{path}: {where}key {key!r} is not an option of {target}{suggestion}")
    return values


REPLACE_KEYS = ("resume", "overwrite")
"""Options that say what to do with an output that already exists: recorded false, given by the repeat command."""


def write_resolved(directory: Path, command: str, values: dict[str, Any]) -> Path:
    """Write ``directory/gradtrace-<command>.yaml``: every option's final value plus provenance.

    Absolute paths are written relative to ``directory`` where they lie under it or beside it (``../data.jsonl``;
    :func:`gradtrace.common.provenance.relative_path`) and read back against it, so a copied project folder reads its
    own files. ``resume``/``overwrite`` are recorded false: the header's repeat command states the one it needs
    (``--overwrite``: compute the output again and replace it; for ``collect`` also ``--resume``: add what the
    data gained, or finish an interrupted run).
    """
    import yaml

    path = Path(directory) / resolved_name(command)
    saved = {key: False if key in REPLACE_KEYS else _relative(value, path.parent) for key, value in values.items()}
    document = {META_KEY: provenance(command), **saved}
    shown = _shown(path)
    header = (f"# Resolved configuration of `gradtrace {command}` (every option's final value; paths relative to "
              "this file's folder).\n"
              f"# Repeat the run with: gradtrace {command} --config {shown} --overwrite\n")
    if "resume" in values:
        header += (f"# Add the examples the data gained (or finish an interrupted run) with: gradtrace {command} "
                   f"--config {shown} --resume\n")
    text = header + yaml.safe_dump(json.loads(json.dumps(document)), sort_keys=False, allow_unicode=True)
    from ..store.artifact import atomic_write_bytes

    atomic_write_bytes(path, text.encode("utf-8"))  # a temporary of its own: concurrent runs never share one
    return path


def _relative(value: Any, folder: Path) -> Any:
    """An absolute path string (or a list of them) relative to ``folder`` where possible; other values as given."""
    from ..common.provenance import relative_path

    if isinstance(value, list):
        return [_relative(item, folder) for item in value]
    if isinstance(value, str) and os.path.isabs(value):
        return relative_path(value, folder)
    return value


def _shown(path: Path) -> str:
    """``path`` as the repeat command names it: relative to the working directory when under it, else absolute."""
    absolute = path.absolute()
    try:
        return absolute.relative_to(Path.cwd()).as_posix()
    except ValueError:
        return str(absolute)


def resolve_against(value: Any, folder: Path) -> Any:
    """A path value read from a config file in ``folder``: a relative one is taken relative to that folder."""
    if isinstance(value, list):
        return [resolve_against(item, folder) for item in value]
    if isinstance(value, str) and value and not os.path.isabs(value) and not value.startswith("~"):
        return str(folder / value)
    return value


def provenance(command: str, data: Path | None = None, rows: int | None = None) -> dict[str, Any]:
    """The ``gradtrace:`` block of a resolved configuration: version, command, time, Python version; with
    ``data``, the data file's fingerprint (size, blake2b hash, ``rows`` read:
    :func:`gradtrace.common.provenance.file_fingerprint`) and the versions of the packages that shape the artifact
    (:func:`gradtrace.common.provenance.environment`)."""
    from ..common.provenance import environment, file_fingerprint
    from ..version import __version__

    block: dict[str, Any] = {"version": __version__, "command": command,
                             "written": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                             "python": sys.version.split()[0]}
    if data is not None:
        block["data"] = file_fingerprint(Path(data).absolute(), rows=rows)
        block["environment"] = environment()
    return block


def read_resolved(directory: Path, command: str) -> dict[str, Any] | None:
    """The resolved configuration a command wrote in ``directory`` (None if there is none)."""
    path = Path(directory) / resolved_name(command)
    if not path.is_file():
        return None
    import yaml

    try:
        data = load_yaml(_read(path))
    except (CliError, _NotAllowed, yaml.YAMLError):
        return None
    return data if isinstance(data, dict) else None

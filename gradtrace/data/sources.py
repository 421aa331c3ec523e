"""Sources of records: files, ``save_to_disk`` directories and in-memory datasets, read in chunks.

Every source yields :class:`Chunk` s of at most ``chunk_rows`` records (plain dicts), each record with its
location (1-based line of a text file, 0-based row of a table) for error messages. Parquet files, Arrow
datasets and CSV files are read one record batch at a time, so a large source is never held whole as Python
objects; JSONL is read line by line. A ``.json`` file holding one JSON array is the exception: JSON has to be
parsed whole (write large data as JSONL or Parquet).
"""

from __future__ import annotations

import json
import stat
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..common.errors import first_line
from .errors import DataError
from .files import check_input, check_tree

__all__ = ["Chunk", "Source", "SUFFIXES", "open_source"]

JSONL_SUFFIXES = (".jsonl", ".ndjson")
SUFFIXES = (".jsonl", ".ndjson", ".json", ".parquet", ".csv", ".txt")
CHUNK_ROWS = 1024


@dataclass
class Chunk:
    """Up to ``CHUNK_ROWS`` records and where each came from (``locations[i]``: line or row number)."""

    records: list[dict[str, Any]]
    locations: list[int]


@dataclass
class Source:
    """A readable source: its ``name`` for messages, ``unit`` ("line" or "row"), and its chunks.

    ``text_only``: every record is plain text (a ``.txt`` file). ``num_rows``: known up front (tables), or None.
    """

    name: str
    unit: str
    chunks: Iterable[Chunk]
    text_only: bool = False
    num_rows: int | None = None

    def where(self, location: int) -> str:
        """``train.jsonl line 4`` / ``train.parquet row 3``."""
        return f"{self.name} {self.unit} {location}"


def open_source(source: Any, *, split: str | None = None, text_field: str = "text", what: str = "data",
                chunk_rows: int = CHUNK_ROWS) -> Source:
    """A :class:`Source` for a path (file or ``save_to_disk`` directory), a ``datasets.Dataset`` /
    ``DatasetDict`` / ``IterableDataset``, or a list of dicts. ``split`` picks a split of a ``DatasetDict``."""
    if isinstance(source, (str, Path)):
        path = Path(source)
        info = check_input(path, f"{what} file", directory=True)  # a FIFO or a device is refused unopened
        if stat.S_ISDIR(info.st_mode):
            return _disk_dataset(path, split, what, chunk_rows)
        if split is not None:
            raise DataError(f"{what} {path}: --split {split!r} applies to a DatasetDict directory (save_to_disk), "
                            "not to a file")
        return _file(path, text_field, what, chunk_rows)
    if isinstance(source, (list, tuple)):
        if split is not None:
            raise DataError(f"--split {split!r} applies to a DatasetDict, not to a list of records")
        return _records(list(source), what, chunk_rows)
    return _hf_dataset(source, split, what, chunk_rows, name=f"in-memory {type(source).__name__}")


# -- files --------------------------------------------------------------------------------------------------
def _file(path: Path, text_field: str, what: str, chunk_rows: int) -> Source:
    suffix = path.suffix.lower()
    if suffix == ".txt":
        return Source(str(path), "line", _chunked(_text_lines(path, text_field), chunk_rows), text_only=True)
    if suffix in JSONL_SUFFIXES:
        return Source(str(path), "line", _chunked(_jsonl(path), chunk_rows))
    if suffix == ".json":
        if _first_char(path) == "[":
            return Source(str(path), "row", _chunked(_json_array(path), chunk_rows))
        return Source(str(path), "line", _chunked(_jsonl(path), chunk_rows))
    if suffix == ".parquet":
        return _parquet(path, chunk_rows)
    if suffix == ".csv":
        return Source(str(path), "row", _csv(path, chunk_rows))
    raise DataError(f"{what} file {path}: unknown format {suffix or '(no suffix)'!r}; use .jsonl (one JSON object "
                    "per line), .json, .parquet, .csv, .txt (one example per line), or a directory written by "
                    "datasets' save_to_disk")


def _chunked(rows: Iterable[tuple[int, dict[str, Any]]], chunk_rows: int) -> Iterator[Chunk]:
    chunk = Chunk([], [])
    for location, record in rows:
        chunk.records.append(record)
        chunk.locations.append(location)
        if len(chunk.records) >= chunk_rows:
            yield chunk
            chunk = Chunk([], [])
    if chunk.records:
        yield chunk


def _lines(path: Path) -> Iterator[str]:
    try:
        with open(path, encoding="utf-8") as f:
            yield from f
    except UnicodeDecodeError as err:
        raise DataError(f"{path} is not UTF-8 text ({err.reason} at byte {err.start}); re-encode it as UTF-8") from None


def _first_char(path: Path) -> str:
    with open(path, "rb") as f:
        head = f.read(4096).lstrip()
    return head[:1].decode("ascii", errors="replace")


def _text_lines(path: Path, text_field: str) -> Iterator[tuple[int, dict[str, Any]]]:
    for n, line in enumerate(_lines(path), start=1):
        if line.strip():
            yield n, {text_field: line.rstrip("\r\n")}


def _jsonl(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    for n, line in enumerate(_lines(path), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as err:
            raise DataError(f"{path} line {n} is not valid JSON ({err.msg} at column {err.colno})") from None
        if not isinstance(record, dict):
            raise DataError(f"{path} line {n} is a JSON {type(record).__name__}, not an object")
        yield n, record


def _json_array(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    try:
        with open(path, encoding="utf-8") as f:
            records = json.load(f)
    except UnicodeDecodeError as err:
        raise DataError(f"{path} is not UTF-8 text ({err.reason} at byte {err.start}); re-encode it as UTF-8") from None
    except ValueError as err:
        raise DataError(f"{path} is not valid JSON ({err.msg} at line {err.lineno}, column {err.colno})") from None
    for i, record in enumerate(records):
        if not isinstance(record, dict):
            raise DataError(f"{path} row {i} is a JSON {type(record).__name__}, not an object")
        yield i, record


def _parquet(path: Path, chunk_rows: int) -> Source:
    pq = _pyarrow_module("parquet", path)
    try:
        reader = pq.ParquetFile(path)
    except Exception as err:  # pyarrow raises ArrowInvalid / OSError for non-Parquet bytes
        raise DataError(f"{path} is not a readable Parquet file ({first_line(err)})") from None

    def chunks() -> Iterator[Chunk]:
        start = 0
        batches = reader.iter_batches(batch_size=chunk_rows)
        while True:
            try:
                batch = next(batches, None)
                records = None if batch is None else _checked_rows(batch)
            except Exception as err:  # a damaged page or column chunk: OSError, ArrowInvalid, UnicodeDecodeError
                raise DataError(f"{path} after row {start} is not readable Parquet ({first_line(err)}); the file is "
                                "damaged: write it again") from None
            if batch is None:
                return
            yield Chunk(records, list(range(start, start + batch.num_rows)))
            start += batch.num_rows

    return Source(str(path), "row", chunks(), num_rows=reader.metadata.num_rows)


def _checked_rows(batch: Any) -> list[dict[str, Any]]:
    """A record batch's rows as dicts, its buffers checked first (offsets in range, strings UTF-8): damaged bytes
    are an error, never garbage or a crash."""
    batch.validate(full=True)
    return batch.to_pylist()


def _csv(path: Path, chunk_rows: int) -> Iterator[Chunk]:
    pa_csv = _pyarrow_module("csv", path)
    try:
        reader = pa_csv.open_csv(path, read_options=pa_csv.ReadOptions(block_size=1 << 20))
    except Exception as err:
        raise DataError(f"{path} is not a readable CSV file ({_csv_reason(err)})") from None
    start = 0
    while True:
        try:
            batch = reader.read_next_batch()
        except StopIteration:
            return
        except Exception as err:
            raise DataError(f"{path} after row {start} is not readable CSV ({_csv_reason(err)})") from None
        binary = [f.name for f in batch.schema if str(f.type) in ("binary", "large_binary")]
        if binary:  # pyarrow reads a column that is not valid UTF-8 as bytes
            raise DataError(f"{path}: column {binary[0]!r} is not UTF-8 text (rows {start} to "
                            f"{start + batch.num_rows - 1}); re-encode the file as UTF-8")
        for offset in range(0, batch.num_rows, chunk_rows):
            part = batch.slice(offset, chunk_rows)
            yield Chunk(part.to_pylist(), list(range(start + offset, start + offset + part.num_rows)))
        start += batch.num_rows


def _csv_reason(err: Exception) -> str:
    reason = first_line(err)
    return "not UTF-8 text; re-encode it as UTF-8" if "UTF8" in reason or "UTF-8" in reason else reason


def _pyarrow_module(name: str, path: Path) -> Any:
    import importlib

    try:
        return importlib.import_module(f"pyarrow.{name}")
    except ImportError:
        raise DataError(f"{path}: reading {path.suffix} files needs pyarrow (pip install 'gradtrace[data]')") from None


# -- datasets ------------------------------------------------------------------------------------------------
def _disk_dataset(path: Path, split: str | None, what: str, chunk_rows: int) -> Source:
    markers = ("dataset_info.json", "state.json", "dataset_dict.json")
    if not any((path / m).exists() for m in markers):
        raise DataError(f"{what} {path} is a directory but not a dataset written by datasets' save_to_disk (no "
                        "state.json or dataset_dict.json); give a .jsonl, .json, .parquet, .csv or .txt file")
    check_tree(path, what)
    try:
        import datasets
    except ImportError:
        raise DataError(f"{path}: reading a save_to_disk directory needs datasets (pip install "
                        "'gradtrace[data]')") from None
    try:
        loaded = datasets.load_from_disk(str(path))  # memory-mapped Arrow: nothing is read into Python here
    except Exception as err:  # pyarrow's OSError / ArrowInvalid, a JSONDecodeError of state.json, ...
        raise _damaged(path, err, what) from None
    return _hf_dataset(loaded, split, what, chunk_rows, name=str(path))


def _damaged(path: Path, err: Exception, what: str) -> DataError:
    """The error for a ``save_to_disk`` directory that does not load, naming its first unreadable file."""
    import pyarrow as pa

    for name in sorted(path.rglob("*.json")):
        try:
            json.loads(name.read_bytes())
        except ValueError as bad:
            return DataError(f"{what} {path}: {name.relative_to(path)} is not valid JSON ({first_line(bad)}); the "
                             "dataset is damaged: save it again")
    for name in sorted(path.rglob("*.arrow")):
        try:
            with pa.memory_map(str(name)) as source:
                pa.ipc.open_stream(source).read_all().validate(full=True)
        except Exception as bad:
            return DataError(f"{what} {path}: {name.relative_to(path)} is not a readable Arrow file "
                             f"({first_line(bad)}); the dataset is damaged: save it again")
    return DataError(f"{what} {path} is not a readable save_to_disk dataset ({first_line(err)})")


def _hf_dataset(data: Any, split: str | None, what: str, chunk_rows: int, *, name: str) -> Source:
    if isinstance(data, Mapping):  # DatasetDict / IterableDatasetDict
        splits = list(data)
        if split is None:
            if len(splits) != 1:
                raise DataError(f"{what} {name} is a DatasetDict with splits {', '.join(splits)}; choose one with "
                                "--split (split=)")
            split = splits[0]
        if split not in data:
            raise DataError(f"{what} {name} has no split {split!r} (it has: {', '.join(splits)})")
        data, name = data[split], f"{name} [{split}]"
    elif split is not None:
        raise DataError(f"{what} {name}: --split {split!r} applies to a DatasetDict, and this is a single dataset")
    if hasattr(data, "with_format") and hasattr(data, "num_rows") and hasattr(data, "data"):
        return Source(name, "row", _arrow_chunks(data, chunk_rows, name), num_rows=data.num_rows)
    if hasattr(data, "iter") or hasattr(data, "__iter__"):  # IterableDataset or another iterable of dicts
        return _records(data, what, chunk_rows, name=name)
    raise DataError(f"{what}: cannot read a {type(data).__name__}; give a path, a datasets.Dataset or a list of dicts")


def _arrow_chunks(dataset: Any, chunk_rows: int, name: str) -> Iterator[Chunk]:
    """Record batches of a (memory-mapped) ``datasets.Dataset``, checked and converted to dicts one chunk at a
    time (damaged Arrow bytes are an error naming the dataset and the rows)."""
    table = dataset.with_format("arrow")
    start = 0
    batches = iter(table.iter(batch_size=chunk_rows))
    while True:
        try:
            batch = next(batches, None)
            records = None if batch is None else _checked_rows(batch)
        except Exception as err:  # ArrowInvalid (offsets out of range), UnicodeDecodeError, OSError
            end = min(start + chunk_rows, dataset.num_rows) - 1
            raise DataError(f"{name} rows {start} to {end} are not readable Arrow data "
                            f"({first_line(err)}); the dataset is damaged: save it again") from None
        if batch is None:
            return
        yield Chunk(records, list(range(start, start + batch.num_rows)))
        start += batch.num_rows


def _records(records: Iterable[Any], what: str, chunk_rows: int, name: str = "in-memory list") -> Source:
    def rows() -> Iterator[tuple[int, dict[str, Any]]]:
        for i, record in enumerate(records):
            if not isinstance(record, Mapping):
                raise DataError(f"{what} {name} row {i} is a {type(record).__name__}, not a dict")
            yield i, dict(record)

    return Source(name, "row", _chunked(rows(), chunk_rows))

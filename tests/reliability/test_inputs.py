"""Inputs are bounded before they are expanded (issue #27): a config file is checked before it is parsed (no YAML
aliases, bounded size and nesting, UTF-8 errors on one line), FIFOs and devices are refused unopened, a long
text is cut before it is tokenized when truncation keeps only its start (with exactly the tokens the whole text
gives), damaged Arrow and Parquet data is one line naming the file, and a data file that changed since it was
collected is a warning where its texts are shown and an error where its gradients are re-captured. No refusal
changes anything written before."""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import tempfile
import threading
import time
from pathlib import Path

import pytest

import gradtrace.data as gd
from gradtrace.cli import config as cli_config
from gradtrace.cli import score_queries  # where gradtrace score loads the models of its queries
from gradtrace.common.errors import UsageError
from gradtrace.data import tokenize
from gradtrace.data.files import DataChangedWarning
from gradtrace.options.data import ReadOptions
from tests.cli import conftest as cli_fixtures
from tests.cli.conftest import error_line, invoke

ws, runner, store, scores_dir = cli_fixtures.ws, cli_fixtures.runner, cli_fixtures.store, cli_fixtures.scores_dir


def _snapshot(root: Path) -> dict[str, str]:
    """``{relative path: sha256}`` of every file under ``root`` (what a refusal must leave as it was)."""
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


# ------------------------------------------------------------------------------------------------ config files
BOMB = "".join(f"{name}: &{name} [{', '.join([f'*{prev}'] * 9)}]\n" for prev, name in zip("abcdefgh", "bcdefghi"))
BOMB = 'a: &a ["x", "x", "x", "x", "x", "x", "x", "x", "x"]\n' + BOMB + "out: *i\n"  # 9**9 strings, ~450 bytes


@pytest.mark.parametrize("text", [BOMB, "model: [&m ./model, *m]\n", "collect:\n  out: &o ./store\n  data: *o\n",
                                  "lr: [1, &x 2]\n"], ids=["bomb", "list", "section", "unused-anchor"])
def test_yaml_anchors_and_aliases_are_refused_before_expansion(ws, runner, store, tmp_path, text):
    config = tmp_path / "bomb.yaml"
    config.write_text(text)
    out = tmp_path / "scores"
    before = _snapshot(store)
    started = time.perf_counter()
    result = invoke(runner, "score", store, ws.queries, "--config", config, "--out", out, code=2)
    assert time.perf_counter() - started < 10
    line = error_line(result)
    assert str(config) in line and "anchors and aliases" in line and "line " in line
    assert not out.exists() and _snapshot(store) == before


def test_resolved_configuration_with_an_alias_is_not_read(tmp_path):
    (tmp_path / "gradtrace-score.yaml").write_text(BOMB)
    assert cli_config.read_resolved(tmp_path, "score") is None


def test_config_that_is_not_utf8_is_one_line_naming_the_byte(ws, runner, store, tmp_path):
    for suffix in (".yaml", ".toml"):
        config = tmp_path / f"latin1{suffix}"
        head = b"batch_size = 8\n" if suffix == ".toml" else b"batch_size: 8\n"
        config.write_bytes(head + "# caf\u00e9\n".encode("latin-1"))
        line = error_line(invoke(runner, "score", store, ws.queries, "--config", config, "--out", tmp_path / "s",
                                 code=2))
        offset = len(head) + len("# caf")
        assert str(config) in line and "not UTF-8" in line and f"byte offset {offset})" in line and "0xe9" in line


@pytest.mark.parametrize("name, text, expected", [
    ("huge.yaml", "# " + "x" * (cli_config.MAX_CONFIG_BYTES + 10) + "\n", "more than a configuration can"),
    ("deep.yaml", "lr: " + "[" * 100_000 + "\n", "nest more than 32 levels"),
    ("deep.toml", "lr = " + "[" * 100_000 + "\n", "nest too deep"),
])
def test_huge_or_deeply_nested_config_is_refused(ws, runner, store, tmp_path, name, text, expected):
    config = tmp_path / name
    config.write_text(text)
    line = error_line(invoke(runner, "score", store, ws.queries, "--config", config, "--out", tmp_path / "s",
                             code=2))
    assert str(config) in line and expected in line


def test_resolved_configuration_is_written_through_a_temporary_of_its_own(tmp_path, monkeypatch):
    """Two runs writing one folder's resolved configuration never share a temporary file."""
    from gradtrace.store import artifact

    written: list[Path] = []
    real = os.replace

    def spy(src, dst, *args, **kwargs):
        written.append(Path(src))
        return real(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "replace", spy)
    for _ in range(2):
        path = cli_config.write_resolved(tmp_path, "score", {"out": str(tmp_path), "topk": 3})
    assert cli_config.read_resolved(tmp_path, "score")["topk"] == 3 and path.name == "gradtrace-score.yaml"
    assert len(written) == 2 and written[0] != written[1] and all(p.name != f".tmp-{path.name}" for p in written)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp")]
    assert artifact.atomic_write_bytes  # the one atomic writer of the package


# ------------------------------------------------------------------------------------------------ special files
class _Fifo:
    """A FIFO with a writer waiting for a reader: opening it to read would not block, so a test fails rather
    than hangs; ``opened`` tells whether anything opened it."""

    def __init__(self, path: Path) -> None:
        os.mkfifo(path)
        self.path, self.opened = path, threading.Event()
        self.thread = threading.Thread(target=self._write, daemon=True)
        self.thread.start()

    def _write(self) -> None:
        try:
            with open(self.path, "w") as fifo:  # blocks until a reader opens the other end
                self.opened.set()
                fifo.write('{"text": "the king"}\n')
        except OSError:  # the reader (close()) went away first
            pass

    def close(self) -> None:
        if not self.opened.is_set():
            with open(self.path):  # release the writer
                pass
        self.thread.join(5)


@pytest.mark.parametrize("where", ["data", "queries", "config", "report-data"])
@pytest.mark.parametrize("kind", ["fifo", "device"])
def test_fifos_and_devices_are_refused_unopened(ws, runner, store, scores_dir, tmp_path, where, kind):
    fifo = _Fifo(tmp_path / f"input{'.yaml' if where == 'config' else '.jsonl'}") if kind == "fifo" else None
    path = fifo.path if fifo else Path("/dev/zero")
    out = tmp_path / "out"
    args = {"data": ("collect", ws.model, path, "--out", out, "--no-progress"),
            "queries": ("score", store, path, "--model", ws.model, "--out", out, "--no-progress"),
            "config": ("score", store, ws.queries, "--config", path, "--out", out),
            "report-data": ("topk", scores_dir, "--data", path)}[where]
    try:
        result = invoke(runner, *args, code=2)
        opened = fifo is not None and fifo.opened.is_set()
    finally:
        if fifo:
            fifo.close()
    line = error_line(result)
    assert str(path) in line and ("a FIFO" if fifo else "a character device") in line
    assert not opened and not out.exists()


def test_special_files_and_directories_in_the_data_layer(tmp_path, ws):
    from tests.cli.conftest import _tokenizer

    tok = _tokenizer(ws.lines[:50])
    fifo = _Fifo(tmp_path / "data.jsonl")
    try:
        with pytest.raises(gd.DataError, match="is a FIFO"):
            gd.load(fifo.path, tok)
        with pytest.raises(gd.DataError, match="is a character device"):
            gd.load("/dev/null", tok)
        assert not fifo.opened.is_set()
    finally:
        fifo.close()
    dataset = tmp_path / "saved"  # a save_to_disk directory whose Arrow file is a FIFO
    _save_to_disk(ws, dataset)
    arrow = next(dataset.glob("*.arrow"))
    arrow.unlink()
    os.mkfifo(arrow)
    with pytest.raises(gd.DataError, match=f"holds {arrow.name}, which is a FIFO"):
        gd.load(dataset, tok)
    with pytest.raises(UsageError, match="is a directory; give a file"):
        cli_config._read(tmp_path)


# ------------------------------------------------------------------------------------------- damaged Arrow data
def _save_to_disk(ws, path: Path) -> Path:
    import datasets

    rows = [json.loads(line) for line in ws.train.read_text().splitlines()]
    datasets.Dataset.from_list(rows).save_to_disk(str(path))
    return path


def _damage(kind: str, path: Path) -> Path:
    """A damaged copy of the Arrow dataset or Parquet file at ``path``; returns the file that was damaged."""
    target = next(path.glob("*.arrow")) if path.is_dir() else path
    data = bytearray(target.read_bytes())
    if kind == "truncated":
        data = data[:len(data) // 2]
    elif kind == "garbled":
        data[8:] = random.Random(0).randbytes(len(data) - 8)
    elif kind == "middle":  # headers intact, values damaged (Parquet: a data page of the second row group)
        start = len(data) // 2
        if not path.is_dir():
            import pyarrow.parquet as pq

            start = pq.ParquetFile(path).metadata.row_group(1).column(1).data_page_offset + 45
        for i in range(start, start + 200 if path.is_dir() else start + 60):
            data[i] ^= 0xFF
    elif kind == "state":
        target = path / "state.json"
        data = bytearray(b'{"_data_files": [')
    target.write_bytes(bytes(data))
    return target


@pytest.mark.parametrize("fmt", ["save_to_disk", "parquet"])
@pytest.mark.parametrize("kind", ["truncated", "garbled", "middle", "state"])
def test_damaged_arrow_and_parquet_data_is_one_line_naming_the_file(ws, runner, tmp_path, fmt, kind):
    if fmt == "parquet" and kind == "state":
        pytest.skip("a Parquet file has no state.json")
    if fmt == "save_to_disk":
        source = _save_to_disk(ws, tmp_path / "saved")
    else:
        import datasets
        import pyarrow.parquet as pq

        source = tmp_path / "train.parquet"
        rows = [json.loads(line) for line in ws.train.read_text().splitlines()]
        pq.write_table(datasets.Dataset.from_list(rows).data.table, source, row_group_size=8)
    damaged = _damage(kind, source)
    out = tmp_path / "store"
    line = error_line(invoke(runner, "collect", ws.model, source, "--out", out, "--no-progress", code=2))
    assert str(source) in line and ("damaged" in line or "not a readable" in line), line
    if fmt == "save_to_disk" and kind != "middle":  # the file itself is named where it cannot be opened
        assert damaged.name in line
    assert not out.exists()


# --------------------------------------------------------------------------------- truncation before tokenizing
def _tokenizers(lines: list[str]) -> dict[str, object]:
    """The kinds of tokenizers the project meets: byte-level BPE (GPT-2, Llama 3), BPE over the whole text with no
    pre-tokenizer (SentencePiece-style, Llama 2), WordPiece with [CLS]/[SEP] and its 100-character word limit
    (BERT), Unigram with Metaspace (T5), and a slow (Python) WordPiece."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import BertTokenizer, PreTrainedTokenizerFast

    from tests.cli.conftest import _tokenizer

    out: dict[str, object] = {"byte-level-bpe": _tokenizer(lines)}
    spm = Tokenizer(models.BPE(unk_token="<unk>"))
    spm.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    spm.decoder = decoders.Metaspace()
    spm.train_from_iterator(lines, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>"],
                                                       show_progress=False))
    spm.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    out["sentencepiece-bpe"] = PreTrainedTokenizerFast(tokenizer_object=spm, unk_token="<unk>", bos_token="<s>")
    wp = Tokenizer(models.WordPiece(unk_token="[UNK]", max_input_chars_per_word=100))
    wp.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    wp.normalizer = normalizers.BertNormalizer(lowercase=True)
    wp.train_from_iterator(lines, trainers.WordPieceTrainer(vocab_size=300, special_tokens=["[UNK]", "[CLS]",
                                                                                           "[SEP]", "[PAD]"],
                                                            show_progress=False))
    cls, sep = wp.token_to_id("[CLS]"), wp.token_to_id("[SEP]")
    wp.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]", special_tokens=[("[CLS]", cls),
                                                                                              ("[SEP]", sep)])
    out["wordpiece"] = PreTrainedTokenizerFast(tokenizer_object=wp, unk_token="[UNK]", cls_token="[CLS]",
                                               sep_token="[SEP]", pad_token="[PAD]")
    uni = Tokenizer(models.Unigram())
    uni.pre_tokenizer = pre_tokenizers.Metaspace()
    uni.decoder = decoders.Metaspace()
    uni.train_from_iterator(lines, trainers.UnigramTrainer(vocab_size=200, special_tokens=["<unk>"],
                                                           unk_token="<unk>", show_progress=False))
    out["unigram"] = PreTrainedTokenizerFast(tokenizer_object=uni, unk_token="<unk>")
    vocab = Path(tempfile.mkdtemp()) / "vocab.txt"
    vocab.write_text("\n".join(sorted(wp.get_vocab(), key=wp.get_vocab().get)) + "\n", encoding="utf-8")
    out["slow-wordpiece"] = BertTokenizer(str(vocab))
    return out


def _long_texts(lines: list[str], rng: random.Random) -> list[str]:
    """Texts far longer than a budget, of the shapes that stress a cut: prose, one giant word, whitespace runs,
    punctuation and non-ASCII, a word just over WordPiece's limit at the cut."""
    prose = " ".join(rng.choice(lines) for _ in range(600))
    return [prose, "x" * 30_000, "a" * 9_999 + " " + prose, " " * 20_000 + prose[:5_000], "\n\n  \t " * 4_000,
            ("héllo wörld 日本語 🤖 " * 2_000), "".join(rng.choice("ab c.,!\n") for _ in range(25_000)),
            " ".join("y" * rng.randint(90, 110) for _ in range(300)), prose[:3_000] + "z" * 20_000]


def test_truncated_tokens_equal_tokenizing_everything_then_truncating(ws, monkeypatch):
    rng = random.Random(0)
    texts = _long_texts(ws.lines, rng) + ws.lines[:5]  # and short ones, tokenized whole
    records = [{"text": t} for t in texts]
    for name, tok in _tokenizers(ws.lines).items():
        full = tok(texts, add_special_tokens=True)["input_ids"]
        for max_length in (16, 100):
            data = gd.load(records, tok, read_options=ReadOptions(max_length=max_length, truncate=True))
            with monkeypatch.context() as unbounded:  # every text tokenized whole, as before the bound
                unbounded.setattr(tokenize, "_prefix_ids", lambda *args: None)
                reference = gd.load(records, tok, read_options=ReadOptions(max_length=max_length, truncate=True))
            for i, ids in enumerate(full):
                assert data.example(i)[0].tolist() == ids[:max_length], (name, max_length, i)
            assert data.ids == reference.ids and data.summary == reference.summary, name  # content hashes too
            assert data.summary.cut == sum(len(ids) > max_length for ids in full), name


def test_prompt_completion_with_a_long_completion_is_cut_before_tokenizing(ws):
    from tests.cli.conftest import _tokenizer

    tok = _tokenizer(ws.lines)
    rng = random.Random(1)
    prose = " ".join(rng.choice(ws.lines) for _ in range(3_000))  # ~150,000 characters
    records = [{"prompt": ws.lines[i] + " " + prose[:2_000 * i], "completion": " " + prose} for i in range(4)]
    calls = _spy_lengths(tok)
    data = gd.load(records, tok, read_options=ReadOptions(max_length=24, truncate=True))
    longest = max(calls)  # before the reference below tokenizes every text whole
    eos = tok.eos_token
    for i, r in enumerate(records):
        prompt = tok(r["prompt"])["input_ids"]
        full = tok(r["prompt"] + r["completion"] + eos)["input_ids"]
        left = max(len(prompt) - 1, 0)  # prompt cut from the left, one token of context kept
        assert data.example(i)[0].tolist() == full[left:left + 24], i
    assert longest < len(records[3]["prompt"]) + 64 * 1024 < len(records[3]["completion"])
    assert data.summary.cut == len(records)


def _spy_lengths(tok) -> list[int]:
    """Record the length of every text the tokenizer is called with (``tok`` is patched in place)."""
    seen: list[int] = []
    real = type(tok).__call__

    def call(self, text, *args, **kwargs):
        seen.extend(len(t) for t in (text if isinstance(text, list) else [text]))
        return real(self, text, *args, **kwargs)

    tok.__class__ = type("Spied", (type(tok),), {"__call__": call})
    return seen


def test_a_long_jsonl_line_is_not_tokenized_whole(ws, runner, tmp_path):
    from tests.cli.conftest import _tokenizer

    tok = _tokenizer(ws.lines)
    line = " ".join(random.Random(2).choice(ws.lines) for _ in range(40_000))  # ~2 MB of text
    path = tmp_path / "long.jsonl"
    path.write_text(json.dumps({"text": line}) + "\n" + json.dumps({"text": ws.lines[0]}) + "\n")
    seen = _spy_lengths(tok)
    data = gd.load(path, tok, read_options=ReadOptions(max_length=32, truncate=True))
    assert data.summary.cut == 1 and len(data.example(0)[0]) == 32
    assert max(seen) < 64 * 1024 < len(line)
    assert data.example(0)[0].tolist() == tok(line[:20_000])["input_ids"][:32]
    seen.clear()  # without --truncate the example is too long: said so, still without tokenizing it whole
    with pytest.raises(gd.DataError, match="line 1 has more tokens than --max-length 32"):
        gd.load(path, tok, read_options=ReadOptions(max_length=32))
    assert max(seen) < 64 * 1024
    result = invoke(runner, "collect", ws.model, path, "--out", tmp_path / "store", "--max-length", 32, "--truncate",
                    "--dry-run", "--no-progress")
    assert "2 examples" in result.output and not (tmp_path / "store").exists()


def test_budget_settles_on_the_tokens_of_the_whole_text_when_prefixes_disagree(ws, monkeypatch):
    """A giant word that a WordPiece tokenizer turns into [UNK] whole but into pieces when cut short (two cuts
    inside it agree with each other, not with the whole text): cuts fall where words end, so the word is whole."""
    tok = _tokenizers(ws.lines)["wordpiece"]
    monkeypatch.setattr(tokenize, "_MIN_CHARS", 16)
    monkeypatch.setattr(tokenize, "_CHARS_PER_TOKEN", 1)
    text = "the king " + "q" * 150 + " " + " ".join(ws.lines[:400])
    data = gd.load([{"text": text}], tok, read_options=ReadOptions(max_length=8, truncate=True))
    assert data.example(0)[0].tolist() == tok(text)["input_ids"][:8]
    assert "[UNK]" in tok.convert_ids_to_tokens(data.example(0)[0].tolist())  # the 150-letter word, whole


# ------------------------------------------------------------------------------------------ changed data files
@pytest.fixture
def project(ws, runner, tmp_path):
    """A store collected from a data file of its own (to edit) and scores of it."""
    data = tmp_path / "train.jsonl"
    shutil.copy(ws.train, data)
    invoke(runner, "collect", ws.model, data, "--out", tmp_path / "store", "--rank", 4, "--no-progress")
    invoke(runner, "score", tmp_path / "store", ws.queries, "--model", ws.model, "--out", tmp_path / "scores",
           "--topk", 3, "--no-progress")
    return tmp_path


def _edit_same_size(path: Path) -> None:
    """Another text of the same length for the first record (its size stays, its bytes change)."""
    lines = path.read_text().splitlines(keepends=True)
    record = json.loads(lines[0])
    record["text"] = record["text"][::-1]
    lines[0] = json.dumps(record) + "\n"
    path.write_text("".join(lines))


def test_changed_data_file_is_a_warning_where_its_texts_are_shown(ws, runner, project):
    data, scores = project / "train.jsonl", project / "scores"
    for args in (("topk", scores, "--data", data), ("report", scores, "--out", project / "before.html")):
        assert "changed since" not in invoke(runner, *args).output  # unchanged: no warning
    _edit_same_size(data)  # same size, other bytes: found by the hash
    for args in (("topk", scores, "--data", data, "--format", "json"),
                 ("report", scores, "--out", project / "after.html"),
                 ("self-influence", project / "store")):
        result = invoke(runner, *args)
        warned = [line for line in result.output.splitlines()  # the data warning once (others may be said too)
                  if line.startswith("Warning:") and "changed since" in line]
        assert len(warned) == 1 and str(data) in warned[0] and "changed since `gradtrace collect` read it" in \
            warned[0] and "may not be" in warned[0], result.output
    with data.open("a") as f:  # grown: found by the size alone
        f.write(json.dumps({"id": "new", "text": "a new line"}) + "\n")
    result = invoke(runner, "topk", scores, "--data", data)
    assert "Warning:" in result.output and "bytes" in result.output
    from gradtrace import Scores

    with pytest.warns(DataChangedWarning, match="train.jsonl"):
        Scores.load(scores).to_html(project / "python.html")


def test_changed_data_file_is_refused_where_gradients_are_recaptured(ws, runner, project, monkeypatch):
    data, scores = project / "train.jsonl", project / "scores"
    before = _snapshot(scores), _snapshot(project / "store")
    _edit_same_size(data)
    loads: list[Path] = []
    real = score_queries.load_model
    monkeypatch.setattr(score_queries, "load_model", lambda path, *a, **k: loads.append(path) or real(path, *a, **k))
    result = invoke(runner, "score", project / "store", ws.queries, "--model", ws.model, "--out", scores,
                    "--overwrite", "--topk", 2, "--tokens", "--no-progress", code=2)
    line = error_line(result)
    assert "--tokens" in line and str(data) in line and "changed since" in line
    assert loads == [] and (_snapshot(scores), _snapshot(project / "store")) == before


def test_data_hash_is_computed_once_per_file_state(tmp_path, monkeypatch):
    from gradtrace.common import provenance
    from gradtrace.data import files

    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "a"}\n')
    recorded = {"gradtrace": {"data": provenance.file_fingerprint(path)}}
    calls: list[Path] = []
    real = provenance.file_fingerprint
    monkeypatch.setattr(provenance, "file_fingerprint", lambda p, **k: calls.append(p) or real(p, **k))
    assert files.data_changed(path, recorded) is None and files.data_changed(path, recorded) is None
    assert len(calls) == 1
    path.write_text('{"text": "b"}\n')
    assert "hash" in files.data_changed(path, recorded) and len(calls) == 2
    path.write_text('{"text": "bb"}\n')
    assert "bytes" in files.data_changed(path, recorded) and len(calls) == 2  # the size tells: no hash

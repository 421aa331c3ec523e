"""Per-example gradients from OLMo-core's trainer (``ai2-olmo-core``), wrapped by the plain ``gradtrace.capture``.

OLMo-core has its own trainer and data pipeline; nothing in it changes. Its train module backpropagates, for
every micro-batch, ``sum of token losses / (target tokens of the whole batch)`` with pre-shifted labels, so
the capture is told ``Loss(reduction="sum", causal_lm=False)`` with a ``scale`` of ``1 / tokens``. A small
OLMo-core callback feeds that token count and the batch's instance indices (the ids) before each step, and
keeps the forward/backward "dry run" OLMo-core does on a mock batch before training out of the store.

OLMo-core's dependencies (``cached-path`` -> boto3, google-cloud-storage; ``rich<14``, ``huggingface-hub<2``,
``filelock<4``) conflict with this project's pinned environment, so it is not installed in CI: install it in a
separate environment (``pip install ai2-olmo-core``) to run this example.

    python examples/olmo_core.py [--docs 48] [--steps 6]
"""

from __future__ import annotations

import argparse
import collections
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

import gradtrace
from gradtrace.data.corpus import PLANTED, load_plays, train_tokenizer
from gradtrace.demo.report import report_planted
from gradtrace.options import CaptureOptions, Loss, StoreOptions

# run as a script, this file's directory comes first on sys.path and the file would shadow the olmo_core package
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]


def available() -> bool:
    """Whether OLMo-core can be imported here."""
    try:
        import olmo_core.train  # noqa: F401
    except ImportError:
        return False
    return True


def _feed_class():
    from olmo_core.data.utils import get_labels
    from olmo_core.train.callbacks import Callback

    class GradtraceFeed(Callback):
        """An OLMo-core callback and a capture callback: before each step it takes the batch's ids (consumed in
        order by the capture, micro-batch by micro-batch) and its loss denominator; it hands captured batches
        to ``writer``, except those of OLMo-core's dry run on a mock batch before training."""

        def __init__(self, names: list[str], writer: gradtrace.StoreWriter) -> None:
            super().__init__()
            self.names = names  # instance index -> document id
            self.writer = writer
            self.pending: collections.deque = collections.deque()
            self.tokens = 1
            self.updates = 0  # optimizer steps completed before the current one
            self.dry_run = False

        # OLMo-core events
        def pre_train(self) -> None:
            self.dry_run = True  # the next forward/backward is the dry run

        def pre_step(self, batch: dict[str, Any]) -> None:
            self.dry_run = False
            self.tokens = max(1, int((get_labels(batch) != -100).sum()))  # what train_batch divides by
            self.pending.extend(self.names[i] for i in batch["index"].tolist())
            self.updates = self.trainer.global_step - 1

        # for gradtrace.capture
        def loss_scale(self) -> float:
            return 1.0 / self.tokens

        def __iter__(self):
            return self

        def __next__(self) -> str:
            if self.dry_run:
                return "dry-run"
            if not self.pending:
                raise StopIteration
            return self.pending.popleft()

        def on_capture_start(self, capture: Any) -> None:
            self.writer.on_capture_start(capture)

        def on_batch(self, batch: Any, capture: Any) -> None:
            if not self.dry_run:
                self.writer.on_batch(batch, capture)

        def on_capture_end(self, capture: Any, error: BaseException | None) -> None:
            self.writer.on_capture_end(capture, error)

    return GradtraceFeed


def main(out_dir: str | Path = "runs/olmo_core", *, docs: int = 48, steps: int = 6, batch_size: int = 8,
         micro_batch: int = 4, seq_len: int = 48, width: int = 32, rank: int | None = 16, seed: int = 0,
         callbacks: dict[str, Any] | None = None, verbose: bool = True) -> dict[str, Any]:
    if not available():
        raise ImportError("this example needs OLMo-core: pip install ai2-olmo-core (in its own environment)")
    from olmo_core.data import NumpyDataLoaderConfig, TokenizerConfig
    from olmo_core.data.numpy_dataset import NumpyPaddedFSLDatasetConfig
    from olmo_core.nn.transformer import TransformerConfig
    from olmo_core.optim import AdamWConfig
    from olmo_core.train import Duration, TrainerConfig, prepare_training_environment
    from olmo_core.train.train_module import TransformerTrainModuleConfig

    say = print if verbose else (lambda *a, **k: None)
    started = time.perf_counter()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="olmo-", dir=out))
    corpus = [(d.id, d.text) for d in load_plays(docs, words_per_doc=20, seed=seed)]
    corpus += [(p.id, p.text) for p in PLANTED]
    tokenizer = train_tokenizer([text for _, text in corpus], vocab_size=512)
    eos = tokenizer.eos_token_id
    tokens = [[*tokenizer(text).input_ids[:seq_len - 1], eos] for _, text in corpus]  # one instance per document
    flat = np.concatenate([np.asarray(t, dtype=np.uint16) for t in tokens])
    np.memmap(work / "tokens.npy", dtype=np.uint16, mode="w+", shape=flat.shape)[:] = flat

    prepare_training_environment(seed=seed, backend=None)
    tokenizer_config = TokenizerConfig(vocab_size=len(tokenizer), eos_token_id=eos, pad_token_id=tokenizer.pad_token_id)
    dataset = NumpyPaddedFSLDatasetConfig(tokenizer=tokenizer_config, paths=[str(work / "tokens.npy")],
                                          sequence_length=seq_len, work_dir=str(work / "dataset")).build()
    model = TransformerConfig.llama_like(d_model=width, vocab_size=len(tokenizer), n_layers=2, n_heads=2,
                                         hidden_size_multiple_of=16).build(init_device="cpu")
    train_module = TransformerTrainModuleConfig(rank_microbatch_size=micro_batch * seq_len, max_sequence_length=seq_len,
                                                optim=AdamWConfig(lr=3e-3)).build(model, device=torch.device("cpu"))
    loader = NumpyDataLoaderConfig(global_batch_size=batch_size * seq_len, seed=seed,
                                   work_dir=str(work / "loader")).build(dataset)
    names = [i for i, _ in corpus]
    for index in (0, len(names) - 1):  # instance i is document i
        assert dataset[index]["input_ids"][:len(tokens[index])].tolist() == tokens[index]
    logra = gradtrace.LoGra(rank=rank, seed=seed) if rank else None
    writer = gradtrace.StoreWriter(out / "store", StoreOptions(overwrite=True),
                                   fields=lambda b: {"step": [feed.updates] * len(b)})
    feed = _feed_class()(names, writer)
    trainer = TrainerConfig(save_folder=str(work / "checkpoints"), max_duration=Duration.steps(steps),
                            no_checkpoints=True, device="cpu", metrics_collect_interval=steps,
                            callbacks={"gradtrace": feed, **(callbacks or {})}).build(train_module, loader)

    # OLMo-core's RMSNorm registers bias=None, which gradtrace's norm-formula probe does not handle yet: the norm
    # weights are left out explicitly (a capture would otherwise warn that it cannot capture them)
    loss = Loss(reduction="sum", scale=feed.loss_scale, causal_lm=False)  # what train_batch backpropagates
    capturing = CaptureOptions(projection=logra, exclude=["*norm"])
    with gradtrace.capture(model, loss, options=capturing, ids=feed, callbacks=[feed]) as cap:
        trainer.fit()
    store = gradtrace.GradientStore.open(out / "store")
    say(f"\n{cap.report()}".splitlines()[1])
    say(f"store: {len(store)} rows x {store.dim} dims from {steps} OLMo-core steps "
        f"({batch_size} documents, micro-batches of {micro_batch})")

    # questions paraphrasing the planted facts, at the trained weights, with the same (pre-shifted) loss
    def loss_fn(model: torch.nn.Module, batch: dict) -> torch.Tensor:
        logits = model(batch["input_ids"])  # [B, T, V]
        per_token = torch.nn.functional.cross_entropy(logits.transpose(1, 2), batch["labels"], reduction="none")
        return per_token.sum(1)  # [B]: each question's summed token loss

    questions = [[*tokenizer(p.query).input_ids, eos] for p in PLANTED]
    longest = max(len(q) for q in questions)
    input_ids = torch.tensor([q + [tokenizer.pad_token_id] * (longest - len(q)) for q in questions])
    labels = torch.tensor([q[1:] + [-100] * (longest - len(q) + 1) for q in questions])
    query_batch = {"id": [f"query-{p.id.removeprefix('planted-')}" for p in PLANTED], "input_ids": input_ids,
                   "labels": labels}
    queries = gradtrace.collect(model, [query_batch], loss_fn, options=capturing)
    scores = gradtrace.Attributor("grad_cos", store).score(queries, topk=3)
    report_planted(scores, dict(corpus), say, show=2)
    seconds = time.perf_counter() - started
    say(f"\ntime {seconds:.1f} s")
    return {"store": store, "scores": scores, "model": model, "corpus": corpus, "tokens": tokens,
            "seconds": seconds}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/olmo_core")
    parser.add_argument("--docs", type=int, default=48)
    parser.add_argument("--steps", type=int, default=6)
    opts = parser.parse_args()
    main(opts.out, docs=opts.docs, steps=opts.steps)

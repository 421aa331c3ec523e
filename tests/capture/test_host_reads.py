"""No data-dependent host reads on the capture path (issue #30, item 1): the host reads gradtrace itself makes
during a captured run (``Tensor.item``, ``__bool__``/``__float__``, ``tolist``, ``.cpu()``/``.numpy()``, ``nonzero``,
boolean-mask indexing, ``masked_select``; counted by ``bench/host_reads.py``'s ``TorchFunctionMode``) are a small
number per batch, the same for a model of 2 layers and of 8: none in a layer's hooks. Each such read would stop the
CPU until a GPU catches up. The test runs the device path on the CPU (``assemble.CPU_FAST_PATH`` off: on the CPU a
read waits for nothing, so ``zero_outside`` reads once per layer there to skip a copy)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

import gradtrace
from gradtrace.capture import assemble
from gradtrace.options import CaptureOptions, Loss, StoreOptions

PER_BATCH = 24
"""At most this many reads per batch (measured: 14 for a LoGra training loop to 22 for an exact ``collect``; a
``.cpu()`` and the ``.numpy()`` of its result count as two). They are the batch's token copy for content digests,
its padding flag, its non-finite flags, the ledger's id check and the rows' copy to the writer -- none per layer."""


def _counter():
    spec = importlib.util.spec_from_file_location("host_reads", Path(__file__).resolve().parents[2] / "bench" /
                                                  "host_reads.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.HostReads


def _gpt2(layers: int):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=layers, n_head=2,
                                      bos_token_id=1, eos_token_id=1))


def _batches(count: int) -> list[dict]:
    gen = torch.Generator().manual_seed(1)
    out = []
    for b in range(count):
        mask = torch.ones(3, 12, dtype=torch.long)
        mask[0, 8:], mask[2, 5:] = 0, 0  # padding in every batch
        out.append({"input_ids": torch.randint(2, 64, (3, 12), generator=gen), "attention_mask": mask,
                    "id": [f"b{b}e{i}" for i in range(3)]})
    return out


def _gradtrace_reads(reads) -> int:
    return sum(n for (_, where), n in reads.sites.items() if where != "model")


def _collect_reads(tmp_path: Path, layers: int, logra: bool, batches: int) -> int:
    model = _gpt2(layers)
    projection = gradtrace.LoGra(rank=2) if logra else None
    with _counter()() as reads:
        gradtrace.collect(model, _batches(batches), store=tmp_path / f"{layers}-{logra}-{batches}",
                          options=CaptureOptions(projection=projection), store_options=StoreOptions(dtype="int8"))
    return _gradtrace_reads(reads)


def _loop_reads(tmp_path: Path, layers: int, logra: bool, batches: int) -> int:
    """A training loop's captured steps (forward, mean loss, backward, optimizer step) into an int8 store."""
    model = _gpt2(layers)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    writer = gradtrace.StoreWriter(tmp_path / f"loop-{layers}-{logra}-{batches}", StoreOptions(dtype="int8"))
    projection = gradtrace.LoGra(rank=2) if logra else None
    data = _batches(batches)
    capture = gradtrace.capture(model, Loss(reduction="token_mean"), options=CaptureOptions(projection=projection),
                                callbacks=[writer])
    with _counter()() as reads, capture as cap:
        for batch in data:
            cap.annotate(ids=batch["id"])
            labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
            model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=labels).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    return _gradtrace_reads(reads)


def _fit_reads(tmp_path: Path, layers: int, logra: bool, batches: int) -> int:
    """An EK-FAC fit (two passes over the data): per-batch reads only; the token counts are read once per block at
    the end of the fit, not per batch (the difference of two batch counts leaves them out)."""
    from gradtrace.fit.curvature import fit_curvature
    from gradtrace.options import FitOptions

    model = _gpt2(layers)
    data = [{k: v for k, v in b.items() if k != "id"} for b in _batches(batches)]
    projection = gradtrace.LoGra(rank=2) if logra else None
    with _counter()() as reads:
        fit_curvature(model, data, options=CaptureOptions(projection=projection), fit_options=FitOptions(kind="ekfac"))
    at_end = sum(n for (_, where), n in reads.sites.items() if where.startswith("fit/curvature/fit.py"))
    return _gradtrace_reads(reads) - at_end


@pytest.mark.parametrize("logra", [False, True], ids=["exact", "logra"])
@pytest.mark.parametrize("run", [_collect_reads, _loop_reads, _fit_reads], ids=["collect", "loop", "fit"])
def test_host_reads_are_a_small_constant_per_batch_whatever_the_depth(tmp_path, monkeypatch, run, logra):
    monkeypatch.setattr(assemble, "CPU_FAST_PATH", False)  # the device path, run on the CPU
    counts = {(layers, batches): run(tmp_path, layers, logra, batches) for layers in (2, 8) for batches in (1, 3)}
    assert counts[(2, 1)] == counts[(8, 1)] and counts[(2, 3)] == counts[(8, 3)], counts  # nothing per layer
    per_batch = (counts[(2, 3)] - counts[(2, 1)]) / 2
    assert 0 < per_batch <= PER_BATCH, counts

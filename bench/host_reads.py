"""Host reads during a collection: where gradtrace's own code reads a tensor's value on the host (issue #30, item 1).

On a GPU each of these stops the CPU until the device catches up: ``Tensor.item``, ``__bool__`` / ``__float__`` /
``__int__``, ``tolist``, ``.cpu()``, ``.numpy()``, ``nonzero``, ``masked_select`` and boolean-mask indexing.
Wrappers on ``torch.Tensor``'s methods count them (in autograd hooks too) during ``gradtrace.collect`` of one padded
batch (so once-per-run work -- the
model's fingerprint, the NaN check of its weights -- is counted too, and labelled), by the gradtrace line that made
them, for GPT-2 models of 2 and 8 layers, exact and LoGra capture. Counts that grow with depth are per-layer syncs
on the hot path. Runs on CPU (the reads are the same on any device). Usage::

    python bench/host_reads.py
"""

from __future__ import annotations

import collections
import threading
import traceback

import torch
from torch.overrides import TorchFunctionMode

from gradtrace.options import CaptureOptions

READ_METHODS = ("item", "__bool__", "__float__", "__int__", "tolist", "cpu", "numpy", "nonzero", "masked_select")
"""``torch.Tensor`` methods that read a tensor's value on the host (with ``torch.nonzero`` and ``torch.masked_select``,
and ``__getitem__`` with a boolean mask)."""


class _BooleanIndexing(TorchFunctionMode):
    """Boolean-mask indexing, seen through a ``TorchFunctionMode`` (``Tensor.__getitem__`` cannot be wrapped on the
    class: CPython would then dispatch indexing through the sequence protocol even after the wrapper is removed).
    Such a mode is not active inside autograd hooks, so boolean indexing there goes uncounted."""

    def __init__(self, note) -> None:
        super().__init__()
        self._note = note

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.__getitem__ and len(args) > 1:
            items = args[1] if isinstance(args[1], tuple) else (args[1],)
            if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items):
                self._note("__getitem__")
        return func(*args, **(kwargs or {}))


class HostReads:
    """Counts host reads by ``(kind, gradtrace file:line)`` (``model`` when no gradtrace frame made them) while
    active, in every thread but the store's background writer (which only ever handles host copies): the methods
    are wrapped on ``torch.Tensor`` itself, so reads inside autograd hooks and engine callbacks -- where a
    ``TorchFunctionMode`` does not reach -- are counted too."""

    def __init__(self) -> None:
        self.sites: collections.Counter = collections.Counter()
        self._saved: list[tuple[object, str, object]] = []
        self._inside = threading.local()

    def _note(self, kind: str) -> None:
        if threading.current_thread().name.startswith("gradtrace-store"):
            return
        frames = [f for f in traceback.extract_stack()[:-2] if "/gradtrace/" in f.filename]
        where = f"{frames[-1].filename.split('/gradtrace/')[-1]}:{frames[-1].lineno}" if frames else "model"
        self.sites[(kind, where)] += 1

    def _wrap(self, owner: object, name: str, counts=None) -> None:
        original = getattr(owner, name)
        # restored by deleting the wrapper when the name was inherited (TensorBase's C slots): assigning a slot
        # wrapper back onto torch.Tensor would change how the type dispatches indexing (a 0-d tensor would then
        # go through the sequence protocol and fail on len())
        self._saved.append((owner, name, original if name in vars(owner) else None))
        note, inside = self._note, self._inside

        def wrapped(*args, **kwargs):
            if getattr(inside, "active", False):  # called again through a TorchFunctionMode's dispatch: one read
                return original(*args, **kwargs)
            if counts is None or counts(args):
                note(name)
            inside.active = True
            try:
                return original(*args, **kwargs)
            finally:
                inside.active = False

        setattr(owner, name, wrapped)

    def __enter__(self) -> HostReads:
        for name in READ_METHODS:
            self._wrap(torch.Tensor, name)
        for name in ("nonzero", "masked_select"):
            self._wrap(torch, name)

        self._indexing = _BooleanIndexing(self._note)
        self._indexing.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._indexing.__exit__(*exc)
        for owner, name, original in reversed(self._saved):
            if original is None:
                delattr(owner, name)
            else:
                setattr(owner, name, original)
        self._saved.clear()


def count(layers: int, logra: bool) -> collections.Counter:
    from transformers import GPT2Config, GPT2LMHeadModel

    import gradtrace
    from gradtrace.capture import assemble

    assemble.CPU_FAST_PATH = False  # the path a device takes (on the CPU a read waits for nothing)

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=128, n_positions=32, n_embd=32, n_layer=layers, n_head=2,
                                       bos_token_id=1, eos_token_id=1))
    ids = torch.randint(0, 128, (4, 16))
    mask = torch.ones(4, 16, dtype=torch.long)
    mask[0, 10:], mask[2, 5:] = 0, 0  # padding
    batch = {"input_ids": ids, "attention_mask": mask, "id": [f"e{i}" for i in range(4)]}
    with HostReads() as reads:
        gradtrace.collect(model, [batch], options=CaptureOptions(projection=gradtrace.LoGra(rank=4) if logra else None))
    return reads.sites


def main() -> None:
    import transformers

    transformers.utils.logging.set_verbosity_error()
    runs = {(layers, logra): count(layers, logra) for layers in (2, 8) for logra in (False, True)}
    sites = sorted({site for counts in runs.values() for site in counts})
    print(f"{'site':<44} " + " ".join(f"{f'{n}L ' + ('logra' if lg else 'exact'):>10}" for n, lg in runs))
    for site in sites:
        values = [runs[key][site] for key in runs]
        grows = " <- grows with depth" if values[2] > values[0] else ""
        print(f"{site[0] + ' ' + site[1]:<44} " + " ".join(f"{v:>10}" for v in values) + grows)
    print(f"{'total':<44} " + " ".join(f"{sum(c.values()):>10}" for c in runs.values()))


if __name__ == "__main__":
    main()

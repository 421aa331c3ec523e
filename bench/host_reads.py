"""Host reads during a collection: where gradtrace's own code reads a tensor's value on the host (issue #30, item 1).

On a GPU each of these stops the CPU until the device catches up: ``Tensor.item``, ``__bool__`` / ``__float__`` /
``__int__``, ``tolist``, ``.cpu()``, ``.numpy()``, ``nonzero``, ``masked_select`` and boolean-mask indexing. A
``TorchFunctionMode`` counts them during ``gradtrace.collect`` of one padded batch (so once-per-run work -- the
model's fingerprint, the NaN check of its weights -- is counted too, and labelled), by the gradtrace line that made
them, for GPT-2 models of 2 and 8 layers, exact and LoGra capture. Counts that grow with depth are per-layer syncs
on the hot path. Runs on CPU (the reads are the same on any device). Usage::

    python bench/host_reads.py
"""

from __future__ import annotations

import collections
import traceback

import torch
from torch.overrides import TorchFunctionMode

from gradtrace.options import CaptureOptions

READS = (torch.Tensor.item, torch.Tensor.__bool__, torch.Tensor.__float__, torch.Tensor.__int__, torch.Tensor.tolist,
         torch.Tensor.cpu, torch.Tensor.numpy, torch.Tensor.nonzero, torch.nonzero, torch.Tensor.masked_select,
         torch.masked_select)


class HostReads(TorchFunctionMode):
    """Counts host reads by ``(kind, gradtrace file:line)`` (``model`` when no gradtrace frame made them)."""

    def __init__(self) -> None:
        super().__init__()
        self.sites: collections.Counter = collections.Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        hit = func in READS
        if func is torch.Tensor.__getitem__ and len(args) > 1:
            items = args[1] if isinstance(args[1], tuple) else (args[1],)
            hit = any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)
        if hit:
            frames = [f for f in traceback.extract_stack()[:-1] if "/gradtrace/" in f.filename]
            where = f"{frames[-1].filename.split('/gradtrace/')[-1]}:{frames[-1].lineno}" if frames else "model"
            self.sites[(func.__name__, where)] += 1
        return func(*args, **(kwargs or {}))


def count(layers: int, logra: bool) -> collections.Counter:
    from transformers import GPT2Config, GPT2LMHeadModel

    import gradtrace

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

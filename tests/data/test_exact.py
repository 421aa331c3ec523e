"""Exactness: the stored gradient of each example is the gradient of the loss the model was trained on.

For prompt/completion data that is the completion-only loss, for conversations the assistant-only loss. The
reference is brute force, one backward pass per example, no projection: (a) the summed cross-entropy of the
in-loss tokens computed by hand from the logits, and (b) the masked-labels loss Hugging Face computes
(``model(input_ids, labels=labels).loss``, a mean over targets, times their number). Float32 throughout: the
captured and reference gradients differ only by summation order, far below the 1e-4 relative bound.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import gradtrace
import gradtrace.data as gd
from gradtrace.common.modules import canonical_param_names
from gradtrace.options.data import BatchOptions, ReadOptions
from tests.data.conftest import conversation_records, gpt2, make_tokenizer, pair_records

RTOL = 1e-4


def _flat_grad(model, names: list[str]) -> torch.Tensor:
    by_name = {canonical_param_names(model)[id(p)]: p for p in model.parameters()}
    return torch.cat([(by_name[n].grad if by_name[n].grad is not None else torch.zeros_like(by_name[n])).reshape(-1)
                      for n in names])


def _reference(model, data, names: list[str], hf: bool) -> torch.Tensor:
    rows = []
    for i in range(data.num_examples):
        ids, in_loss = data.example(i)
        input_ids = torch.from_numpy(ids)[None]  # [1, T]
        model.zero_grad(set_to_none=True)
        if hf:
            labels = torch.where(torch.from_numpy(in_loss)[None], input_ids, -100)
            out = model(input_ids=input_ids, labels=labels)
            (out.loss * int(in_loss[1:].sum())).backward()
        else:
            logits = model(input_ids=input_ids).logits[0, :-1]  # [T - 1, V]: position t predicts token t + 1
            targets = torch.from_numpy(in_loss[1:])
            F.cross_entropy(logits[targets], input_ids[0, 1:][targets], reduction="sum").backward()
        rows.append(_flat_grad(model, names))
    model.zero_grad(set_to_none=True)
    return torch.stack(rows)


def _assert_rows_close(got: torch.Tensor, want: torch.Tensor) -> None:
    err = (got - want).norm(dim=1) / want.norm(dim=1)
    assert float(err.max()) <= RTOL, err


@pytest.mark.parametrize("kind", ["prompt-completion", "messages-generation", "messages-plain",
                                  "conversational-prompt-completion"])
def test_stored_gradient_is_the_training_loss_gradient(kind):
    template = "plain" if kind == "messages-plain" else "generation"
    tok = make_tokenizer(template)
    model = gpt2(len(tok))
    if kind == "prompt-completion":
        records = pair_records()
    elif kind == "conversational-prompt-completion":
        records = [{"id": r["id"], "prompt": r["messages"][:-1], "completion": r["messages"][-1:]}
                   for r in conversation_records()]
    else:
        records = conversation_records()
    data = gd.load(records, tok, batch_options=BatchOptions(batch_size=4))  # ragged: right padding inside a batch
    assert any((~data.example(i)[1][1:]).any() for i in range(data.num_examples))  # some tokens are not targets
    grads = gradtrace.collect(model, data)
    assert grads.ids == data.ids
    names = [n for n, _ in grads.spec.params]
    got = grads.vectors
    _assert_rows_close(got, _reference(model, data, names, hf=False))
    _assert_rows_close(got, _reference(model, data, names, hf=True))
    # the prompt's tokens are not in the loss: the all-tokens gradient is another one
    everything = gradtrace.collect(model, gd.load(records, tok, read_options=ReadOptions(loss_on="all"),
                                                  batch_options=BatchOptions(batch_size=4)))
    rel = (everything.vectors - got).norm(dim=1) / got.norm(dim=1)
    assert float(rel.min()) > 1e-2


def test_left_truncated_example_gradient():
    """A prompt cut from the left: the stored gradient is that of the completion given the kept context."""
    tok = make_tokenizer("generation")
    model = gpt2(len(tok))
    records = pair_records()
    full = gd.load(records, tok)
    limit = int(np.max([len(full.example(i)[0]) for i in range(full.num_examples)])) - 3
    data = gd.load(records, tok, read_options=ReadOptions(max_length=limit), batch_options=BatchOptions(batch_size=3))
    assert data.summary.prompt_truncated > 0
    grads = gradtrace.collect(model, data)
    names = [n for n, _ in grads.spec.params]
    _assert_rows_close(grads.vectors, _reference(model, data, names, hf=False))

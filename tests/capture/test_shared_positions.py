"""A learned position embedding called as ``self.pos(torch.arange(T))`` and a Linear over a batch-shared ``[T, d]``
input: their ``[T, d]`` outputs are broadcast onto the ``[B, T, d]`` token embeddings, and each example's gradient
of their weights comes from its own share of the broadcast result's gradient. Checked against brute force (one
backward pass per example, on the example alone), exact and LoGra, padded, per token, and through collect()/scores;
uses that the expansion would change are refused, naming broadcast="skip"."""

import warnings
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import gradtrace
from gradtrace.capture.token_rows import SharedRows
from gradtrace.loss.functions import causal_lm_loss
from gradtrace.options import CaptureOptions
from tests import tiny

VOCAB, WIDTH, MAX_T = 29, 8, 12


class PositionLM(nn.Module):
    """Token embeddings plus ``pos(arange(T))`` plus ``table(sinusoids[:T])`` (a Linear on a batch-shared input),
    one causal mixing step (a cumulative mean over earlier tokens), a head."""

    def __init__(self, use: str = "add") -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, WIDTH)
        self.pos = nn.Embedding(MAX_T, WIDTH)
        self.table = nn.Linear(WIDTH, WIDTH)
        self.mix = nn.Linear(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)
        angles = torch.arange(MAX_T)[:, None] / 10 ** (torch.arange(WIDTH)[None] / WIDTH)
        self.register_buffer("sinusoids", torch.sin(angles))
        self.use = use

    def forward(self, input_ids, attention_mask=None, labels=None):
        T = input_ids.shape[1]
        pos = self.pos(torch.arange(T))  # [T, d]: computed once for the batch
        if self.use == "unsqueeze":
            pos = pos.unsqueeze(0)  # [1, T, d]: broadcasts the same way
        elif self.use == "view":
            pos = pos[None].squeeze(0).view(1, T, WIDTH)
        elif self.use == "matmul":
            pos = pos @ torch.eye(WIDTH)  # a use the expansion would change (it would see B rows)
        h = self.tok(input_ids) + pos + self.table(self.sinusoids[:T])
        h = 0.5 * h  # elementwise with a scalar: the broadcast result is a plain batch tensor already
        causal = torch.cumsum(h, 1) / torch.arange(1, T + 1)[None, :, None]
        return SimpleNamespace(logits=self.head(torch.tanh(self.mix(causal))))


def _batch(lengths=(5, 9, 3, 7)):
    torch.manual_seed(1)
    T = max(lengths)
    ids = torch.zeros(len(lengths), T, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        ids[i, :n] = torch.randint(1, VOCAB, (n,))
        mask[i, :n] = 1
    labels = ids.masked_fill(mask == 0, -100)
    rows = [ids[i, :n] for i, n in enumerate(lengths)]
    return rows, {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _single_loss(model, row):
    ids = row.unsqueeze(0)
    return tiny.lm_example_loss(model(input_ids=ids).logits, ids).sum()


def _model(use="add"):
    torch.manual_seed(0)
    return PositionLM(use)


@pytest.mark.parametrize("use", ["add", "unsqueeze", "view"])
def test_shared_position_embedding_and_linear_match_one_backward_per_example(use):
    model = _model(use)
    rows, batch = _batch()
    ref = tiny.reference_grads(model, rows, _single_loss)  # each example alone: T = its own length
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing is left out
        with gradtrace.capture(model, options=CaptureOptions(verify=True)) as cap:
            out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
            tiny.lm_example_loss(out.logits, batch["labels"]).mean().backward()
    report = cap.report()
    assert report.ok, str(report)
    assert {"pos", "table"} <= set(report.broadcast)
    got = cap.batches[0].per_example_grads()
    assert set(got) == set(tiny.trainable(model))
    # float32 sums of a few dozen terms per coordinate: rel err <= 1e-5 of each parameter's largest entry
    tiny.assert_grads_close(got, ref, rtol=1e-5, atol=0, names=["pos.weight", "table.weight", "table.bias"])
    tiny.assert_grads_close(got, ref, rtol=1e-5, atol=0)
    # the expansion changes nothing the model computes: the same loss with and without capture
    plain = tiny.lm_example_loss(model(input_ids=batch["input_ids"]).logits, batch["labels"])
    torch.testing.assert_close(plain, tiny.lm_example_loss(out.logits, batch["labels"]), rtol=0, atol=0)


def test_per_token_rows_of_the_shared_position_embedding():
    model = _model()
    rows, batch = _batch()
    with gradtrace.capture(model, options=CaptureOptions(keep_tokens=True)) as cap:
        out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        tiny.lm_example_loss(out.logits, batch["labels"]).mean().backward()
    ref = tiny.reference_grads(model, rows, _single_loss)["pos.weight"]  # [E, MAX_T, d]
    terms = cap.batches[0].params["pos.weight"].terms
    assert len(terms) == 1
    tokens = terms[0].token_materialize()  # [E, T, MAX_T, d]: token t's part of each example's gradient
    T = batch["input_ids"].shape[1]
    assert tuple(tokens.shape) == (len(rows), T, MAX_T, WIDTH)
    # token t of example b touches row t only, with dL_b/d(o_t): row t of the brute-force gradient
    eye = torch.eye(MAX_T)[:T]  # [T, MAX_T]
    want = eye[None, :, :, None] * ref[:, None]  # [E, T, MAX_T, d]
    scale = float(ref.abs().max())
    torch.testing.assert_close(tokens, want, rtol=0, atol=1e-5 * scale)


def test_collect_and_scores_include_the_shared_layers():
    model = _model()
    rows, batch = _batch()
    query_rows, query = _batch((6, 4))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        train = gradtrace.collect(model, [batch], causal_lm_loss)
        queries = gradtrace.collect(model, [query], causal_lm_loss)
    assert "pos.weight" in dict(train.spec.params) and "table.weight" in dict(train.spec.params)
    names = [n for n, _ in train.spec.params]

    def flat(examples):
        ref = tiny.reference_grads(model, examples, _single_loss)
        return torch.cat([ref[n].reshape(len(examples), -1) for n in names], 1).double()

    # causal_lm_loss: the mean over target tokens of the batch, so each example's gradient is its token sum / the
    # batch's target count: compare directions through cosines (grad_cos), exact up to float32 round-off
    got = gradtrace.Attributor("grad_cos", train).score(queries).matrix.double()
    a, b = flat(query_rows), flat(rows)
    want = (a / a.norm(dim=1, keepdim=True)) @ (b / b.norm(dim=1, keepdim=True)).t()
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_logra_capture_of_the_shared_layers_equals_the_projected_brute_force():
    model = _model()
    rows, batch = _batch()
    logra = gradtrace.LoGra(rank=3, seed=2)
    with gradtrace.capture(model, options=CaptureOptions(projection=logra, layers=["pos", "table"])) as cap:
        out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        tiny.lm_example_loss(out.logits, batch["labels"]).mean().backward()
    with gradtrace.capture(model, options=CaptureOptions(layers=["pos", "table"])) as exact:
        out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        tiny.lm_example_loss(out.logits, batch["labels"]).mean().backward()
    # the projected rows of an exact per-example gradient G are P_rows G P_cols^T: project the exact capture's (itself
    # equal to brute force above) with the same matrices
    from gradtrace.projection.logra import Projector

    projector = Projector(logra)
    grads = exact.batches[0].per_example_grads()
    projected = cap.batches[0]
    for name in ("pos.weight", "table.weight"):
        g = grads[name].double()
        rows_m = projector.matrix(name, "rows", g.shape[1]).double()
        cols_m = projector.matrix(name, "cols", g.shape[2]).double()
        want = (rows_m @ g @ cols_m.t()).reshape(len(rows), -1)
        got = projected.flat()[:, slice(*projected_offsets(projected)[name])].double()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6 * float(want.abs().max()))


def projected_offsets(batch):
    start, out = 0, {}
    for name, dim in batch.dims.items():
        out[name] = (start, start + dim)
        start += dim
    return out


def test_a_use_the_expansion_would_change_is_refused_naming_the_option():
    torch.manual_seed(0)
    model = PositionLM(use="matmul")
    _, batch = _batch()
    with pytest.raises(RuntimeError, match=r"'matmul'.*broadcast='skip'"), gradtrace.capture(model):
        model(input_ids=batch["input_ids"])
    with pytest.warns(UserWarning, match="pos is left out"), \
            gradtrace.capture(model, options=CaptureOptions(broadcast="skip")) as cap:
        out = model(input_ids=batch["input_ids"])
        tiny.lm_example_loss(out.logits, batch["labels"]).mean().backward()
    assert "pos.weight" not in cap.batches[0].params
    left = {e.name: e.reason for e in cap.coverage().left_out}  # broadcast="skip" is the user's choice, not an error
    assert left["pos.weight"] == "excluded" and set(left.values()) == {"excluded"}


def test_outside_a_capture_the_guard_passes_through():
    shared = SharedRows  # before the capture's hook is registered, every use is a plain tensor's
    base = torch.randn(3, 2)
    from gradtrace.capture.token_rows import shared_rows

    expanded = shared_rows(base, 4)
    assert isinstance(expanded, shared) and tuple(expanded.shape) == (4, 3, 2)
    assert torch.equal(expanded.sum(0), 4 * base)

"""Token-mean reductions: per micro-batch, and over the optimizer step (the Trainer's ``num_items_in_batch``)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gradtrace.replay import Reduction, RunRecorder, load_run, metagradients, replay

from .tasks import schedule


def _data(n: int = 12):
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 5, (n,), generator=gen).tolist()
    return {i: (torch.randn(length, 4, generator=gen, dtype=torch.float64),
                torch.randint(0, 3, (length,), generator=gen)) for i, length in enumerate(lengths)}


def _batcher(data):
    def batches(ids):
        top = max(len(data[i][1]) for i in ids)
        x = torch.zeros(len(ids), top, 4, dtype=torch.float64)
        y = torch.full((len(ids), top), -100)
        for row, i in enumerate(ids):
            x[row, : len(data[i][1])], y[row, : len(data[i][1])] = data[i]
        return {"x": x, "y": y}
    return batches


def token_loss(forward, batch):
    """``(summed token losses [B], loss tokens [B])``."""
    logits = forward(batch["x"])
    tokens = F.cross_entropy(logits.flatten(0, 1), batch["y"].flatten(), reduction="none", ignore_index=-100)
    return tokens.view(batch["y"].shape).sum(1), (batch["y"] != -100).sum(1)


def _train(data, steps, reduction, weights=None, record=None):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3).double()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    rec = RunRecorder(record, model, opt, grad_clip=0.5, accumulation=2, reduction=reduction) if record else None
    batches = _batcher(data)
    for micro in steps:
        outs = [token_loss(model, batches(ids)) for ids in micro]
        total = sum(c.sum() for _, c in outs)
        for ids, (losses, counts) in zip(micro, outs):
            w = torch.stack([weights.get(i, torch.tensor(1.0, dtype=torch.float64)) for i in ids]) \
                if weights else torch.ones_like(losses)
            loss = (w * losses).sum() / (total if reduction.num_items_in_batch else counts.sum())
            (loss if not reduction.divide_by_accumulation else loss / 2).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
        if rec:
            rec.step(micro)
    if rec:
        rec.finish(model)
    return model


def _query(forward, query):
    losses, counts = token_loss(forward, query)
    return losses.sum() / counts.sum()


@pytest.mark.parametrize("reduction", [Reduction("token_mean", num_items_in_batch=True, divide_by_accumulation=False),
                                       Reduction("token_mean")])
def test_token_mean_replays_exactly_and_matches_finite_differences(tmp_path, reduction):
    data, steps = _data(), schedule(accumulation=2)
    _train(data, steps, reduction, record=tmp_path / "run")
    run = load_run(tmp_path / "run")
    assert run.reduction == reduction
    assert replay(run, torch.nn.Linear(4, 3).double(), token_loss, _batcher(data)).difference == 0.0
    queries = [_batcher(data)([0, 1]), _batcher(_data(4))([2, 3])]
    got = metagradients(run, torch.nn.Linear(4, 3).double(), token_loss, _batcher(data), queries, _query,
                        train_ids=list(range(12)))
    h, fd = 1e-4, []
    for i in (2, 7):
        pair = []
        for sign in (1, -1):
            model = _train(data, steps, reduction, weights={i: torch.tensor(1 + sign * h, dtype=torch.float64)})
            with torch.no_grad():
                pair.append(torch.stack([_query(model, q) for q in queries]))
        fd.append((pair[0] - pair[1]) / (2 * h))
    fd = torch.stack(fd, 1)
    assert ((-got.scores[:, [2, 7]] - fd).norm() / fd.norm()).item() <= 1e-5


def test_a_summed_loss_replays_exactly(tmp_path):
    from .tasks import batcher, loss_fn, make_data, make_model

    data, steps = make_data(), schedule()
    model = make_model("mlp")
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    rec = RunRecorder(tmp_path / "run", model, opt, reduction=Reduction("sum"))
    for micro in steps:
        loss_fn(model, batcher(data)(micro[0])).sum().backward()
        opt.step()
        opt.zero_grad()
        rec.step(micro)
    rec.finish(model)
    result = replay(load_run(tmp_path / "run"), make_model("mlp"), loss_fn, batcher(data))
    assert result.difference == 0.0

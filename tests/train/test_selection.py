"""Online selection: after the step's pre-hook, param.grad is exactly the gradient of the loop's loss over the kept
examples (optionally renormalised), on a plain loop and with gradient accumulation."""

import copy

import pytest
import torch
import torch.nn.functional as F

import gradtrace
from gradtrace.options import CaptureOptions, Loss, RunOptions
from gradtrace.options.train import SelectionOptions
from gradtrace.train import OnlineSelection
from tests import tiny


def _reference(model, x, y, keep, denominator):
    ref = copy.deepcopy(model)
    ref.zero_grad()
    (F.cross_entropy(ref(x[keep]), y[keep], reduction="sum") / denominator).backward()
    return {n: p.grad.clone() for n, p in ref.named_parameters()}


def _ids(n):
    return [f"ex{i}" for i in range(n)]


RULES = {"negative": {"rule": "negative"}, "bottom": {"rule": "bottom", "fraction": 0.25},
         "threshold": {"rule": "threshold", "threshold": 0.0}}


@pytest.mark.parametrize("rule", sorted(RULES))
@pytest.mark.parametrize("renormalize", [False, True])
def test_param_grad_equals_kept_examples_gradient(rule, renormalize):
    torch.manual_seed(0)
    model = tiny.MLP()
    x, y = torch.randn(8, 7), torch.randint(0, 4, (8,))
    y[:3] = (y[:3] + 1) % 4  # some examples pull against the rest
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    selector = OnlineSelection(opt, options=SelectionOptions(**RULES[rule], renormalize=renormalize,
                                                             record_scores=True))
    with gradtrace.capture(model, callbacks=[selector]) as cap:
        cap.annotate(ids=_ids(8))
        F.cross_entropy(model(x), y).backward()
        opt.step()
    record = selector.history[-1]
    keep = [i for i, ident in enumerate(_ids(8)) if ident not in record.dropped]
    assert 0 < len(keep) <= 8
    scores = record.scores
    if rule == "bottom":
        assert len(record.dropped) == 2
        assert sorted(scores, key=scores.get)[:2] == sorted(record.dropped, key=scores.get)
    denominator = len(keep) if renormalize else 8
    want = _reference(model, x, y, keep, denominator)
    for name, param in model.named_parameters():
        assert torch.allclose(param.grad, want[name], rtol=1e-4, atol=1e-6), name


def test_selection_with_gradient_accumulation_and_fixed_target():
    torch.manual_seed(1)
    model = tiny.MLP()
    x, y = torch.randn(8, 7), torch.randint(0, 4, (8,))
    target = torch.randn(sum(p.numel() for p in model.parameters()))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    selector = OnlineSelection(opt, target=target)
    with gradtrace.capture(model, loss=Loss(scale=0.5), callbacks=[selector]) as cap:
        for part in (slice(0, 4), slice(4, 8)):
            cap.annotate(ids=_ids(8)[part])
            (F.cross_entropy(model(x[part]), y[part]) / 2).backward()
        opt.step()
    record = selector.history[-1]
    assert record.examples == 8
    keep = [i for i, ident in enumerate(_ids(8)) if ident not in record.dropped]
    want = _reference(model, x, y, keep, 8)
    for name, param in model.named_parameters():
        assert torch.allclose(param.grad, want[name], rtol=1e-4, atol=1e-6), name
    # the drop decision is the sign of <g_e, target>
    exact = gradtrace.collect(model, [(x, y)], run=RunOptions(ids=_ids(8)))
    signs = exact.vectors @ target
    assert sorted(record.dropped) == sorted(i for i, s in zip(_ids(8), signs.tolist()) if s < 0)


def test_selection_on_a_language_model_keeps_at_least_one():
    torch.manual_seed(2)
    model = tiny.gpt2()
    ids = torch.randint(1, tiny.VOCAB, (4, 6))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    selector = OnlineSelection(opt, options=SelectionOptions(rule="threshold", threshold=float("inf")))  # drops all
    with pytest.warns(UserWarning, match="would drop every example"), \
            gradtrace.capture(model, Loss(reduction="token_mean"), callbacks=[selector]) as cap:
        cap.annotate(ids=_ids(4))
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
    assert len(selector.history[-1].dropped) == 3


def test_bad_targets_are_refused():
    model = tiny.MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with pytest.raises(ValueError, match="not both"):
        OnlineSelection(opt, target=torch.randn(5), validation=[])
    with pytest.raises(ValueError, match="pass validation="):
        OnlineSelection(opt, loss_fn=F.cross_entropy)
    with pytest.raises(TypeError, match="string 'validation'"):
        OnlineSelection(opt, target="validation")
    with pytest.raises(ValueError, match="rule must be one of"):
        SelectionOptions(rule="worst")
    selector = OnlineSelection(opt, target=torch.randn(5))
    with pytest.raises(ValueError, match="entries"), gradtrace.capture(model, callbacks=[selector]):
        F.cross_entropy(model(torch.randn(2, 7)), torch.tensor([0, 1])).backward()
        opt.step()
    with pytest.raises(ValueError, match="projection"), \
            gradtrace.capture(model, options=CaptureOptions(projection=gradtrace.LoGra(rank=2)),
                              callbacks=[OnlineSelection(opt)]):
        pass


def test_validation_target_through_the_same_hooks():
    """validation=: the mean gradient of a validation batch, taken through the capture hooks in a side pass
    (not stored, not counted); the drop decision is the sign of <g_e, mean validation gradient>."""
    torch.manual_seed(4)
    model = tiny.MLP()
    x, y = torch.randn(8, 7), torch.randint(0, 4, (8,))
    val = [(torch.randn(5, 7), torch.randint(0, 4, (5,)))]
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    selector = OnlineSelection(opt, validation=val, options=SelectionOptions(record_scores=True))
    with gradtrace.capture(model, callbacks=[selector], keep_batches=True) as cap:
        cap.annotate(ids=_ids(8))
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.step()  # nothing captured since: no selection, and the validation batches are re-iterated
    assert len(cap.batches) == 1 and cap.num_backward == 1, "the side pass is not a training batch"
    record = selector.history[-1]
    exact = gradtrace.collect(model, [(x, y)], run=RunOptions(ids=_ids(8)))
    val_grad = gradtrace.collect(model, val).vectors.mean(0)
    want = exact.vectors @ val_grad
    got = torch.tensor([record.scores[i] for i in _ids(8)])
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-6)
    keep = [i for i, s in enumerate(want.tolist()) if s >= 0]
    expected = _reference(model, x, y, keep, 8)
    for name, param in model.named_parameters():
        assert torch.allclose(param.grad, expected[name], rtol=1e-4, atol=1e-6), name


def test_normalized_scores_are_cosines():
    """normalize=True scores by cosine similarity with the target (same drop signs as the inner product)."""
    torch.manual_seed(5)
    model = tiny.MLP()
    x, y = torch.randn(8, 7), torch.randint(0, 4, (8,))
    val = [(torch.randn(5, 7), torch.randint(0, 4, (5,)))]
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    selector = OnlineSelection(opt, validation=val, options=SelectionOptions(normalize=True, record_scores=True))
    with gradtrace.capture(model, callbacks=[selector]) as cap:
        cap.annotate(ids=_ids(8))
        F.cross_entropy(model(x), y).backward()
        opt.step()
    exact = gradtrace.collect(model, [(x, y)], run=RunOptions(ids=_ids(8))).vectors
    val_grad = gradtrace.collect(model, val).vectors.mean(0)
    want = F.cosine_similarity(exact, val_grad.unsqueeze(0), dim=1)
    got = torch.tensor([selector.history[-1].scores[i] for i in _ids(8)])
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-6)
    assert set(selector.history[-1].dropped) == {i for i, s in zip(_ids(8), want.tolist()) if s < 0}


def test_start_step_and_a_validation_iterator_that_runs_out():
    """start_step leaves the first steps' param.grad untouched; a list of validation batches is re-iterated, a
    one-shot iterator that runs out is a clear error."""
    torch.manual_seed(6)
    model = tiny.MLP()
    x, y = torch.randn(8, 7), torch.randint(0, 4, (8,))
    val = (torch.randn(5, 7), torch.randint(0, 4, (5,)))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    for validation, fails in (([val], False), (iter([val]), True)):
        selector = OnlineSelection(opt, validation=validation,
                                   options=SelectionOptions(start_step=1, rule="bottom", fraction=0.5))
        with gradtrace.capture(model, callbacks=[selector]) as cap:
            cap.annotate(ids=_ids(8))
            F.cross_entropy(model(x), y).backward()
            plain = {n: p.grad.clone() for n, p in model.named_parameters()}
            opt.step()  # step 0: left alone
            assert not selector.history
            assert all(torch.equal(p.grad, plain[n]) for n, p in model.named_parameters())
            for step in (1, 2):
                opt.zero_grad()
                cap.annotate(ids=_ids(8))
                F.cross_entropy(model(x), y).backward()
                if fails and step == 2:
                    with pytest.raises(ValueError, match="ran out"):
                        opt.step()
                else:
                    opt.step()
                    assert len(selector.history[-1].dropped) == 4
        opt.zero_grad()
    with pytest.raises(ValueError, match="start_step must be"):
        SelectionOptions(start_step=-1)


def _select_once(model, x, y, options):
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    selector = OnlineSelection(opt, options=options)
    with gradtrace.capture(model, callbacks=[selector]) as cap:
        cap.annotate(ids=_ids(len(x)))
        F.cross_entropy(model(x), y).backward()
        opt.step()
    model.zero_grad()
    return selector.history[-1]


def test_rules_of_the_options_drop_what_brute_force_scores_say():
    """Each rule's drops against scores computed here from exact per-example gradients and the batch's mean
    gradient: ``bottom`` the ``round(fraction * E)`` lowest, ``threshold`` those below it, and ``min_keep`` keeps
    back the best when a rule would drop more."""
    torch.manual_seed(7)
    model = tiny.MLP()
    x, y = torch.randn(10, 7), torch.randint(0, 4, (10,))
    y[:4] = (y[:4] + 1) % 4
    grads = gradtrace.collect(model, [(x, y)], run=RunOptions(ids=_ids(10))).vectors  # [10, P]
    scores = dict(zip(_ids(10), (grads @ grads.mean(0)).tolist()))
    ranked = sorted(scores, key=scores.get)
    low = sorted(scores.values())
    cut = (low[5] + low[6]) / 2  # between the 6th and 7th lowest scores (not at one: the selector's own round-off)
    cases = [
        (SelectionOptions(rule="bottom", fraction=0.3), ranked[:3]),
        (SelectionOptions(rule="threshold", threshold=cut), ranked[:6]),
        (SelectionOptions(rule="negative"), [i for i in ranked if scores[i] < 0]),
    ]
    for options, want in cases:
        assert sorted(_select_once(model, x, y, options).dropped) == sorted(want), options
    with pytest.warns(UserWarning, match="would drop every example"):
        record = _select_once(model, x, y, SelectionOptions(rule="threshold", threshold=float("inf"), min_keep=3))
    assert sorted(record.dropped) == sorted(ranked[:7])  # the 3 highest scores kept back


@pytest.mark.parametrize("settings,message", [
    ({"rule": "bottom"}, "rule='bottom' needs fraction="),
    ({"rule": "threshold"}, "rule='threshold' needs threshold="),
    ({"fraction": 0.5}, "fraction= applies to rule='bottom' only"),
    ({"rule": "bottom", "fraction": 0.5, "threshold": 0.0}, "threshold= applies to rule='threshold' only"),
    ({"rule": "bottom", "fraction": 1.5}, "^fraction must be a finite number in \\[0, 1\\], got 1.5$"),
    ({"rule": "threshold", "threshold": float("nan")}, "^threshold must be a number, not NaN"),
    ({"min_keep": -1}, "^min_keep must be an integer >= 0, got -1$"),
    ({"start_step": 0.5}, "^start_step must be an integer >= 0, got 0.5$"),
])
def test_a_bad_selection_setting_is_refused_when_the_options_are_made(settings, message):
    with pytest.raises(ValueError, match=message):
        SelectionOptions(**settings)


def test_infinite_thresholds_are_settings_not_errors():
    assert SelectionOptions(rule="threshold", threshold=-float("inf")).threshold == -float("inf")
    assert SelectionOptions(rule="threshold", threshold=float("inf")).threshold == float("inf")

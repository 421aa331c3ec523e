"""The growth trace of a metagradient reverse pass: its values against the cotangent computed independently, and an
overflow whose error says how fast the cotangent grew and how far float64 would reach."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from gradtrace.options import MetagradOptions
from gradtrace.replay import MetaGradients, ReplayError, RunRecorder, load_run, metagradients
from gradtrace.replay.growth import growth_rate, merge, overflow_summary

from .reference import query_loss
from .tasks import batcher, loss_fn, make_data, make_model, schedule

QUERIES = list(make_data(n=3, seed=7).values())


class Quadratic(nn.Module):
    """``l(x) = x_0 theta.theta / 2 + x_1 sum(theta)``: training examples ``(a, 0)`` make SGD's step
    ``theta <- (1 - lr a) theta``, a query ``(0, 1)`` has the linear loss ``sum(theta)`` (cotangent: ones)."""

    def __init__(self, dim: int, scale: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.theta = nn.Parameter(torch.full((dim,), scale, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [B, 2] -> losses [B]
        return x[:, 0] * 0.5 * (self.theta * self.theta).sum() + x[:, 1] * self.theta.sum()


def _quadratic_run(tmp_path, steps: int, a: float, scale: float, dtype: torch.dtype, dim: int = 3):
    """A plain-SGD run (lr 1) of ``steps`` steps on one example ``(a, 0)``: ``theta_t = (1 - a)^t theta_0``."""
    model = Quadratic(dim, scale, dtype)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    data = {0: torch.tensor([a, 0.0], dtype=dtype)}
    recorder = RunRecorder(tmp_path / "run", model, opt)
    for _ in range(steps):
        model(data[0][None]).mean().backward()
        opt.step()
        opt.zero_grad()
        recorder.step([0])
    recorder.finish(model)
    batches = lambda ids: torch.stack([data[i] for i in ids])
    query = torch.tensor([0.0, 1.0], dtype=dtype)
    return load_run(tmp_path / "run"), Quadratic(dim, scale, dtype), batches, query


def _losses(forward, batch):
    return forward(batch)


def _linear_query(forward, query):
    return forward(query[None]).sum()


def test_the_trace_of_a_linear_reverse_pass_is_the_known_power_of_its_factor(tmp_path):
    """SGD on ``a theta^2 / 2`` with ``lr a = 4``: each reverse step multiplies the cotangent by exactly -3, so the
    norm of the cotangent of ``theta_s`` is ``sqrt(dim) 3^(T - s)``, at ``T`` and at every checkpoint ``s``."""
    run, model, batches, query = _quadratic_run(tmp_path, steps=12, a=4.0, scale=0.1, dtype=torch.float64)
    got = metagradients(run, model, _losses, batches, [query], _linear_query,
                        options=MetagradOptions(checkpoint_every=5))
    assert [s for s, _ in got.growth] == [12, 10, 5, 0]
    for step, norm in got.growth:
        assert norm == pytest.approx(math.sqrt(3) * 3.0 ** (12 - step), rel=1e-12)
    first_step, first, last_step, last, rate = growth_rate(got.growth)
    assert (first_step, last_step) == (12, 0) and rate == pytest.approx(3.0, rel=1e-12)


def _plain_sgd(model: nn.Module, steps: list, data: dict, lr: float, record=None) -> list[dict[str, torch.Tensor]]:
    """The real loop (torch.optim.SGD, mean loss), recorded into ``record``; the parameters before every step and
    after the last."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    recorder = RunRecorder(record, model, opt) if record is not None else None
    batches = batcher(data)
    states = [{n: p.detach().clone() for n, p in model.named_parameters()}]
    for micro in steps:
        loss_fn(model, batches(micro[0])).mean().backward()
        opt.step()
        opt.zero_grad()
        if recorder is not None:
            recorder.step(micro)
        states.append({n: p.detach().clone() for n, p in model.named_parameters()})
    if recorder is not None:
        recorder.finish(model)
    return states


def _unrolled_norm(model: nn.Module, states: list, steps: list, data: dict, lr: float, start: int) -> float:
    """``max_q || dL_q / dtheta_start ||``: autograd through SGD's update written out, from ``theta_start`` on."""
    batches, norms = batcher(data), []
    for query in QUERIES:
        leaves = {n: p.clone().requires_grad_(True) for n, p in states[start].items()}
        params = dict(leaves)
        for micro in steps[start:]:
            forward = lambda *a, params=params: torch.func.functional_call(model, params, a)
            loss = loss_fn(forward, batches(micro[0])).mean()
            grads = torch.autograd.grad(loss, list(params.values()), create_graph=True)
            params = {n: p - lr * g for (n, p), g in zip(params.items(), grads)}
        final = query_loss(lambda *a, params=params: torch.func.functional_call(model, params, a), query)
        grads = torch.autograd.grad(final, list(leaves.values()))
        norms.append(torch.sqrt(sum((g * g).sum() for g in grads)).item())
    return max(norms)


@pytest.mark.parametrize("query_batch", [None, 1, 2])
def test_the_trace_equals_the_cotangent_norm_through_the_unrolled_loop(tmp_path, query_batch):
    """An MLP under plain SGD (the cotangent of ``s_t`` is ``dL_q/dtheta_t``): each recorded norm is the largest
    over the queries of ``dL_q/dtheta_s`` computed by autograd through the loop from ``theta_s`` -- and the trace
    does not depend on how the queries are batched."""
    data, steps, lr = make_data(), schedule(), 0.5
    states = _plain_sgd(make_model("mlp"), steps, data, lr, record=tmp_path / "run")
    got = metagradients(load_run(tmp_path / "run"), make_model("mlp"), loss_fn, batcher(data), QUERIES, query_loss,
                        options=MetagradOptions(checkpoint_every=4, query_batch=query_batch))
    total = len(steps)
    assert [s for s, _ in got.growth] == [total, *reversed(range(0, total, 4))]
    for step, norm in got.growth:
        assert norm == pytest.approx(_unrolled_norm(make_model("mlp"), states, steps, data, lr, step), rel=1e-10)


def test_an_overflowing_reverse_pass_names_its_growth_rate_and_the_float64_reach(tmp_path):
    """float32, ``lr a = 4`` over 100 steps from ``theta_0 = 1e-20`` (the forward stays finite: ``3^100 1e-20``):
    the cotangent ``3^(100 - t)`` passes float32's max at step 19. The error gives the trace's growth, x3 per step,
    and float64's reach from step 20 at that rate, ``log(1.8e308 / 3^80) / log 3 = 566`` steps > the 20 left."""
    run, model, batches, query = _quadratic_run(tmp_path, steps=100, a=4.0, scale=1e-20, dtype=torch.float32, dim=1)
    with pytest.raises(ReplayError, match=r"between steps 10 and 19 of 100") as err:
        metagradients(run, model, _losses, batches, [query], _linear_query,
                      options=MetagradOptions(checkpoint_every=10))
    text = str(err.value)
    assert "grew from 1 at step 100 (the end of the run) to 1.48e+38 at step 20, over 80 steps: x3 per step" in text
    reach = math.log(torch.finfo(torch.float64).max / 3.0 ** 80) / math.log(3)
    assert f"~{reach:.0f} more steps from step 20, with 20 steps left" in text and reach == pytest.approx(566, abs=1)
    assert "float64 could reach the start of the run" in text
    assert [s for s, _ in err.value.growth] == [100, *range(90, 0, -10)]
    assert not math.isfinite(err.value.growth[-1][1])


def test_the_summary_says_when_float64_would_not_reach_the_start():
    fast = [(1000, 1.0), (990, 1e30), (980, float("inf"))]  # x1000 per step: float64 holds ~93 more steps
    text = overflow_summary(fast, torch.float32, 980, 990)
    assert "x1000 per step" in text and "~93 more steps from step 990, with 990 steps left" in text
    assert "float64 would overflow too" in text
    first = [(100, 2.0), (90, float("nan"))]  # overflowed in the first segment: a lower bound on the rate
    text = overflow_summary(first, torch.float32, 90, 100)
    rate = (torch.finfo(torch.float32).max / 2.0) ** (1 / 10)
    assert f"at least x{rate:.4g} per step" in text and "would hold at most ~" in text
    assert "did not grow" in overflow_summary([(10, 5.0), (5, 1.0), (0, float("inf"))], torch.float32, 0, 5)
    truncated = overflow_summary(fast, torch.float32, 980, 990, begin=900)  # the pass stops at step 900
    assert "with 90 steps left to step 900, where the pass stops: float64 could reach step 900" in truncated


def test_an_overflow_of_a_truncated_pass_counts_the_steps_to_its_start(tmp_path):
    """The same run as above truncated at step 15: the overflow's summary measures float64's reach against the 5
    steps left to step 15, and suggests a start step beyond the overflow."""
    run, model, batches, query = _quadratic_run(tmp_path, steps=100, a=4.0, scale=1e-20, dtype=torch.float32, dim=1)
    with pytest.raises(ReplayError, match=r"between steps 15 and 19 of 100") as err:
        metagradients(run, model, _losses, batches, [query], _linear_query,
                      options=MetagradOptions(checkpoint_every=5, start_step=15))
    text = str(err.value)
    assert "with 5 steps left to step 15, where the pass stops" in text and "start_step > 19" in text
    assert [s for s, _ in err.value.growth] == [100, *range(95, 15, -5), 15]


def test_merge_keeps_the_largest_norm_of_each_step():
    assert merge([[(4, 1.0), (2, 3.0)], [(4, 2.0), (2, 1.0)]]) == [(4, 2.0), (2, 3.0)]


def test_growth_defaults_to_empty_for_existing_constructions():
    result = MetaGradients(torch.zeros(1, 2), [0, 1], torch.zeros(1), None, 3)
    assert result.growth == []


def test_the_cli_prints_the_growth_of_the_reverse_pass():
    from gradtrace.cli.metagrad import _growth_line

    line = _growth_line([(12, 2.0), (10, 18.0), (0, 2.0 * 3.0 ** 12)])
    assert line.startswith("Reverse pass: the parameters' cotangent norm went from 2 at step 12 (the end of the run) "
                           "to 1.06e+06 at step 0, x3 per step on average (the largest over the queries). It passed "
                           "1,000x its value at the end by step 0")
    assert "(--start-step 0 or later)" in line
    grown = _growth_line([(30, 1.0), (20, 50.0), (10, 2e3), (0, 1e9)])
    assert "It passed 1,000x its value at the end by step 10" in grown and "--start-step 10 or later" in grown
    assert "passed" not in _growth_line([(30, 1.0), (20, 50.0), (0, 999.0)])  # below the mark: no hint
    assert _growth_line([(4, 0.5)]) == "Reverse pass: the parameters' cotangent had norm 0.5 at step 4."

"""A method implements only its own math: fit, bind and checkpoint_weights have defaults the engine relies on."""

from __future__ import annotations

import torch

import gradtrace
from gradtrace.fit.methods import Method
from tests import tiny


class _Doubled(Method):
    """grad_dot with the query side doubled: overrides prepare_queries only."""

    name = "doubled_test"

    def prepare_queries(self, queries: torch.Tensor, checkpoint: int = 0) -> torch.Tensor:
        return 2 * queries


def _gradients(seed: int, n: int):
    torch.manual_seed(0)
    model = tiny.MLP()
    gen = torch.Generator().manual_seed(seed)
    data = [(torch.randn(n, 7, generator=gen), torch.randint(0, 4, (n,), generator=gen))]
    return gradtrace.collect(model, data)


def test_method_defaults_do_nothing_and_weigh_checkpoints_equally():
    method = Method()
    assert method.fit(object(), "model", data=[]) is None
    assert method.bind(None) is None
    assert method.checkpoint_weights(3) == [1.0, 1.0, 1.0]
    assert not Method.has_fit() and not _Doubled.has_fit()
    assert gradtrace.fit.get_method("ekfac").has_fit() and not gradtrace.fit.get_method("grad_dot").has_fit()


def test_a_method_with_only_its_math_scores_through_the_engine():
    train, queries = _gradients(1, 10), _gradients(2, 3)
    attributor = gradtrace.Attributor(_Doubled(), train)
    assert attributor.fit() is attributor and attributor.ready() == [1.0]
    doubled = attributor.score(queries, topk=None, matrix=True).matrix
    reference = gradtrace.Attributor("grad_dot", train).score(queries, topk=None, matrix=True).matrix
    assert torch.equal(doubled, 2 * reference)  # doubling is exact in float32
    assert torch.equal(attributor.self_scores(), 2 * gradtrace.Attributor("grad_dot", train).self_scores())

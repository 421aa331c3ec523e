"""Wrong configuration, models with nothing to capture, loops that never backpropagate, NaN/inf examples:
clear errors and warnings, and the healthy examples' gradients still exact."""

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradtrace
from gradtrace.options import CaptureOptions, Loss
from tests import tiny


def _ce_single(model, example):
    x, y = example
    return F.cross_entropy(model(x.unsqueeze(0)), y.view(1), reduction="sum")


# ---------------------------------------------------------------------------------------------- selection
def test_unknown_layer_name_suggests_close_matches():
    model = tiny.llama()
    with pytest.raises(ValueError, match=r"'model.layers.0.mlp.gate_prj' matches no module name; did you mean "
                                         r"model.layers.0.mlp.gate_proj"):
        gradtrace.capture(model, options=CaptureOptions(layers=["model.layers.0.mlp.gate_prj"]))
    with pytest.raises(ValueError, match=r"exclude: 'lm_haed' matches no module name; did you mean lm_head"):
        gradtrace.capture(model, options=CaptureOptions(exclude=["lm_haed"]))
    with pytest.raises(ValueError, match="module names look like"):
        gradtrace.capture(model, options=CaptureOptions(layers=["*.nothing_like_this.*"]))


def test_bad_layer_specs():
    model = tiny.MLP()
    with pytest.raises(ValueError, match="layers=Conv2d: the model has no module of this type"):
        gradtrace.capture(model, options=CaptureOptions(layers=[nn.Conv2d]))
    with pytest.raises(TypeError, match="name patterns or module classes, got 3"):
        gradtrace.capture(model, options=CaptureOptions(layers=[3]))


def test_model_without_capturable_layers():
    class Recurrent(nn.Module):
        def __init__(self):
            super().__init__()
            self.gru = nn.GRU(3, 4, batch_first=True)

        def forward(self, x):
            return self.gru(x)[0]

    with pytest.raises(ValueError, match=r"no capturable layer selected in Recurrent \(gru \(GRU\)"):
        gradtrace.capture(Recurrent())


def test_all_frozen_model_points_at_include_frozen():
    model = tiny.MLP().requires_grad_(False)
    with pytest.raises(ValueError, match="include_frozen=True"):
        gradtrace.capture(model)


@pytest.mark.parametrize("option,value,error,says", [
    ("reduction", "avg", ValueError, r"reduction must be one of \('mean', 'sum', 'token_mean'\), got 'avg'"),
    ("example_loss", "total", ValueError, r"example_loss must be one of \('sum', 'mean'\), got 'total'"),
    ("multi_forward", "stack", ValueError, r"multi_forward must be 'concat' or 'sum', got 'stack'"),
    ("broadcast", "tile", ValueError, r"broadcast must be 'expand' or 'skip', got 'tile'"),
    ("nonfinite", "ignore", ValueError, r"nonfinite must be 'flag' or 'raise', got 'ignore'"),
    ("projection", "x", TypeError, r"projection must be a gradtrace.LoGra spec, a DenseProjection/SparseProjection "
                                   r"sketch \(less_features\) or None, got str"),
])
def test_invalid_option_values(option, value, error, says):
    with pytest.raises(error, match=says):
        if option in ("reduction", "example_loss"):
            gradtrace.capture(tiny.MLP(), Loss(**{option: value}))
        else:
            gradtrace.capture(tiny.MLP(), options=CaptureOptions(**{option: value}))


# ---------------------------------------------------------------------------------------------- loops
def test_loop_without_backward_warns():
    model = tiny.MLP()
    with pytest.warns(UserWarning, match="no backward pass"), gradtrace.capture(model) as cap:
        model(torch.randn(3, 7)).sum()
    assert cap.batches == [] and cap.num_backward == 0


def test_no_grad_only_loop_does_not_warn():
    model = tiny.MLP()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with gradtrace.capture(model) as cap, torch.no_grad():
            model(torch.randn(3, 7))
    assert cap.batches == []


def test_empty_context_does_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with gradtrace.capture(tiny.MLP()):
            pass


# ---------------------------------------------------------------------------------------------- NaN / inf
def _poisoned_batch():
    x, y = torch.randn(5, 7), torch.randint(0, 4, (5,))
    x[1, 3] = float("nan")
    x[3, 0] = float("inf")
    return x, y


def test_nonfinite_examples_are_flagged_and_the_rest_stay_exact():
    model = tiny.MLP()
    x, y = _poisoned_batch()
    healthy = [0, 2, 4]
    ref = tiny.reference_grads(model, [(x[i], y[i]) for i in healthy], _ce_single)
    warning = r"2 example\(s\) have NaN/inf gradients in backward pass 0: ex1, ex3"
    with pytest.warns(UserWarning, match=warning), gradtrace.capture(model, ids=[f"ex{i}" for i in range(5)]) as cap:
        F.cross_entropy(model(x), y).backward()
    batch = cap.batches[0]
    assert batch.nonfinite.tolist() == [False, True, False, True, False]
    grads = batch.per_example_grads()
    assert all(not torch.isfinite(g[1]).all() for g in grads.values())
    tiny.assert_grads_close({n: g[healthy] for n, g in grads.items()}, ref)
    assert batch.select(healthy).nonfinite.tolist() == [False, False, False]


def test_nonfinite_raise():
    model = tiny.MLP()
    x, y = _poisoned_batch()
    ids = [f"ex{i}" for i in range(5)]
    with pytest.raises(FloatingPointError, match="ex1, ex3"), \
            gradtrace.capture(model, ids=ids, options=CaptureOptions(nonfinite="raise")):
        F.cross_entropy(model(x), y).backward()
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules()), "hooks removed"


def test_finite_batch_has_no_flags():
    model = tiny.MLP()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with gradtrace.capture(model) as cap:
            F.cross_entropy(model(torch.randn(4, 7)), torch.randint(0, 4, (4,))).backward()
    assert cap.batches[0].nonfinite.tolist() == [False] * 4

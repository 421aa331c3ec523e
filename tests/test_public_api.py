"""The public names stay importable across the architecture step (issue #16): renamed types keep their old names
as aliases of the new ones, and moved classes stay reachable from ``gradtrace``."""

from __future__ import annotations

import gradtrace
import gradtrace.grad
import gradtrace.projection


def test_renamed_gradient_types_keep_their_old_names():
    assert gradtrace.GradBatch is gradtrace.GradientBatch is gradtrace.grad.GradientBatch
    assert gradtrace.ParamGrad is gradtrace.ParamGradient is gradtrace.grad.ParamGradient
    assert gradtrace.grad.GradBatch is gradtrace.GradientBatch and gradtrace.grad.ParamGrad is gradtrace.ParamGradient


def test_projections_are_one_package():
    assert gradtrace.LoGra is gradtrace.projection.LoGra
    assert issubclass(gradtrace.projection.DenseProjection, gradtrace.projection.Sketch)


def test_every_exported_name_resolves():
    missing = [name for name in gradtrace.__all__ if not hasattr(gradtrace, name)]
    assert not missing

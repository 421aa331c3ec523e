"""NaN/inf at padding positions are zeroed without a host read (issue #30, item 1): ``zero_outside`` touches no
position inside an example, reads nothing on the host, and passes the gradient wherever it zeroed nothing."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

from gradtrace.capture import assemble
from gradtrace.capture.assemble import zero_outside


def _reads():
    """The host-read counter of ``bench/host_reads.py`` (one definition of what a host read is)."""
    spec = importlib.util.spec_from_file_location("host_reads", Path(__file__).resolve().parents[2] / "bench" /
                                                  "host_reads.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.HostReads()


def _case():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 4, generator=generator)
    outside = torch.zeros(3, 5, dtype=torch.bool)
    outside[0, 3:], outside[2, 1:] = True, True
    x[0, 4, 1] = float("nan")  # padding
    x[2, 2, :] = float("inf")  # padding, whole position
    return x, outside


def test_only_padding_that_is_not_finite_is_zeroed():
    x, outside = _case()
    out = zero_outside(x, outside)
    assert torch.isfinite(out).all()
    bad = torch.zeros(3, 5, dtype=torch.bool)
    bad[0, 4], bad[2, 2] = True, True
    assert torch.equal(out[~bad], x[~bad])  # every other position, inside examples or padding, unchanged
    assert (out[bad] == 0).all()
    clean = torch.randn(3, 5, 4)
    assert torch.equal(zero_outside(clean, outside), clean)
    inside = x.clone()
    inside[1, 0, 0] = float("nan")  # inside an example: the example's own problem, never hidden
    assert torch.isnan(zero_outside(inside, outside)[1, 0, 0])


def test_the_device_path_reads_nothing_on_the_host_and_equals_the_cpu_path(monkeypatch):
    x, outside = _case()
    cpu, clean = zero_outside(x, outside), torch.randn(3, 5, 4)
    assert zero_outside(clean, outside) is clean  # the CPU's fast path: one read, no copy
    monkeypatch.setattr(assemble, "CPU_FAST_PATH", False)
    with _reads() as reads:
        device = zero_outside(x, outside)
        assert torch.equal(zero_outside(clean, outside), clean)
    assert sum(reads.sites.values()) == 0 and torch.equal(device, cpu)


def test_the_gradient_passes_where_nothing_was_zeroed():
    x, outside = _case()
    leaf = x.clone().requires_grad_(True)
    upstream = torch.randn(3, 5, 4)
    zero_outside(leaf, outside).backward(upstream)
    keep = torch.ones(3, 5, 1)
    keep[0, 4], keep[2, 2] = 0, 0
    assert torch.equal(leaf.grad, upstream * keep)

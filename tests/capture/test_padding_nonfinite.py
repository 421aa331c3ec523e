"""NaN/inf at padding positions are zeroed without a host read on a device (issue #30, item 1): the device path of
``zero_outside`` equals the CPU path, touches no position inside an example, and reads nothing on the host."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

from gradtrace.capture.assemble import zero_outside, zero_outside_on_device


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


def test_the_device_path_equals_the_cpu_path_and_changes_only_padding_that_is_not_finite():
    x, outside = _case()
    cpu, device = zero_outside(x, outside), zero_outside_on_device(x, outside)
    assert torch.equal(cpu, device) and torch.isfinite(device).all()
    bad = torch.zeros(3, 5, dtype=torch.bool)
    bad[0, 4], bad[2, 2] = True, True
    assert torch.equal(device[~bad], x[~bad])  # every other position, inside examples or padding, unchanged
    assert (device[bad] == 0).all()
    clean = torch.randn(3, 5, 4)
    assert zero_outside(clean, outside) is clean  # the CPU's fast path: no copy
    assert torch.equal(zero_outside_on_device(clean, outside), clean)


def test_the_device_path_reads_nothing_on_the_host():
    x, outside = _case()
    with _reads() as reads:
        zero_outside_on_device(x, outside)
    assert sum(reads.sites.values()) == 0
    with _reads() as reads:
        zero_outside(torch.randn(3, 5, 4), outside)  # the CPU path reads once (nothing to wait for there)
    assert sum(reads.sites.values()) == 1


def test_the_gradient_passes_where_nothing_was_zeroed():
    x, outside = _case()
    leaf = x.clone().requires_grad_(True)
    upstream = torch.randn(3, 5, 4)
    zero_outside_on_device(leaf, outside).backward(upstream)
    keep = torch.ones(3, 5, 1)
    keep[0, 4], keep[2, 2] = 0, 0
    assert torch.equal(leaf.grad, upstream * keep)

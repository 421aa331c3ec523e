"""The weights digest of a model's fingerprint (:mod:`gradtrace.store.weights_digest`).

* invariances: the same digest whatever the parameters' memory layout (transposed, strided), the chunking of the
  computation (the order in which its integer terms are added: a GPU's reduction order differs from a CPU's),
  and an FSDP2 sharding on 2 gloo ranks (uneven rows, a float64 parameter, a DTensor sharded on its columns, a
  replicated one), computed there without gathering a parameter; on CUDA, the CPU's digest;
* sensitivity: a one-ulp change of one weight, two swapped weights, ``-0.0`` for ``0.0``;
* legacy fingerprints (no ``scheme``): still computed on request; a store recording one is resumed by a capture
  with the same weights and refused with other weights; a direct writer with a new-scheme fingerprint is told
  why the two cannot be compared.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from torch import nn

import gradtrace
from gradtrace.options import CaptureOptions, Loss, RunOptions, StoreOptions
from gradtrace.store import GradientStore, ShardWriter, SpecMismatch, model_fingerprint
from gradtrace.store import weights_digest as wd
from gradtrace.store.layout import MANIFEST, manifest_checksum
from gradtrace.store.spec import fingerprint_like
from tests import tiny
from tests.distributed.launch import run_ranks

from .common import make_rows, make_spec


class Net(nn.Module):
    """Uneven rows under a 2-way sharding (5 and 3), a float64 parameter, biases, a one-value parameter (one rank
    holds none of it)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(4, 5)
        self.b = nn.Linear(5, 3)
        self.c = nn.Parameter(torch.randn(3, 7, dtype=torch.float64))
        self.t = nn.Parameter(torch.tensor([0.25]))

    def forward(self, x):
        return self.b(self.a(x))


def test_digest_is_independent_of_memory_layout_and_chunking(monkeypatch):
    model = Net()
    want = model_fingerprint(model)
    assert want["scheme"] == wd.SCHEME and len(want["weights"]) == 16
    strided = copy.deepcopy(model)
    with torch.no_grad():
        strided.a.weight.data = strided.a.weight.data.t().contiguous().t()  # same values, column-major
        wide = torch.zeros(3, 14, dtype=torch.float64)
        wide[:, ::2] = strided.c.data
        strided.c.data = wide[:, ::2]  # a strided view
    assert not strided.a.weight.is_contiguous() and not strided.c.is_contiguous()
    assert model_fingerprint(strided) == want
    monkeypatch.setattr(wd, "_CHUNK", 3)  # the terms summed in another grouping and order
    assert model_fingerprint(model) == want


def _lanes_by_hand(words: torch.Tensor, indices: list[int], mask: int) -> list[int]:
    """The scheme's sums as the module docstring states them, in Python integers."""
    out = []
    for prime, (mul, step, add) in zip(wd._PRIMES, wd._MIX):
        total = 0
        for v, i in zip(words.tolist(), indices):
            term = ((v & mask) * mul + i * step + add) % prime
            total = (total + term * term) % prime
        out.append(total)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_lanes_equal_the_stated_sums(dtype, monkeypatch):
    """The in-place, one-remainder computation gives the scheme's sums exactly: word indices from 0, beyond both
    primes (2^31 + ...), and scattered (a sharded parameter's), over several chunks."""
    monkeypatch.setattr(wd, "_CHUNK", 37)
    gen = torch.Generator().manual_seed(3)
    values = (torch.randn(300, generator=gen) * 1e3).to(dtype)
    values[:4] = torch.tensor([0.0, -0.0, float("inf"), -1.0]).to(dtype)
    words, mask = wd._words(values)
    n = words.numel()
    for start in (0, 2**31 + 5):
        assert wd._lanes(words, None, start, mask).tolist() == _lanes_by_hand(words, list(range(start, start + n)),
                                                                              mask)
    scattered = torch.randperm(4 * n, generator=gen)[:n] + 2**32
    assert wd._lanes(words, scattered, 0, mask).tolist() == _lanes_by_hand(words, scattered.tolist(), mask)


def _changed(model: nn.Module, change) -> str:
    other = copy.deepcopy(model)
    with torch.no_grad():
        change(other)
    return model_fingerprint(other)["weights"]


def test_digest_tells_one_ulp_apart():
    model = Net()
    base = model_fingerprint(model)["weights"]

    def ulp(m):
        value = m.b.weight[1, 2]
        m.b.weight[1, 2] = torch.nextafter(value, value + 1)

    def ulp64(m):
        m.c[2, 6] = torch.nextafter(m.c[2, 6], torch.tensor(10.0, dtype=torch.float64))

    def swap(m):
        m.a.weight[0, 0], m.a.weight[0, 1] = m.a.weight[0, 1].clone(), m.a.weight[0, 0].clone()

    changes = [ulp, ulp64, swap]
    digests = {_changed(model, c) for c in changes}
    assert base not in digests and len(digests) == len(changes)
    zero = copy.deepcopy(model)
    with torch.no_grad():
        zero.a.bias[0] = 0.0
    signed = copy.deepcopy(zero)
    with torch.no_grad():
        signed.a.bias[0] = -0.0
    assert model_fingerprint(zero)["weights"] != model_fingerprint(signed)["weights"]
    assert model_fingerprint(model)["arch"] == model_fingerprint(zero)["arch"]


def test_legacy_scheme_is_the_old_computation():
    model = Net()
    legacy = model_fingerprint(model, scheme="legacy")
    assert "scheme" not in legacy and legacy["arch"] == model_fingerprint(model)["arch"]
    assert legacy["weights"] != model_fingerprint(model)["weights"]
    assert fingerprint_like(model, legacy) == legacy
    assert fingerprint_like(model, model_fingerprint(model)) == model_fingerprint(model)
    assert fingerprint_like(model, None) == model_fingerprint(model)
    with pytest.raises(ValueError, match="scheme"):
        model_fingerprint(model, scheme="v9")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_digest_equals_the_cpu_one():
    model = Net()
    assert model_fingerprint(copy.deepcopy(model).cuda()) == model_fingerprint(model)


def sharded_digest(rank: int, world: int) -> dict:
    """(2 gloo ranks) the fingerprint of :class:`Net` under FSDP2, plus a column-sharded and a replicated DTensor,
    with ``full_tensor`` forbidden: nothing may be gathered."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    model = Net()
    fully_shard(model.a, mesh=mesh)
    fully_shard(model, mesh=mesh)

    def refuse(*args, **kwargs):
        raise AssertionError("a parameter was gathered")

    saved = DTensor.full_tensor
    DTensor.full_tensor = refuse
    try:
        fingerprint = model_fingerprint(model)
        torch.manual_seed(3)
        full = torch.randn(3, 5)
        columns = distribute_tensor(full, mesh, [Shard(1)])
        replicated = distribute_tensor(full.double(), mesh, [Replicate()])
        extra = wd.weights_digest([columns, replicated])
    finally:
        DTensor.full_tensor = saved
    local_rows = [tuple(p.to_local().shape) for p in model.parameters()]
    return {"fingerprint": fingerprint, "extra": extra, "local": local_rows}


def test_digest_under_fsdp2_equals_the_unsharded_model_without_gathering():
    results = run_ranks(sharded_digest)
    single = model_fingerprint(Net())
    torch.manual_seed(3)
    full = torch.randn(3, 5)
    assert [r["fingerprint"] for r in results] == [single, single]
    assert [r["extra"] for r in results] == [wd.weights_digest([full, full.double()])] * 2
    assert results[0]["local"] != results[1]["local"]  # really sharded (unevenly)


# ---------------------------------------------------------------------------------------------- legacy stores
NUM = 6


def _batches():
    gen = torch.Generator().manual_seed(5)
    x, y = torch.randn(NUM, 7, generator=gen), torch.randint(0, 4, (NUM,), generator=gen)
    return [(x[i:i + 2], y[i:i + 2]) for i in range(0, NUM, 2)]


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return tiny.MLP()


@pytest.fixture
def legacy_store(tmp_path):
    """4 of 6 examples collected from the seed-0 model, its manifest rewritten as an older gradtrace wrote it: a
    fingerprint without a scheme, whose weights digest is the legacy one."""
    path = tmp_path / "store"
    gradtrace.collect(_model(), _batches()[:2], store=path, options=CaptureOptions(projection=gradtrace.LoGra(rank=2)),
                      run=RunOptions(ids=[f"ex{i}" for i in range(4)]))
    manifest = json.loads((path / MANIFEST).read_text())
    manifest["spec"]["model"] = model_fingerprint(_model(), scheme="legacy")
    manifest["checksum"] = manifest_checksum(manifest)
    (path / MANIFEST).write_text(json.dumps(manifest))
    return path


def _resume(path, model, ids):
    x, y = _batches()[2]
    writer = gradtrace.StoreWriter(path, StoreOptions(resume=True))
    with gradtrace.capture(model, Loss(reduction="sum"), options=CaptureOptions(projection=gradtrace.LoGra(rank=2)),
                           ids=ids, callbacks=[writer]):
        torch.nn.functional.cross_entropy(model(x), y, reduction="sum").backward()


def test_a_legacy_store_resumes_with_the_same_weights(legacy_store):
    assert "scheme" not in GradientStore.open(legacy_store).spec.model
    _resume(legacy_store, _model(), ["ex4", "ex5"])
    store = GradientStore.open(legacy_store)
    assert sorted(store.ids) == [f"ex{i}" for i in range(NUM)] and "scheme" not in store.spec.model
    gradtrace.collect(_model(), _batches(), store=legacy_store,
                      options=CaptureOptions(projection=gradtrace.LoGra(rank=2)),
                      store_options=StoreOptions(resume=True), run=RunOptions(ids=[f"ex{i}" for i in range(NUM)]))


def test_a_legacy_store_refuses_other_weights(legacy_store):
    with pytest.raises(SpecMismatch, match="collected with other model weights"):
        _resume(legacy_store, _model(seed=1), ["ex4", "ex5"])
    assert len(GradientStore.open(legacy_store)) == 4


def test_a_direct_writer_is_told_that_schemes_differ(tmp_path):
    legacy = make_spec(model=model_fingerprint(Net(), scheme="legacy"))
    ids, rows = make_rows(3)
    with ShardWriter(tmp_path / "s", legacy) as writer:
        writer.put(ids, rows)
    current = make_spec(model=model_fingerprint(Net()))
    with pytest.raises(SpecMismatch, match="legacy weights fingerprint, this run's is bits1"):
        ShardWriter(tmp_path / "s", current, StoreOptions(resume=True))
    with pytest.raises(SpecMismatch, match="different schemes"):
        legacy.check_compatible(current, same_weights=True)

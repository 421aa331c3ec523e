"""The weights part of a model's fingerprint: a digest of every parameter's bits, without gathering sharded ones.

Each parameter is read as the raw words of its values (its own dtype's bits, in logical row-major order, the
little-endian words of a CPU and a GPU alike), and every word ``v`` at global word index ``i`` adds
``((v * M + i * K + C) mod P)^2 mod P`` to a sum taken modulo ``P``, in two lanes (two primes ``P`` below
``2^31``, so that every product fits an int64). The terms are integers and their sum does not depend on the order
in which they are added, hence

* a CPU and a CUDA computation give the same digest (no float reduction whose order differs by device);
* the memory layout does not matter (a transposed or strided parameter is read in logical order);
* an FSDP2 parameter (a DTensor sharded on a 1-D mesh) is digested where it lives: each rank adds the words of
  its own shard at their global indices, and one all-reduce of the small ``[parameters, 2]`` int64 partial sums
  per mesh (a collective every rank makes) gives every rank the unsharded model's digest. Nothing is gathered.
  Other placements (a partial sum, a mesh of several dimensions) are gathered one parameter at a time.

A one-ulp change of one value changes its word by one and its term with probability ``1 - 1/P`` per lane.
:data:`SCHEME` names this computation in the fingerprint (``"scheme"``); fingerprints written before it have no
``scheme`` and their weights digest is :func:`legacy_weights_digest` (a float64 sum per parameter, which differs
between devices and gathers sharded parameters), still computed to resume such a store.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

__all__ = ["SCHEME", "legacy_weights_digest", "weights_digest"]

SCHEME = "bits1"
_PRIMES = (2_147_483_647, 2_147_483_629)
_MIX = ((1_103_515_245, 40_692, 12_345), (69_069, 1_664_525, 1_013_904_223))  # (M, K, C) per lane, each < P
_CHUNK = 1 << 22  # words per step: int64 temporaries of 32 MiB
_WORD = {1: (torch.uint8, 0xFF), 2: (torch.int16, 0xFFFF), 4: (torch.int32, 0xFFFFFFFF), 8: (torch.int32, 0xFFFFFFFF)}


def _words(values: Tensor) -> tuple[Tensor, int]:
    """``values`` (any layout) as a flat tensor of its raw words, in logical order, and the mask of a word's bits."""
    flat = values.detach().reshape(-1).contiguous()
    if flat.element_size() not in _WORD:
        raise TypeError(f"cannot fingerprint parameters of dtype {values.dtype}")
    word, mask = _WORD[flat.element_size()]
    return (flat.view(word) if flat.numel() else flat.new_empty(0, dtype=word)), mask


def _lanes(words: Tensor, index: Tensor | None, start: int, mask: int) -> Tensor:
    """``[2]`` int64: the two lanes' sums (mod P) of the terms of ``words`` at global word indices ``index`` (or
    ``start, start + 1, ...`` when None), computed on the words' device.

    ``(v mod P) M + (i mod P) K + C`` and ``v M + i' K + C`` (``i' = i mod P``) are equal mod P, and the second stays
    below ``2^63`` for ``v < 2^32``, ``M < 2^31``, ``i' < P`` and ``K < 2^21``: one remainder per term instead of
    three, in place in one int64 buffer per chunk (2.2x faster on a CPU core; the digest is the same)."""
    out = torch.zeros(2, dtype=torch.int64, device=words.device)
    for lo in range(0, words.numel(), _CHUNK):
        chunk = words[lo:lo + _CHUNK].to(torch.int64).bitwise_and_(mask)  # the word's bits: v < 2^32
        if index is None:
            at = torch.arange(start + lo, start + lo + chunk.numel(), dtype=torch.int64, device=words.device)
            below = start + lo + chunk.numel() <= min(_PRIMES)  # every index already below both primes
        else:
            at, below = index[lo:lo + _CHUNK], False
        term = torch.empty_like(chunk)
        for lane, (prime, (mul, step, add)) in enumerate(zip(_PRIMES, _MIX)):
            torch.mul(at if below else at.remainder(prime), step, out=term)
            term.add_(chunk, alpha=mul).add_(add).remainder_(prime)
            term.mul_(term).remainder_(prime)  # < P^2 < 2^62 before the remainder
            out[lane] = (out[lane] + term.sum()) % prime
    return out


def _local_part(param: Tensor) -> tuple[str, Tensor, Tensor | None, int, Any]:
    """How a parameter is digested: ``("plain", values, None, 0, None)``; for a DTensor on a 1-D mesh its local
    shard with the global word offset of a row-sharded one (``index`` None) or the global indices of its words
    (sharded on another dim), and the mesh (``"sharded"``); ``"gathered"`` for other placements."""
    if not hasattr(param, "to_local"):
        return "plain", param, None, 0, None
    from torch.distributed.tensor import Replicate, Shard

    mesh, placements = param.device_mesh, tuple(param.placements)
    if mesh.ndim != 1 or not all(isinstance(p, (Shard, Replicate)) for p in placements):
        return "gathered", param.full_tensor(), None, 0, None  # a collective, on every rank alike
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local = param.to_local()
    if isinstance(placements[0], Replicate):  # every rank holds it all: rank 0 of the mesh counts it
        return "sharded", local if mesh.get_local_rank() == 0 else local[:0], None, 0, mesh
    shape, offset = compute_local_shape_and_global_offset(param.shape, mesh, placements)
    if tuple(local.shape) != tuple(shape):
        raise RuntimeError(f"a DTensor's local shard has shape {tuple(local.shape)}, its placement says {shape}")
    words_per = 2 if local.element_size() == 8 else 1
    if placements[0].dim == 0 or local.numel() == 0:  # consecutive rows: one range of global words
        rest = 1
        for size in param.shape[1:]:
            rest *= size
        return "sharded", local, None, offset[0] * rest * words_per if param.dim() else 0, mesh
    index = torch.zeros((), dtype=torch.int64, device=local.device)
    stride = words_per
    for dim in reversed(range(param.dim())):  # global element index of each local value, row-major
        at = torch.arange(shape[dim], dtype=torch.int64, device=local.device) + offset[dim]
        index = index + (at * stride).view([-1] + [1] * (param.dim() - 1 - dim))
        stride *= param.shape[dim]
    index = index.expand(shape).reshape(-1)
    if words_per == 2:
        index = torch.stack([index, index + 1], dim=1).reshape(-1)
    return "sharded", local, index, 0, mesh


def weights_digest(params: Iterable[Tensor]) -> str:
    """The 16-hex-digit digest of the parameters' values, in order (see the module docstring); a collective
    when some are sharded DTensors (every rank must call it, with the same parameters)."""
    lanes: list[Tensor] = []
    meshes: dict[int, tuple[Any, list[int]]] = {}  # per mesh: the parameters whose partial sums it all-reduces
    for order, param in enumerate(params):
        kind, values, index, start, mesh = _local_part(param)
        words, mask = _words(values)
        lanes.append(_lanes(words, index, start, mask))
        if kind == "sharded":
            meshes.setdefault(id(mesh), (mesh, []))[1].append(order)
    for mesh, orders in meshes.values():  # in order of first use: the same on every rank
        import torch.distributed as dist

        partial = torch.stack([lanes[o] for o in orders]).to(mesh.device_type)
        dist.all_reduce(partial, group=mesh.get_group())
        for row, order in enumerate(orders):
            lanes[order] = partial[row] % torch.tensor(_PRIMES, dtype=torch.int64, device=partial.device)
    by_device: dict[torch.device, list[int]] = {}
    for order, lane in enumerate(lanes):
        by_device.setdefault(lane.device, []).append(order)
    host: dict[int, list[int]] = {}
    for orders in by_device.values():  # one read per device
        values = torch.stack([lanes[o] for o in orders]).cpu().tolist()
        host.update(zip(orders, values))
    digest = hashlib.blake2b(digest_size=8)
    digest.update(SCHEME.encode())
    for order in range(len(lanes)):
        digest.update(b"%d:%d:%d\n" % (order, *host[order]))
    return digest.hexdigest()


def legacy_weights_digest(params: Iterable[Tensor]) -> str:
    """The weights digest of fingerprints without a ``scheme`` (before :data:`SCHEME`): each parameter's first and
    last 8 values and its float64 sum (gathered when sharded: a collective). Its sum differs between devices."""
    weights = hashlib.blake2b(digest_size=8)
    parts: list[tuple[int, int, Tensor]] = []  # (values sampled, parameter order, samples + sum) per param
    for param in params:
        flat = param.detach()
        if hasattr(flat, "full_tensor"):  # a DTensor (FSDP2): gather this parameter
            flat = flat.full_tensor()
        flat = flat.reshape(-1)
        if flat.numel():
            sample = torch.cat([flat[:8], flat[-8:]]).to(torch.float64)
            parts.append((sample.numel(), len(parts), torch.cat([sample, flat.to(torch.float64).sum().view(1)])))
    by_device: dict[torch.device, list[tuple[int, int, Tensor]]] = {}
    for part in parts:
        by_device.setdefault(part[2].device, []).append(part)
    host: dict[int, Any] = {}
    for group in by_device.values():
        values = torch.cat([t for _, _, t in group]).cpu().numpy()  # the one read of this device
        start = 0
        for size, order, _ in group:
            host[order] = values[start:start + size + 1]
            start += size + 1
    for order in range(len(parts)):
        values = host[order]
        weights.update(values[:-1].tobytes())
        weights.update(repr(float(values[-1])).encode())
    return weights.hexdigest()

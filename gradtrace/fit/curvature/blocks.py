"""Curvature blocks: how the captured parameters are grouped for K-FAC / EK-FAC / dense Fisher.

* :class:`KronBlock` -- a matrix parameter (Linear, Conv1D, Conv, Embedding weight), with the module's
  bias joined as an extra column on the activation side when both are captured exactly (K-FAC's
  ``[a; 1]``). Its Fisher is approximated by ``R (x) C`` (row-side and column-side second moments of
  the gradient factors) and, for EK-FAC, corrected eigenvalues in that basis.
* :class:`DenseBlock` -- any other captured parameter (norm weights, biases not joined, and every vector
  in projected space): a dense per-parameter Fisher ``E[g g^T]`` (diagonal beyond ``max_dense``).

Blocks are independent (block-diagonal curvature, no cross-layer terms), as in every K-FAC library.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...capture.layers import LayerHandler

__all__ = ["KronBlock", "DenseBlock", "Block", "blocks_for"]


@dataclass(frozen=True)
class KronBlock:
    """A matrix parameter ``name`` viewed as ``[n_rows, n_cols]`` (projected sizes under LoGra).

    bias: the joined bias parameter (exact gradients only), appended as a column (``act_side="cols"``) or a
        row (``"rows"``) of the gradient matrix.
    """

    name: str
    n_rows: int
    n_cols: int
    act_side: str | None = None
    bias: str | None = None

    @property
    def params(self) -> list[str]:
        return [self.name] + ([self.bias] if self.bias else [])

    @property
    def shape(self) -> tuple[int, int]:
        """Shape of the (bias-augmented) gradient matrix."""
        if self.bias is None:
            return (self.n_rows, self.n_cols)
        return (self.n_rows, self.n_cols + 1) if self.act_side == "cols" else (self.n_rows + 1, self.n_cols)

    def to_dict(self) -> dict:
        return {"type": "kron", "name": self.name, "n_rows": self.n_rows, "n_cols": self.n_cols,
                "act_side": self.act_side, "bias": self.bias}


@dataclass(frozen=True)
class DenseBlock:
    """A parameter with a dense (or, beyond ``max_dense``, diagonal) Fisher over its ``dim`` entries."""

    name: str
    dim: int
    diagonal: bool = False

    @property
    def params(self) -> list[str]:
        return [self.name]

    def to_dict(self) -> dict:
        return {"type": "dense", "name": self.name, "dim": self.dim, "diagonal": self.diagonal}


Block = KronBlock | DenseBlock


def block_from_dict(data: dict) -> Block:
    if data["type"] == "kron":
        return KronBlock(data["name"], data["n_rows"], data["n_cols"], data.get("act_side"), data.get("bias"))
    return DenseBlock(data["name"], data["dim"], data.get("diagonal", False))


def blocks_for(handlers: list[LayerHandler], dims: dict[str, tuple[int, ...]], projected: bool,
               max_dense: int = 4096) -> list[Block]:
    """The blocks covering the parameters in ``dims`` (``name -> gradient shape`` as captured).

    Matrix parameters become Kronecker blocks (a bias of the same module is joined when gradients are
    exact); every other parameter a dense block. A parameter used by several modules (tied weights)
    is one block whatever the number of its use sites.
    """
    blocks: list[Block] = []
    seen: set[str] = set()
    for handler in handlers:
        weight = handler.params.get("weight")
        if weight is None or weight in seen or weight not in dims or len(dims[weight]) < 2:
            continue
        shape = dims[weight]
        rows, cols = shape[0], 1
        for n in shape[1:]:
            cols *= n
        bias = handler.params.get("bias")
        join = (not projected and bias is not None and bias in dims and handler.activation_side is not None
                and bias not in seen)
        blocks.append(KronBlock(weight, rows, cols, handler.activation_side, bias if join else None))
        seen.add(weight)
        if join:
            seen.add(bias)
    for name, shape in dims.items():
        if name in seen:
            continue
        dim = 1
        for n in shape:
            dim *= n
        blocks.append(DenseBlock(name, dim, diagonal=dim > max_dense))
        seen.add(name)
    order = {name: i for i, name in enumerate(dims)}
    return sorted(blocks, key=lambda b: order[b.name])

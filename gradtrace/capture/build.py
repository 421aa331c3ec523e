"""One backward pass's per-layer results assembled into a :class:`GradientBatch`.

The hooks of :class:`~gradtrace.capture.Capture` leave one :class:`SiteResult` per captured layer call; at the
end of the backward pass they are joined per parameter (forward calls concatenated or summed, padding's
NaN/inf dropped), reduced over tokens under LoGra unless tokens are kept, and given the examples' ids, loss
scales and target counts. Examples with NaN/inf gradients are flagged (or raise), examples without a target
token are warned about.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from ..grad.batch import GradientBatch, LossConvention, ParamGradient
from .assemble import SiteResult, join_terms, nonfinite_examples, outside_examples, term_tensors
from .context import ForwardContext
from .example_ids import ExampleIds

if TYPE_CHECKING:
    from .collector import Capture

__all__ = ["build_batch"]


def build_batch(capture: Capture, results: list[SiteResult], step: int, convention: LossConvention,
                ids: ExampleIds) -> GradientBatch:
    """The :class:`GradientBatch` of backward pass ``step`` from its layer ``results`` (``capture``'s layers,
    projection and settings; ``convention``: the loss convention in force, a side pass's own one included)."""
    contexts = sorted({id(r.context): r.context for r in results}.values(), key=lambda c: c.index)
    sum_contexts = capture.multi_forward == "sum" and len(contexts) > 1
    if sum_contexts and len({c.num_examples for c in contexts}) != 1:
        raise ValueError("gradtrace: multi_forward='sum' needs the same number of examples in every forward "
                         f"call, got {[c.num_examples for c in contexts]}")
    params = _param_gradients(capture, results, contexts, sum_contexts)
    used = contexts[:1] if sum_contexts else contexts
    resolved = [ids.resolve(c) for c in used]
    names = [i for call_ids, _ in resolved for i in call_ids]
    digests = None if any(d is None for _, d in resolved) else [x for _, d in resolved for x in d]
    first = next(iter(params.values())).terms[0]
    device = next(iter(term_tensors(first).values())).device
    scale = torch.cat([c.example_scale.to(device) for c in used])
    num_targets = None
    if all(c.num_targets is not None for c in used):
        num_targets = torch.cat([c.num_targets.to(device) for c in used])
    bad = nonfinite_examples([t for pg in params.values() for t in pg.terms], len(names), device)
    projection = capture.projection
    batch = GradientBatch(ids=names, params=params, scale=scale, convention=convention, step=step,
                          nonfinite=bad, num_targets=num_targets,
                          projection=projection.to_dict() if projection is not None else None,
                          meta={"forward_call": [c.index for c in used for _ in range(c.num_examples)],
                                **({"digest": digests} if digests is not None else {})},
                          num_tokens=_token_axis(contexts))
    if bool(bad.any()):
        flagged = [names[i] for i in bad.nonzero().flatten().tolist()]
        message = (f"gradtrace: {len(flagged)} example(s) have NaN/inf gradients in backward pass {step}: "
                   f"{', '.join(flagged[:5])}{' ...' if len(flagged) > 5 else ''} (flagged in batch.nonfinite)")
        if capture.nonfinite == "raise":
            raise FloatingPointError(message)
        warnings.warn(message, stacklevel=3)
    if num_targets is not None:
        _warn_no_targets(names, num_targets, step)
    return batch


def _param_gradients(capture: Capture, results: list[SiteResult], contexts: list[ForwardContext],
                     sum_contexts: bool) -> dict[str, ParamGradient]:
    """Each captured parameter's per-example gradient, in the capture's parameter order."""
    by_param: dict[str, list] = {}
    for r in results:
        for name, term in r.terms.items():
            by_param.setdefault(name, []).append((r.context, r.order, term))
    shapes = {h.params[role]: h.shapes[role] for h in capture.handlers for role in h.params}
    # padded positions are no example's: their NaN/inf must not make an example non-finite (packed rows
    # are split into documents by relayout, which drops them already)
    outside = {c.index: outside_examples(c) for c in contexts if not c.packed}
    projector = capture.projector
    params: dict[str, ParamGradient] = {}
    for name in capture.selection.param_order:
        if name not in by_param:
            continue
        terms = join_terms(by_param[name], contexts, sum_contexts, outside)
        shape = tuple(terms[0].shape) if projector is not None else shapes[name]
        grad = ParamGradient(name, shape, terms, projected=projector is not None)
        if projector is not None and not capture.projection.keep_tokens:
            grad = grad.reduced()
        params[name] = grad
    return params


def _warn_no_targets(ids: list[str], num_targets: Tensor, step: int) -> None:
    """Warn about examples without a target token: their loss, hence their gradient, is zero."""
    empty = (num_targets == 0).nonzero().flatten().tolist()
    if empty:
        names = [ids[i] for i in empty]
        warnings.warn(f"gradtrace: {len(names)} example(s) have no target token in backward pass {step} (a single "
                      f"token, or every label ignored), so their gradients are zero: {', '.join(names[:5])}"
                      f"{' ...' if len(names) > 5 else ''}", stacklevel=4)


def _token_axis(contexts: list[ForwardContext]) -> int | None:
    """Token positions per example when every forward call had sequence inputs."""
    if any(c.seq_len is None for c in contexts):
        return None
    return max(c.example_len if c.packed else c.seq_len for c in contexts)

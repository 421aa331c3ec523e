"""Which modules and parameters a capture covers, and which trainable ones it cannot cover."""

from __future__ import annotations

import difflib
import fnmatch
from collections.abc import Iterable
from dataclasses import dataclass, field

from torch import nn

from ..common.modules import canonical_param_names, strip_wrappers, unwrap
from .layers import LayerHandler, find_handler

__all__ = ["LayerSpec", "Selection", "select_layers"]

LayerSpec = str | type
"""A module name glob (``"*.mlp.*"``, ``"lm_head"``) or a module class (``nn.Linear``)."""

# modules that apply their children's parameters functionally: the children's forward (and hooks) never run
_FUNCTIONAL_PARENTS = (nn.MultiheadAttention,)

@dataclass
class Unsupported:
    module: str
    type_name: str
    params: list[str]
    reason: str


@dataclass
class Selection:
    """The outcome of layer selection.

    handlers: one handler per captured module (model order).
    param_order: canonical names of the captured parameters, in ``named_parameters()`` order.
    frozen: supported modules skipped because all their parameters are frozen.
    unsupported: trainable parameters of the selected modules (those ``layers`` matches, less ``exclude``) that no
        handler can capture per example (an error unless ``CaptureOptions(partial=True)``: see
        :mod:`gradtrace.capture.coverage`).
    tied: notes about modules added because they share a captured parameter.
    """

    handlers: list[LayerHandler]
    param_order: list[str]
    frozen: list[str] = field(default_factory=list)
    unsupported: list[Unsupported] = field(default_factory=list)
    tied: list[str] = field(default_factory=list)


def _matches(name: str, module: nn.Module, specs: Iterable[LayerSpec]) -> bool:
    for spec in specs:
        if isinstance(spec, type):
            if isinstance(module, spec):
                return True
        elif name == spec or fnmatch.fnmatchcase(name, spec):
            return True
    return False


def _check_specs(specs: list[LayerSpec], modules: list[tuple[str, nn.Module]], what: str) -> None:
    names = [n for n, _ in modules if n]
    for spec in specs:
        if isinstance(spec, type):
            if not any(isinstance(m, spec) for _, m in modules):
                raise ValueError(f"{what}={spec.__name__}: the model has no module of this type")
        elif isinstance(spec, str):
            if not any(n == spec or fnmatch.fnmatchcase(n, spec) for n in names):
                close = difflib.get_close_matches(spec, names, n=5)
                hint = f"; did you mean {', '.join(close)}?" if close else f"; module names look like {names[:5]}"
                raise ValueError(f"{what}: {spec!r} matches no module name{hint}")
        else:
            raise TypeError(f"{what} entries must be name patterns or module classes, got {spec!r}")


def _functional_use(name: str, by_name: dict[str, nn.Module]) -> str | None:
    """Why a module's forward never runs although its parameters are used (None when it does run)."""
    parent = by_name.get(name.rpartition(".")[0]) if name else None
    if isinstance(parent, _FUNCTIONAL_PARENTS):
        return (f"its parent {type(parent).__name__} applies its parameters functionally, so its forward "
                "hooks never fire")
    return None


def _drop_partially_captured(selection: Selection, owners: dict[int, list[str]], captured_params: set[str],
                             explicit: bool) -> None:
    """Leave out a shared parameter unless every module holding it is captured: the captured sites alone
    would give a partial gradient passed off as the whole one."""
    sites = {(h.name, id(getattr(h.module, role))) for h in selection.handlers for role in h.params}
    missing = {pid: [o for o in owners[pid] if (o, pid) not in sites] for _, pid in sites}
    kept: list[LayerHandler] = []
    for handler in selection.handlers:
        lost = {role: name for role, name in handler.params.items() if missing[id(getattr(handler.module, role))]}
        if not lost:
            kept.append(handler)
            continue
        others = sorted({o for role in lost for o in missing[id(getattr(handler.module, role))]})
        reason = f"shares {', '.join(lost.values())} with {', '.join(others)}, which is not captured"
        if explicit:
            raise ValueError(f"layer {handler.name!r} ({type(handler.module).__name__}) cannot be captured: {reason}")
        selection.unsupported.append(Unsupported(handler.name, type(handler.module).__name__, list(lost.values()),
                                                 reason))
        captured_params.difference_update(lost.values())
        rest = {role: name for role, name in handler.params.items() if role not in lost}
        if rest:
            kept.append(type(handler)(handler.name, handler.module, rest))
    selection.handlers = kept


def _refuse_fsdp1(model: nn.Module) -> None:
    """FSDP1 keeps parameters flattened into sharded flat parameters outside forward, so layer shapes (and
    with ``use_orig_params=False`` the layers' parameters themselves) are hidden: refuse it clearly."""
    wrapped = [n or "the model" for n, m in model.named_modules()
               if type(m).__name__ == "FullyShardedDataParallel" and type(m).__module__.startswith("torch.distributed")]
    if wrapped:
        raise ValueError(f"gradtrace cannot capture a model wrapped in FSDP1 (FullyShardedDataParallel around "
                         f"{', '.join(wrapped[:3])}): its flat sharded parameters hide the layers' shapes. Shard "
                         "with FSDP2 instead (torch.distributed.fsdp.fully_shard), which gradtrace supports.")


def _frozen_advice(model: nn.Module) -> str:
    """What to do when every matching module is frozen. A PEFT model is frozen by ``PeftModel.from_pretrained``'s
    default loading (adapters included): loading it trainable captures the adapters, as a training run did;
    ``CaptureOptions(include_frozen=True)`` would add every frozen base weight, gradients no training store holds."""
    if hasattr(model, "peft_config"):
        return ("all matching modules are frozen: PeftModel.from_pretrained(base, adapter_dir) freezes the adapters "
                "too; load it with is_trainable=True so that the adapter weights are captured, as in training "
                "(CaptureOptions(include_frozen=True) would capture every base weight as well)")
    return "all matching modules are frozen; pass CaptureOptions(include_frozen=True)"


def select_layers(model: nn.Module, layers: Iterable[LayerSpec] | None = None,
                  exclude: Iterable[LayerSpec] | None = None, include_frozen: bool = False) -> Selection:
    """Choose the modules to capture.

    Args:
        model: the model (DDP/compile wrappers are looked through; names are the inner model's).
        layers: name globs or module classes to capture; None = every supported module.
        exclude: name globs or module classes to leave out.
        include_frozen: also capture parameters with ``requires_grad=False``.
    """
    inner = unwrap(model)
    _refuse_fsdp1(inner)
    modules = [(strip_wrappers(n), m) for n, m in inner.named_modules()]
    by_name = dict(modules)
    layers = list(layers) if layers is not None else None
    exclude = list(exclude or [])
    if layers is not None:
        _check_specs(layers, modules, "layers")
    _check_specs(exclude, modules, "exclude")
    param_names = canonical_param_names(inner)

    owners: dict[int, list[str]] = {}
    for name, module in modules:
        for param in module.parameters(recurse=False):
            owners.setdefault(id(param), []).append(name)

    def wanted(name: str, module: nn.Module) -> bool:
        if layers is not None and not _matches(name, module, layers):
            return False
        return not _matches(name, module, exclude)

    chosen = {name for name, module in modules if wanted(name, module)}
    selection = Selection(handlers=[], param_order=[])
    # a parameter shared by several modules must be captured at all of its sites
    tied_extra: set[str] = set()
    for name, module in modules:
        if name not in chosen or find_handler(module) is None:
            continue
        for param in module.parameters(recurse=False):
            for other in owners.get(id(param), []):
                if other not in chosen and other not in tied_extra:
                    if _matches(other, by_name[other], exclude):
                        raise ValueError(f"{other!r} is excluded but shares parameter "
                                         f"{param_names[id(param)]!r} with captured module {name!r}")
                    tied_extra.add(other)
                    selection.tied.append(f"{other} (shares {param_names[id(param)]} with {name})")
    chosen |= tied_extra

    captured_params: set[str] = set()
    for name, module in modules:
        handler_cls = find_handler(module)
        own = [(role, p) for role, p in module.named_parameters(recurse=False)]
        trainable = [(role, p) for role, p in own if p.requires_grad or include_frozen]
        if handler_cls is None:  # one the user left out (layers / exclude) is no loss: Coverage counts it excluded
            if own and name in chosen and any(p.requires_grad for _, p in own):
                selection.unsupported.append(Unsupported(
                    name, type(module).__name__, [param_names[id(p)] for _, p in own if p.requires_grad],
                    "no per-example gradient rule for this module type"))
            continue
        if name not in chosen:
            continue
        roles = handler_cls.param_roles(module)
        params = {role: param_names[id(p)] for role, p in trainable if role in roles}
        if not params:
            if own:
                selection.frozen.append(name)
            continue
        handler = handler_cls(name, module, params)
        reason = handler.unsupported_reason() or _functional_use(name, by_name)
        if reason is not None:
            if layers is not None:
                raise ValueError(f"layer {name!r} ({type(module).__name__}) cannot be captured: {reason}")
            selection.unsupported.append(Unsupported(name, type(module).__name__, list(params.values()), reason))
            continue
        others = [role for role, p in trainable if role not in roles and p.requires_grad]
        if others:
            selection.unsupported.append(Unsupported(
                name, type(module).__name__, [param_names[id(getattr(module, r))] for r in others],
                "extra parameters this layer kind does not cover"))
        selection.handlers.append(handler)
        captured_params.update(params.values())

    _drop_partially_captured(selection, owners, captured_params, explicit=layers is not None)
    order = list(dict.fromkeys(param_names.values()))
    selection.param_order = [n for n in order if n in captured_params]
    if not selection.handlers:
        kinds = "Linear, Conv1D, Embedding, LayerNorm/RMSNorm, Conv1d/Conv2d, MoE experts and routers, attention sinks"
        why = f" ({_frozen_advice(inner)})" if selection.frozen else ""
        if selection.unsupported and not why:
            why = " (" + "; ".join(f"{u.module} ({u.type_name}): {u.reason}" for u in selection.unsupported[:3]) + ")"
        raise ValueError(f"no capturable layer selected in {type(inner).__name__}{why}; supported kinds: {kinds}")
    return selection

"""``gradtrace fit STORE DATA --out CURVATURE_DIR``: fit the curvature an influence method needs.

The curvature is fitted for the store's gradients (its parameters and projection, rebuilt from the
manifest) on DATA -- usually the training data -- at the weights of the model that collected the store, and
saved (eigendata in safetensors + a JSON manifest). ``gradtrace score --method ekfac --curvature DIR`` uses it;
damping can be changed there without refitting. ``--method logra`` needs no model pass: it is computed from
the stored projected gradients.

``--method trak`` and ``--method trackstar`` save their own fit the same way (:mod:`gradtrace.fit.methods.saved`;
``gradtrace score --method trak --curvature DIR``), without DATA: TRAK's kernel ``Phi^T Phi`` from the stored
gradients (a causal LM has no ``1 - p`` reweighting, so none is needed), TrackStar's Adam second moment from
``--optimizer`` (an ``optimizer.pt`` or a Trainer checkpoint directory holding one, at the store's weights), with
``--precondition autocorrelation`` (its kernel of the normalised rows) or ``--precondition-curvature DIR`` (a
kfac / ekfac / ggn / logra fit of the same store, copied into the TrackStar fit).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from .. import options as api
from ..common.checks import SEED
from ..common.paths import why_missing
from ..options import CaptureOptions, RunOptions
from .commands import Group, cli, progress_flag, resolved
from .config import META_KEY, provenance, write_resolved
from .console import Phases, console
from .errors import CliError
from .groups import DataOptions, ModelOptions
from .load_data import read_dataset
from .load_model import (
    base_model_dir,
    load_model,
    load_tokenizer,
    pad_id,
    recorded_model,
    resolve_device,
    resolve_max_length,
    tokenizer_dir,
)
from .outputs import check_output_dir
from .score_queries import recorded_grad_dtype

__all__ = ["OPTIONS", "FitCommand", "run"]


@dataclass(kw_only=True)
class CurvatureOptions(Group):
    """Which curvature is fitted and how."""

    panel = "Curvature"
    out: Path = field(metadata=cli("Directory to save the fitted curvature in.", "--out", "-o",
                                   metavar="CURVATURE_DIR"))
    method: Literal["kfac", "ekfac", "ggn", "logra", "trak", "trackstar"] = field(default="ekfac", metadata=cli(
        "kfac / ekfac: Kronecker-factored (EK-FAC corrects the eigenvalues with a second pass); ggn: dense per "
        "parameter (small models); logra: dense Fisher of the stored projected gradients (no model pass); trak: "
        "its kernel Phi^T Phi of the stored gradients (no DATA); trackstar: Adam's second moment from --optimizer "
        "(no DATA)."))
    fisher: Literal["auto", "true", "empirical"] = field(default="auto", metadata=cli(
        "Labels of the Fisher: sampled from the model (true), the observed ones (empirical), or auto (the Python "
        "API's default: true for language models; the saved curvature records the choice)."))
    samples: int = field(default=1, metadata=cli("Label samples per example for --fisher true.", min=1))
    seed: int = field(default=0, metadata=cli("Seed of the label sampling.", valid=SEED))
    damping: float = field(default=0.1, metadata=cli(
        "Default damping saved with the fit (relative: times the mean eigenvalue of each block; trak: of its "
        "kernel; trackstar: of its autocorrelation).", min=0))
    overwrite: bool = field(default=False, metadata=cli("Replace a curvature (or method fit) already saved in --out."))
    covariance_dtype: Literal["float32", "float64"] = field(default="float32", metadata=cli(
        "kfac, ekfac, ggn: the dtype the curvature statistics are formed and summed in (float64: twice the "
        "memory of the sums)."))
    eigen_dtype: Literal["float64", "float32"] = field(default="float64", metadata=cli(
        "kfac, ekfac, ggn: the dtype of the eigendecompositions (the eigendata is saved in float32 either way)."))
    offload: bool = field(default=False, metadata=cli(
        "kfac, ekfac, ggn: keep the running sums on the CPU while the batches run on --device (no effect on the "
        "results)."))

    def fit_options(self) -> api.FitOptions:
        """The Python API's :class:`gradtrace.options.FitOptions` of a model-pass fit (kfac, ekfac, ggn)."""
        kind = {"kfac": "kfac", "ekfac": "ekfac", "ggn": "fisher"}[self.method]
        return api.FitOptions(kind=kind, fisher=self.fisher, samples=self.samples, seed=self.seed,
                              damping=self.damping, covariance_dtype=self.covariance_dtype,
                              eigen_dtype=self.eigen_dtype, offload=self.offload)


@dataclass(kw_only=True)
class KernelOptions(Group):
    """What trak and trackstar fit from the store (gradtrace.fit.methods.saved)."""

    panel = "trak / trackstar"
    optimizer: Path | None = field(default=None, metadata=cli(
        "trackstar: the Adam state at the store's weights -- an optimizer.pt (torch.save of optimizer.state_dict()) "
        "or a Trainer checkpoint directory holding one.", metavar="OPTIMIZER"))
    precondition: Literal["none", "autocorrelation"] = field(default="none", metadata=cli(
        "trackstar: none (a cosine of the normalised gradients) or autocorrelation (TrackStar's own R: the "
        "damped second-moment matrix of the normalised training rows; projected stores)."))
    structure: Literal["joint", "parameter"] = field(default="joint", metadata=cli(
        "trackstar --precondition autocorrelation: one D x D matrix (joint) or one block per captured parameter "
        "(parameter: Bergson's per-module autocorrelation, cross-parameter terms dropped; its size grows with the "
        "widest parameter, not with D)."))
    precondition_curvature: Path | None = field(default=None, metadata=cli(
        "trackstar: precondition with this fitted curvature of the same store instead (gradtrace fit STORE DATA "
        "--method kfac|ekfac|ggn|logra); it is copied into the fit.", metavar="CURVATURE_DIR"))
    mode: Literal["auto", "primal", "dual"] = field(default="auto", metadata=cli(
        "trak: primal (the D x D kernel Phi^T Phi), dual (the N x N Gram matrix Phi Phi^T: the same scores, for "
        "stores with fewer examples than dimensions; every scoring then reads the store twice more), or auto "
        "(dual when N < D)."))
    max_dim: int = field(default=32768, metadata=cli(
        "trak, trackstar --precondition autocorrelation: the largest kernel fitted -- D dimensions, or N examples "
        "for trak's dual form -- (32,768: 8 GiB of float64).", min=1))


@dataclass(kw_only=True)
class FitCommand:
    """Options of ``gradtrace fit``."""

    store: Path = field(metadata=cli("Gradient store the curvature is for (written by gradtrace collect).",
                                     argument=True, metavar="STORE"))
    data: Path | None = field(default=None, metadata=cli(
        "Examples to fit on (read like collect's DATA), usually the training data; not needed for --method logra.",
        argument=True, metavar="DATA"))
    model: Path | None = field(default=None, metadata=cli(
        "Model directory (default: the one the store records).", "--model", "-m", metavar="MODEL_DIR"))
    curvature_options: CurvatureOptions
    kernel_options: KernelOptions
    data_options: DataOptions
    model_options: ModelOptions
    progress: bool = progress_flag()
    dry_run: bool = field(default=False, metadata=cli(
        "Print the plan (examples and passes, blocks, factor sizes, the curvature's size against free disk, time "
        "from a warm-up fit) and stop: nothing is written."))
    force: bool = field(default=False, metadata=cli("Fit even when the planned curvature exceeds the free disk."))


OPTIONS = FitCommand


def run(opts: FitCommand) -> None:
    """Fit the curvature of an influence method (kfac, ekfac, ggn, logra) for a gradient store.

    Example: gradtrace fit ./store train.jsonl --method ekfac --out ./curvature
    then:    gradtrace score ./store queries.jsonl --method ekfac --curvature ./curvature --out ./scores
    """
    import gradtrace

    from ..fit.curvature import fit_curvature
    from ..projection import LoGra, projection_from_dict
    from ..store import GradientStore

    phases = Phases()
    cv, data_opts, model_opts = opts.curvature_options, opts.data_options, opts.model_options
    for kind in ("curvature", "fit"):
        if (cv.out / f"{kind}.json").exists() and not cv.overwrite:
            raise CliError(f"{cv.out} already holds a fitted {'curvature' if kind == 'curvature' else 'method'}: pass "
                           "--overwrite to replace it")
    check_output_dir(cv.out, "--out", stem="curvature", also=("fit",), what="a fit", overwrite=cv.overwrite)
    _check_method_flags(opts)
    if not opts.store.exists():
        raise CliError(f"store {opts.store} {why_missing(opts.store)}")
    with phases("open store"):
        store = GradientStore.open(opts.store)
    model_dir = opts.model
    device = resolve_device(model_opts.device)
    if cv.method in SAVED_FIT_METHODS:
        _fit_saved(opts, store, device, phases)
        return
    if cv.method == "logra":
        with phases("plan"):
            planned = gradtrace.plan_fit(store, method="logra", out=cv.out, run=RunOptions(device=device))
        if not _preflight(planned, opts):
            return
        with phases("fit"):
            attributor = gradtrace.Attributor("logra", store, device=device, fisher=cv.fisher)
            try:
                attributor.fit()
            except ValueError as err:  # e.g. --fisher true: the stored gradients give the empirical Fisher
                raise CliError(str(err)) from None
            curvature = attributor.method.curvature
    else:
        if opts.data is None:
            raise CliError(f"--method {cv.method} fits on data: give DATA (usually the training examples)")
        model_dir = model_dir or recorded_model(store)
        projection = projection_from_dict(store.spec.projection, expect=LoGra,
                                          what=f"the gradients of store {store.root}")
        with phases("load model"):
            base_model = base_model_dir(model_opts.base_model, store, model_dir)
            tokenizer = load_tokenizer(tokenizer_dir(model_opts.tokenizer, store, model_dir), base_model)
            model = load_model(model_dir, device, model_opts.model_dtype, base_model)
        with phases("read data"):
            max_length = resolve_max_length(data_opts.max_length, model)
            batches = read_dataset(opts.data, tokenizer, data_opts, max_length, pad_id(tokenizer))
            data_opts = replace(data_opts, max_length=max_length)
        console().print(batches.summary.line(), markup=False, highlight=False, soft_wrap=True)
        with phases("plan"):
            try:
                planned = gradtrace.plan_fit(store, model, batches, method=cv.method, options=cv.fit_options(),
                                             out=cv.out, run=RunOptions(device=device))
            except ValueError as err:
                raise CliError(str(err)) from None
        if not _preflight(planned, opts):
            return
        with phases("fit"):
            try:
                curvature = fit_curvature(model, batches, spec=store.spec, fit_options=cv.fit_options(),
                                          options=CaptureOptions(projection=projection,
                                                                 grad_dtype=recorded_grad_dtype(store, projection)),
                                          run=RunOptions(device=device, progress=opts.progress))
            except ValueError as err:
                raise CliError(str(err)) from None
    curvature = curvature.with_damping(cv.damping)
    final = replace(opts, model=model_dir, data_options=data_opts, model_options=replace(model_opts, device=device))
    values = resolved(final)
    read = (opts.data, batches.num_examples) if cv.method != "logra" else (None, None)  # the data fitted on
    curvature.meta["config"] = {META_KEY: provenance("fit", *read), **values}
    with phases("save"):
        curvature.save(cv.out, overwrite=cv.overwrite)
        written = write_resolved(cv.out, "fit", values)
    out = console()
    out.print(f"Fitted {cv.method} curvature for {store.root} ({len(curvature.blocks)} blocks); saved in {cv.out}")
    out.print(curvature.report())
    out.print(f"  config      {written}")
    out.print(f"Next: gradtrace score {opts.store} QUERIES.jsonl --method {cv.method} --curvature {cv.out} "
              "--out SCORES_DIR")
    if opts.progress:
        console(stderr=True).print(phases.table())


SAVED_FIT_METHODS = ("trak", "trackstar")
"""Methods whose fit is saved as a method fit (gradtrace.fit.methods.saved), not a curvature."""


def _check_method_flags(opts: FitCommand) -> None:
    """Refuse flags of another method, and a DATA the method does not read."""
    cv, kv = opts.curvature_options, opts.kernel_options
    given = [flag for flag, used in (("--optimizer", kv.optimizer is not None),
                                     ("--precondition", kv.precondition != "none"),
                                     ("--precondition-curvature", kv.precondition_curvature is not None)) if used]
    if cv.method != "trackstar" and given:
        raise CliError(f"{', '.join(given)} appl{'y' if len(given) > 1 else 'ies'} to --method trackstar, not "
                       f"{cv.method}")
    if cv.method not in SAVED_FIT_METHODS and kv.max_dim != KernelOptions().max_dim:
        raise CliError(f"--max-dim applies to trak and trackstar (their D x D kernel), not {cv.method}")
    if cv.method != "trak" and kv.mode != "auto":
        raise CliError(f"--mode applies to trak (its primal or dual form), not {cv.method}")
    if kv.structure != "joint" and (cv.method != "trackstar" or kv.precondition != "autocorrelation"):
        raise CliError("--structure applies to --method trackstar --precondition autocorrelation (the blocks of its "
                       "matrix)")
    if cv.method in SAVED_FIT_METHODS and opts.data is not None:
        source = "the stored gradients and --optimizer" if cv.method == "trackstar" else "the stored gradients"
        raise CliError(f"--method {cv.method} fits from {source} alone (a causal LM needs no 1 - p weights): drop "
                       "DATA")
    precision = [flag for flag, used in (("--covariance-dtype", cv.covariance_dtype != "float32"),
                                         ("--eigen-dtype", cv.eigen_dtype != "float64"), ("--offload", cv.offload))
                 if used]
    if cv.method not in ("kfac", "ekfac", "ggn") and precision:
        raise CliError(f"{', '.join(precision)} appl{'y' if len(precision) > 1 else 'ies'} to the model-pass fits "
                       f"(kfac, ekfac, ggn), not {cv.method}")
    if cv.method in SAVED_FIT_METHODS and cv.fisher != "auto":
        raise CliError(f"--fisher applies to kfac, ekfac, ggn and logra, not {cv.method}")
    if cv.method == "trackstar":
        if kv.optimizer is None:
            raise CliError("--method trackstar needs Adam's second moment: pass --optimizer OPTIMIZER (an optimizer.pt "
                           "or the Trainer checkpoint directory holding one, saved at the store's weights)")
        if kv.precondition != "none" and kv.precondition_curvature is not None:
            raise CliError("--precondition autocorrelation and --precondition-curvature are two preconditioners: "
                           "choose one")
        if kv.precondition_curvature is not None and not (kv.precondition_curvature / "curvature.json").exists():
            raise CliError(f"--precondition-curvature {kv.precondition_curvature} holds no fitted curvature "
                           "(curvature.json missing): gradtrace fit STORE DATA --method ekfac --out DIR first")


def _fit_saved(opts: FitCommand, store: Any, device: str, phases: Phases) -> None:
    """``--method trak`` / ``trackstar``: fit from the store (and the optimizer state), save as a method fit."""
    import gradtrace

    from ..common.units import human_bytes
    from ..fit.curvature import Curvature
    from ..fit.methods import save_fit
    from ..fit.methods.influence import curvature_method
    from ..plan.fit_plan import KernelTooLarge

    cv, kv = opts.curvature_options, opts.kernel_options
    precondition = None if kv.precondition == "none" else kv.precondition
    with phases("plan"):
        try:
            planned = gradtrace.plan_fit(store, method=_planned_method(cv.method, kv, precondition), out=cv.out,
                                         run=RunOptions(device=device))
        except KernelTooLarge as err:
            size = f"{err.dim:,} examples" if err.dual else f"{err.dim:,} dims"
            fix = ("--mode primal with a store of fewer dimensions (a lower --rank)" if err.dual else
                   "collect with a lower --rank or fewer --layers" +
                   (", or --mode dual when the store has fewer examples than dimensions" if cv.method == "trak"
                    else ", or --structure parameter (a block per parameter)" if kv.structure == "joint"
                    else ""))
            raise CliError(f"{err.what} of store {store.root} ({size}) takes {human_bytes(err.bytes)} (float64), "
                           f"beyond --max-dim {err.max_dim:,}: {fix}, or raise --max-dim where the memory is "
                           "there") from None
    if not _preflight(planned, opts):
        return
    model_dir, fit_args, settings = opts.model, {}, {"damping": cv.damping, "max_dim": kv.max_dim}
    if cv.method == "trak":
        settings.update(reweight=False, mode=kv.mode)  # causal LMs: TRAK's 1 - p weights are a classifier's
    else:
        if kv.precondition_curvature is not None:
            try:
                curvature = Curvature.load(kv.precondition_curvature)
            except (ValueError, OSError) as err:
                raise CliError(str(err)) from None
            precondition = curvature_method(curvature)
            try:  # now, not at the first scoring: a curvature of other gradients than the store's
                precondition.bind(store.spec)
            except ValueError as err:
                raise CliError(f"--precondition-curvature {kv.precondition_curvature}: {err}") from None
        settings.update(precondition=precondition, structure=kv.structure)
        model_dir = model_dir or recorded_model(store)
        with phases("load model"):
            fit_args = {"model": load_model(model_dir, "cpu", opts.model_options.model_dtype,
                                            base_model_dir(opts.model_options.base_model, store, model_dir)),
                        "optimizer": kv.optimizer}
    with phases("fit"):
        attributor = gradtrace.Attributor(cv.method, store, device=device, **settings)
        try:
            attributor.fit(**fit_args)
        except (ValueError, KeyError, FileNotFoundError, gradtrace.fit.methods.MissingStage) as err:
            raise CliError(str(err).strip("'\"")) from None
    final = replace(opts, model=model_dir, model_options=replace(opts.model_options, device=device))
    values = resolved(final)
    with phases("save"):
        try:
            save_fit(attributor, cv.out, overwrite=cv.overwrite,
                     meta={"config": {META_KEY: provenance("fit", None, None), **values}})
        except OSError as err:
            raise CliError(f"could not save the fit in {cv.out}: {err.strerror or err} (a fit saved there before is "
                           "kept, or refused on load if its preconditioner was replaced); free space and fit again",
                           exit_code=1) from None
        written = write_resolved(cv.out, "fit", values)
    out = console()
    out.print(f"Fitted {cv.method} for {store.root} ({store.dim:,} dims, {len(store):,} rows); saved in {cv.out}")
    out.print(f"  settings    {attributor.method.options()}", markup=False, highlight=False)
    out.print(f"  config      {written}")
    out.print(f"Next: gradtrace score {opts.store} QUERIES.jsonl --method {cv.method} --fit {cv.out} --out SCORES_DIR")
    if opts.progress:
        console(stderr=True).print(phases.table())


def _planned_method(method: str, kv: KernelOptions, precondition: Any) -> Any:
    """The trak / trackstar method object whose fit ``plan_fit`` plans (the settings that size the kernel)."""
    from ..fit.methods import TRAK, TrackStar

    if method == "trak":
        return TRAK(max_dim=kv.max_dim, mode=kv.mode)
    return TrackStar(precondition=precondition, max_dim=kv.max_dim, structure=kv.structure)


def _preflight(planned: Any, opts: FitCommand) -> bool:
    """Print the plan and refuse what cannot fit (gradtrace.cli.preflight); False for --dry-run (stop there)."""
    from .preflight import check_fit_plan, fit_plan_lines, print_plan

    print_plan(fit_plan_lines(planned, opts.curvature_options.out))
    if opts.dry_run:
        return False
    check_fit_plan(planned, opts.curvature_options.out, opts.force)
    return True

"""``--loss dpo``: preference pairs on the command line -- the DPO settings of the run, its reference model, and
the pairs read with their reference log-probabilities (``gradtrace collect --format preference --loss dpo
--ref-model REF_DIR --beta 0.1``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from .commands import Group, cli
from .errors import CliError
from .groups import DataOptions

__all__ = ["DPOOptions", "pair_loss", "read_examples", "read_pairs", "wants_pairs"]


@dataclass(kw_only=True)
class DPOOptions(Group):
    """The loss of preference pairs: TRL's ``DPOConfig`` settings the run trained with, and its reference model
    (the Python API's :class:`gradtrace.loss.DPO` and :class:`gradtrace.loss.DPOLoss`)."""

    panel = "Preference pairs (DPO)"
    loss: Literal["auto", "lm", "dpo"] = field(default="auto", metadata=cli(
        "Each example's loss: lm (the causal LM loss of its tokens in the loss), dpo (a preference pair's DPO loss, "
        "as TRL's DPOTrainer computes it: needs --ref-model or reference log-probabilities in the data); auto: dpo "
        "for preference data, lm otherwise.", "--loss"))
    ref_model: Path | None = field(default=None, metadata=cli(
        "The DPO run's reference model directory (usually the model before DPO); its log-probabilities of every pair "
        "are computed once. Not needed when the data holds TRL's ref_chosen_logps / ref_rejected_logps columns "
        "(precompute_ref_log_probs).", metavar="REF_DIR"))
    beta: float = field(default=0.1, metadata=cli("The run's DPO beta (DPOConfig.beta).", min=0.0, min_open=True))
    dpo_loss_type: list[str] = field(default_factory=list, metadata=cli(
        "The run's DPO loss type (DPOConfig.loss_type; repeat for several, weighted by --loss-weight): sigmoid "
        "(default), hinge, ipo, exo_pair, nca_pair, robust, bco_pair, sppo_hard, apo_zero, apo_down, discopop, "
        "sigmoid_norm.", metavar="TYPE"))
    loss_weight: list[float] = field(default_factory=list, metadata=cli(
        "One weight per --dpo-loss-type (DPOConfig.loss_weights; default 1 each).", metavar="W"))
    label_smoothing: float = field(default=0.0, metadata=cli(
        "DPOConfig.label_smoothing (robust, exo_pair).", min=0.0, max=0.5))
    ld_alpha: float | None = field(default=None, metadata=cli(
        "DPOConfig.ld_alpha (LD-DPO: the weight of completion tokens past the shorter completion).", min=0.0,
        max=1.0))
    f_divergence_type: Literal["reverse_kl", "forward_kl", "js_divergence", "alpha_divergence"] = field(
        default="reverse_kl", metadata=cli("DPOConfig.f_divergence_type (reverse_kl: standard DPO)."))

    def settings(self) -> Any:
        """The :class:`gradtrace.loss.DPO` of these options (a :class:`CliError` for an invalid combination)."""
        from ..loss.preference import DPO

        try:
            return DPO(beta=self.beta, loss_type=tuple(self.dpo_loss_type) or ("sigmoid",),
                       loss_weights=tuple(self.loss_weight) or None, label_smoothing=self.label_smoothing,
                       ld_alpha=self.ld_alpha, f_divergence_type=self.f_divergence_type)
        except ValueError as err:
            raise CliError(str(err)) from err


def wants_pairs(path: Path, data: DataOptions, dpo: DPOOptions) -> bool:
    """Whether the command reads ``path`` as preference pairs with the DPO loss (``--loss dpo``, or ``auto`` with
    ``--format preference`` or preference records); ``--loss dpo`` on other data is an error."""
    from ..data.preference import is_preference

    if dpo.loss == "lm":
        if data.data_format == "preference":
            raise CliError("--format preference with --loss lm: a preference pair is attributed with the DPO loss it "
                           "was trained with (--loss dpo); for the NLL of one side, read it as prompt-completion data "
                           "(--completion-field chosen)")
        return False
    if dpo.loss == "dpo" or data.data_format == "preference":
        if data.data_format not in ("auto", "preference"):
            raise CliError(f"--loss dpo reads preference pairs; --format {data.data_format} is not (use --format "
                           "preference or auto)")
        return True
    return data.data_format == "auto" and is_preference(path, data.record_fields(), data.split)


def read_pairs(path: Path, tokenizer: Any, data: DataOptions, dpo: DPOOptions, max_length: int | None, pad_id: int,
               device: str, dtype: str, *, what: str = "data") -> Any:
    """The preference pairs of ``path`` as a :class:`gradtrace.data.PreferenceDataset` with their reference
    log-probabilities: from the data, or computed once with ``--ref-model`` (loaded on ``device`` in ``dtype``)."""
    from ..data import load_preference
    from .load_model import load_model

    pairs = load_preference(path, tokenizer, fields=data.record_fields(), read_options=data.read_options(max_length),
                            batch_options=data.batch_options(pad_id), what=what)
    if pairs.summary.reference == "data":
        if dpo.ref_model is not None:
            raise CliError(f"{path} holds the reference log-probabilities (ref_chosen_logps / ref_rejected_logps): "
                           "they are used as they are; drop --ref-model")
        return pairs
    if dpo.ref_model is None:
        raise CliError("--loss dpo needs the run's reference model (--ref-model REF_DIR, usually the model before "
                       "DPO) or data with TRL's ref_chosen_logps / ref_rejected_logps columns")
    reference = load_model(dpo.ref_model, device, dtype)
    try:
        return pairs.with_reference(reference, dpo.settings())
    finally:
        del reference


def pair_loss(batches: Any, dpo: DPOOptions) -> Any:
    """The loss ``collect`` takes for ``batches``: :class:`gradtrace.loss.DPOLoss` of the run's settings for
    preference pairs, None (the default causal LM loss) for other data."""
    from ..data import PreferenceDataset
    from ..loss import DPOLoss

    return DPOLoss(dpo.settings()) if isinstance(batches, PreferenceDataset) else None


def read_examples(path: Path, tokenizer: Any, data: DataOptions, dpo: DPOOptions, max_length: int | None, pad_id: int,
                  device: str, dtype: str, *, what: str = "data", generate: Any = None, tokens: bool = False) -> Any:
    """A command's examples: preference pairs (:func:`read_pairs`, when :func:`wants_pairs`), else
    :func:`gradtrace.cli.load_data.read_dataset` of ``path`` (``generate``: answer its prompts with the model).
    Pairs are scored whole: ``generate`` or ``tokens`` (``--generate``, ``--tokens``) with them is an error."""
    from .load_data import read_dataset

    if wants_pairs(path, data, dpo):  # what made the model prefer this answer
        if generate is not None or tokens:
            raise CliError("preference pairs (--loss dpo) are attributed whole: they take neither --generate nor "
                           "--tokens")
        return read_pairs(path, tokenizer, data, dpo, max_length, pad_id, device, dtype, what=what)
    return read_dataset(path, tokenizer, data, max_length, pad_id, what=what, generate=generate)

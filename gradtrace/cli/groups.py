"""Option groups shared by several commands (one dataclass per concern, one ``--help`` panel each)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from ..common.checks import SEED
from ..options import CaptureOptions
from ..options.data import BatchOptions, Fields, ReadOptions
from .commands import Group, cli

__all__ = ["DATA_HELP", "LAYER_PATTERNS", "DataOptions", "GenerateOptions", "LayerOptions", "ModelOptions",
           "ProjectionOptions", "TextOptions"]

LAYER_PATTERNS = ("a module name or a shell-style glob over module names, as the Python API's "
                  "CaptureOptions(layers=, exclude=) take them: 'lm_head', 'transformer.h.0.*', '*.mlp.*' (names as "
                  "model.named_modules() gives them)")

DATA_HELP = ("Training examples: .jsonl, .json, .parquet, .csv, .txt (one per line) or a save_to_disk directory; "
             "formats text, prompt-completion, messages or preference (chosen/rejected pairs), detected from the "
             "fields (see --format).")


@dataclass(kw_only=True)
class ModelOptions(Group):
    """Where and in which precision the model runs."""

    panel = "Model"
    device: str = field(default="auto", metadata=cli(
        "Device to run the model on: auto (cuda if available, else cpu), cpu, cuda, cuda:1, ..."))
    model_dtype: Literal["float32", "bfloat16", "float16", "auto"] = field(default="float32", metadata=cli(
        "Precision the model is loaded in (auto: as saved); captured gradients are float32."))
    tokenizer: Path | None = field(default=None, metadata=cli(
        "Tokenizer directory (tokenizer.save_pretrained), for model directories without one -- a Trainer's "
        "checkpoint-N saved without processing_class. Default: the one the store records, else the model's.",
        metavar="TOKENIZER_DIR"))
    base_model: Path | None = field(default=None, metadata=cli(
        "Base model directory of a PEFT/LoRA adapter given as the model (adapter_config.json, no config.json: "
        "save_pretrained of a PeftModel, a LoRA run's checkpoint-N). Default: the one the store records, else the "
        "local directory adapter_config.json names (never the hub).", metavar="BASE_DIR"))


@dataclass(kw_only=True)
class DataOptions(Group):
    """How a dataset is read, tokenized and batched (see docs/data.md)."""

    panel = "Data"
    data_format: Literal["auto", "text", "prompt-completion", "messages", "preference"] = field(
        default="auto", metadata=cli(
            "Dataset format: text, prompt-completion (strings or message lists), messages (chat) or preference "
            "(prompt/chosen/rejected pairs, TRL's preference format: one example per pair, attributed with the DPO "
            "loss, see --loss); auto: from the fields, as TRL does.", "--format"))
    text_field: str = field(default="text", metadata=cli("Field holding each example's text (format text)."))
    prompt_field: str = field(default="prompt", metadata=cli("Field holding the prompt (format prompt-completion)."))
    completion_field: str = field(default="completion", metadata=cli(
        "Field holding the completion (format prompt-completion)."))
    messages_field: str = field(default="messages", metadata=cli(
        "Field holding the list of {role, content} messages (format messages)."))
    chosen_field: str = field(default="chosen", metadata=cli(
        "Field holding the preferred completion (format preference)."))
    rejected_field: str = field(default="rejected", metadata=cli(
        "Field holding the dispreferred completion (format preference)."))
    id_field: str = field(default="id", metadata=cli(
        "Field holding each example's id (optional; default ids are content hashes of the tokens)."))
    split: str | None = field(default=None, metadata=cli(
        "Split of a DatasetDict directory (save_to_disk) to read, e.g. train."))
    loss_on: Literal["auto", "completion", "assistant", "all"] = field(default="auto", metadata=cli(
        "Tokens in each example's loss: auto (text: all; prompt-completion: the completion; messages: the assistant "
        "turns), completion, assistant, all."))
    batch_size: int = field(default=8, metadata=cli("Examples per forward/backward pass.", min=1))
    max_length: int | None = field(default=None, metadata=cli(
        "Longest example in tokens (default: the model's context); longer prompts are cut from the left, a longer "
        "text or completion is an error unless --truncate.", min=2))
    truncate: bool = field(default=False, metadata=cli(
        "Cut texts or completions longer than --max-length (on the right) instead of stopping with an error."))
    eos: bool = field(default=False, metadata=cli(
        "Format text: end each text with the tokenizer's EOS token, as TRL's SFTTrainer does (off by default: "
        "content-hash ids change with it). Completions always get one."))

    def record_fields(self) -> Fields:
        """The Python API's :class:`gradtrace.options.data.Fields` of --text-field ... --id-field."""
        return Fields(text=self.text_field, prompt=self.prompt_field, completion=self.completion_field,
                      messages=self.messages_field, chosen=self.chosen_field, rejected=self.rejected_field,
                      id=self.id_field)

    def read_options(self, max_length: int | None) -> ReadOptions:
        """The Python API's :class:`gradtrace.options.data.ReadOptions` of --format, --split, --loss-on, --truncate
        and --eos, with ``max_length`` (--max-length resolved against the model's context)."""
        return ReadOptions(format=self.data_format, split=self.split, loss_on=self.loss_on, max_length=max_length,
                           truncate=self.truncate, add_eos=self.eos)

    def batch_options(self, pad_id: int | None) -> BatchOptions:
        """The Python API's :class:`gradtrace.options.data.BatchOptions` of --batch-size, padded with ``pad_id``."""
        return BatchOptions(batch_size=self.batch_size, pad_id=pad_id)


@dataclass(kw_only=True)
class GenerateOptions(Group):
    """The model's own answers as queries (gradtrace score --generate)."""

    panel = "Generate"
    generate: bool = field(default=False, metadata=cli(
        "Answer each query prompt with the model and attribute the loss of its answer; the answers are saved with the "
        "scores. Several stores: the model explained answers (--answer-model)."))
    answer_model: Path | None = field(default=None, metadata=cli(
        "With --generate and several stores: the model that answers, one of the stores' models (default: the latest "
        "checkpoint, by step, when every model is a checkpoint-N directory of one run; else STORE's model).",
        metavar="MODEL_DIR"))
    max_new_tokens: int = field(default=64, metadata=cli("Longest generated answer, in tokens.", min=1))
    temperature: float = field(default=0.0, metadata=cli(
        "0: greedy decoding; above 0: sample at this temperature (no top-k/top-p).", min=0.0))
    generate_seed: int = field(default=0, metadata=cli("Seed of the sampling (same seed, same answers).", "--seed",
                                                                          valid=SEED))

    def settings(self, model: object) -> object | None:
        """A :class:`gradtrace.data.Generate` for ``model``, or None without --generate."""
        from ..data import Generate

        if not self.generate:
            return None
        return Generate(model, max_new_tokens=self.max_new_tokens, temperature=self.temperature,
                        seed=self.generate_seed)


@dataclass(kw_only=True)
class LayerOptions(Group):
    """Which layers are captured: the ``layers`` / ``exclude`` / ``partial`` of the Python API's
    :class:`gradtrace.options.CaptureOptions` (``gradtrace.collect(..., options=CaptureOptions(layers=...,
    exclude=...))``)."""

    panel = "Layers"
    layers: list[str] = field(default_factory=list, metadata=cli(
        f"Capture only the modules this pattern matches (repeat for several; default: every supported module): "
        f"{LAYER_PATTERNS}. A pattern that matches no module is an error naming close ones.", "--layers",
        metavar="PATTERN"))
    exclude: list[str] = field(default_factory=list, metadata=cli(
        "Leave out the modules this pattern matches (repeat for several; same patterns as --layers). A module that "
        "shares a parameter with a captured one (tied embeddings) cannot be left out alone.", "--exclude",
        metavar="PATTERN"))
    partial: bool = field(default=False, metadata=cli(
        "Collect even when some trainable parameters cannot be captured per example: they are left out with a "
        "warning, and the store records the share captured (gradtrace inspect shows it). Default: such a parameter "
        "stops collect with an error naming it and the --exclude to leave it out on purpose."))

    def apply(self, options: CaptureOptions) -> CaptureOptions:
        """``options`` with these layers, exclusions and ``partial`` (the API's ``None`` for no pattern)."""
        return replace(options, layers=list(self.layers) or None, exclude=list(self.exclude) or None,
                       partial=self.partial)


@dataclass(kw_only=True)
class ProjectionOptions(Group):
    """LoGra random projection of the gradients at capture time."""

    panel = "Projection"
    projection: Literal["logra", "none"] = field(default="logra", metadata=cli(
        "logra: Kronecker-factored random projection at capture; none: exact full gradients (tiny models only)."))
    rank: int = field(default=16, metadata=cli(
        "LoGra rank per factor (a matrix parameter stores rank x rank numbers).", min=1))
    seed: int = field(default=0, metadata=cli("LoGra projection seed (queries are projected with the store's seed).",
                                                        valid=SEED))
    ranks: str = field(default="", metadata=cli(
        "Per-parameter LoGra ranks, comma-separated GLOB=ROWSxCOLS or GLOB=RANK (e.g. '*wte.weight=512x32': keep "
        "an embedding's vocabulary axis).", metavar="SPEC"))
    grad_dtype: Literal["float32", "activation"] = field(default="float32", metadata=cli(
        "The dtype of LoGra's projection products: float32 (a bf16/fp16 factor upcast by blocks) or activation "
        "(the model's own dtype, each projected value rounded once to it; faster, no float32 copy). The sums over "
        "tokens are float32 either way; queries are projected as the store records."))

    def capture_options(self) -> CaptureOptions:
        """The Python API's :class:`gradtrace.options.CaptureOptions` these options stand for (its projection and
        the dtype of its products)."""
        from ..projection import LoGra

        if self.projection == "none":
            if self.grad_dtype != "float32":
                from .errors import CliError

                raise CliError("--grad-dtype sets the dtype of LoGra's projection products: it needs --projection "
                               "logra")
            return CaptureOptions()
        return CaptureOptions(projection=LoGra(rank=self.rank, seed=self.seed, ranks=self.logra_ranks()),
                              grad_dtype=self.grad_dtype)

    def logra_ranks(self) -> dict[str, tuple[int, int]]:
        """``--ranks`` parsed into ``LoGra(ranks=...)``'s form."""
        out: dict[str, tuple[int, int]] = {}
        for part in filter(None, (p.strip() for p in self.ranks.split(","))):
            glob, sep, size = part.rpartition("=")
            rows, _, cols = size.partition("x")
            try:
                if not sep or not glob:
                    raise ValueError
                out[glob] = (int(rows), int(cols or rows))
            except ValueError:
                raise ValueError(f"--ranks: expected GLOB=ROWSxCOLS or GLOB=RANK, got {part!r}") from None
        return out


@dataclass(kw_only=True)
class TextOptions(Group):
    """Where the texts shown beside the scores come from (``gradtrace topk`` and ``gradtrace report``): the training
    data and the query file, each read with the data options recorded when it was collected or scored, which these
    options override."""

    panel = "Texts"
    data: Path | None = field(default=None, metadata=cli(
        "Training data (as given to collect) for the training examples' texts (default: the data the store was "
        "collected from, when it still exists)."))
    queries: Path | None = field(default=None, metadata=cli(
        "Query data (as given to score) for the queries' texts (default: the file gradtrace score read, when it "
        "still exists)."))
    text_field: str | None = field(default=None, metadata=cli(
        "Text field of --data and --queries (default: as recorded when collecting/scoring, else 'text')."))
    train_text_field: str | None = field(default=None, metadata=cli(
        "Text field of the training data only (overrides --text-field)."))
    query_text_field: str | None = field(default=None, metadata=cli(
        "Text field of the queries only (overrides --text-field)."))
    prompt_field: str | None = field(default=None, metadata=cli(
        "Prompt field of prompt-completion data, shown as prompt + completion (default: as recorded, else "
        "'prompt')."))
    completion_field: str | None = field(default=None, metadata=cli(
        "Completion field of prompt-completion data (default: as recorded, else 'completion')."))
    id_field: str | None = field(default=None, metadata=cli(
        "Id field of --data/--queries (default: as recorded, else 'id')."))
    model: Path | None = field(default=None, metadata=cli(
        "Tokenizer directory for content-hash ids, when the data has no ids (default: the model recorded with "
        "the store/scores).", metavar="MODEL_DIR"))

    def source(self, side: Literal["train", "query"], recorded: Any) -> Any:
        """The :class:`gradtrace.report.texts.DataSource` of one side: ``--data``/``--queries`` if given (read with
        the ``recorded`` settings), else the ``recorded`` source; these options override its fields."""
        from ..report import ReportError
        from ..report.texts import resolve_source
        from .errors import CliError

        train = side == "train"
        given, option = (self.data, "--data TRAIN.jsonl") if train else (self.queries, "--queries QUERIES.jsonl")
        fields = {name: value for name, value in (("prompt_field", self.prompt_field),
                                                  ("completion_field", self.completion_field)) if value}
        try:
            return resolve_source(given, recorded, what="training data" if train else "queries", option=option,
                                  text_field=(self.train_text_field if train else self.query_text_field)
                                  or self.text_field, id_field=self.id_field, model=self.model, fields=fields)
        except ReportError as err:
            raise CliError(str(err)) from None

    def texts(self, side: Literal["train", "query"], recorded: Any) -> tuple[dict[str, str], str]:
        """``({id: text}, where they came from)`` of one side (:meth:`source`), ids as collect/score gave them."""
        from ..report import ReportError, read_texts
        from .data_warnings import data_warnings_shown
        from .errors import CliError

        source = self.source(side, recorded)
        what = "training data" if side == "train" else "queries"
        try:
            with data_warnings_shown():  # a file changed since it was collected/scored: one line on stderr
                texts = read_texts(source, what=what)
        except ReportError as err:
            raise CliError(str(err)) from None
        given = self.data if side == "train" else self.queries
        flag = "--data" if side == "train" else "--queries"
        return texts, f"{flag} {source.path}" if given is not None else f"{what} file {source.path} (recorded)"

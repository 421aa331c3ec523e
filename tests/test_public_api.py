"""The public surface: the names each stage package exports, held here so that they change only on purpose, and
the width of its entry points (issue #28)."""

from __future__ import annotations

import gradtrace
import gradtrace.grad
import gradtrace.projection


def test_projections_are_one_package():
    assert gradtrace.LoGra is gradtrace.projection.LoGra
    assert issubclass(gradtrace.projection.DenseProjection, gradtrace.projection.Sketch)


def test_every_exported_name_resolves():
    missing = [name for name in gradtrace.__all__ if not hasattr(gradtrace, name)]
    assert not missing


# -- the public surface, held so that it changes only on purpose -------------------------------------------------
SURFACE: dict[str, list[str]] = {
    "gradtrace": [
        "Attributor", "Capture", "CaptureCallback", "CaptureReport", "Ensemble", "FitPlan",
        "GradientBatch", "GradientSet", "GradientSpec", "GradientStore", "LoGra", "Loss", "CaptureOptions",
        "StoreOptions", "FitOptions", "RunOptions", "ParamGradient", "Plan", "ScorePlan", "Scores", "StoreWriter",
        "TrajectoryWriter", "Unrolled",
        "__version__", "available_methods", "capture", "collect", "collect_checkpoints",
        "data_value_embeddings", "less_features", "less_query_features", "load_fit", "plan", "plan_fit",
        "plan_score", "save_fit"
    ],
    "gradtrace.common": [
        "canonical_param_names", "context_limit", "rank_and_world", "strip_wrappers", "to_device",
        "unwrap"
    ],
    "gradtrace.loss": [
        "DPO", "DPOLoss", "LossConvention", "LossFn", "MODEL_KEYS", "causal_lm_loss", "classification_loss",
        "default_loss_labels", "likelihoods", "lm_labels", "regression_loss", "token_cross_entropy"
    ],
    "gradtrace.data": [
        "DataError", "DataSummary", "FORMATS", "Fields", "Generate", "PreferenceDataset", "TokenizedDataset",
        "display_text", "load", "load_preference", "texts"
    ],
    "gradtrace.grad": [
        "CostModel", "DenseTerm", "GradientBatch", "MachineProfile", "OuterTerm", "ParamGradient",
        "QuantizedRows", "VectorTerm", "concat", "inner", "quantize", "spearman", "sq_norms",
        "token_inner"
    ],
    "gradtrace.projection": [
        "DenseProjection", "LoGra", "PCABasis", "Projection", "ProjectionError", "Projector", "Sketch",
        "SparseProjection", "projection_from_dict", "register_projection"
    ],
    "gradtrace.store": [
        "GradientSpec", "GradientStore", "IdCollision", "ShardWriter", "SpecMismatch", "StoreError",
        "StoreWriteError", "StoreWriter", "model_fingerprint"
    ],
    "gradtrace.distributed": [
        "RankFailure", "RankMismatch", "RowSubset", "agreed", "capture_spec", "check_same",
        "check_store_writers", "comm_device", "gather_objects", "is_distributed", "launched_by_torchrun",
        "process_group", "rank_and_world", "rank_rows", "score_sharded"
    ],
    "gradtrace.capture": [
        "Capture", "CaptureCallback", "CaptureReport", "capture", "select_layers"
    ],
    "gradtrace.capture.sink": [
        "ExtraFields", "MemoryRows", "RowBackend", "RowSink", "RowTransform", "ShardRows", "StoreWriter",
        "batch_digests"
    ],
    "gradtrace.fit": [
        "Arnoldi", "ConjugateGradient", "CovarianceCallback", "Curvature", "CurvatureError", "DenseBlock",
        "DenseEigen", "DenseGGN", "EKFAC", "EigenCorrectionCallback", "FitError", "GGN", "GradCos", "GradDot",
        "KFAC", "KFACBasis", "KronBlock", "KronEigen", "LoGraInfluence", "Method", "MissingStage", "TRAK",
        "TracIn", "TrackStar", "available_methods", "blocks_for", "fit_curvature", "get_method", "load_fit",
        "method_class", "pca_basis", "pca_logra", "register_method", "save_fit", "saves_fit"
    ],
    "gradtrace.score": [
        "Attributor", "Ensemble", "EnsembleError", "Index", "IndexMismatch", "Scores", "ScoresError",
        "ScoringError", "TopK", "Unrolled", "build_index", "score_with_index"
    ],
    "gradtrace.report": [
        "DataSource", "Report", "ReportError", "build_report", "pair_attributions", "read_texts",
        "recorded_sources", "render_html", "render_report", "resolve_source", "write_atomic"
    ],
    "gradtrace.train": [
        "OnlineSelection", "SAMAReweighting", "SelectionRecord", "TrajectoryWriter",
        "adam_update_jacobian"
    ],
    "gradtrace.integrations": [
        "GradtraceCallback", "checkpoints", "segments"
    ],
    "gradtrace.eval": [
        "DigitsMLPTask", "DigitsTask", "GroundTruth", "INHERIT", "LDSResult", "MethodSpec", "QueryMetric",
        "RANDOM", "Row", "StaleGroundTruth", "TASKS", "Task", "TinyLMTask", "build_lds_ground_truth",
        "build_loo_ground_truth", "evaluate", "format_table", "get_task", "lds", "loo_correlation",
        "pearson", "recall_at_k", "subset_masks", "summarize", "unsupported"
    ],
    "gradtrace.options": [
        "RECORD_KEY", "BatchOptions", "CaptureOptions", "Fields", "FitOptions", "IndexOptions", "LDSOptions",
        "Loss", "MetagradOptions", "ReadOptions", "ReportOptions", "ReweightingOptions", "RunOptions", "SearchOptions",
        "SelectionOptions", "StoreOptions", "record", "with_record"
    ],
    "gradtrace.replay": [
        "MetaGradients", "OptimState", "RecordedRun", "Reduction", "ReplayError", "ReplayResult", "RunRecorder",
        "SmoothnessReport", "clip_grad_norm", "load_run", "metagradients", "metasmoothness", "optimizer_step",
        "replay"
    ],
}
"""Each stage package's ``__all__`` (the top level ``gradtrace`` first). Adding or removing a public name is a
decision: change it here, in ``docs/api.md`` for the top level, and in the changelog."""

WIDE_ENTRY_POINTS: dict[str, int] = {}
"""Public functions and constructors that still take more than 8 parameters, with how many (none since the LESS
sketch moved into ``CaptureOptions.projection``). The list may only shrink: a new wide entry point, or a listed one
growing, fails the test. Dataclasses whose fields are records or options (``CaptureOptions``, ``Plan``) are not entry
points and are not counted."""

MAX_PARAMETERS = 8


def test_every_stage_package_exports_exactly_its_recorded_names():
    import importlib

    for package, names in SURFACE.items():
        exported = sorted(importlib.import_module(package).__all__)
        assert exported == sorted(names), (package, sorted(set(exported) ^ set(names)))


def test_the_top_level_namespace_is_curated():
    assert len(gradtrace.__all__) <= 40
    assert not {"ParamGrad"} & set(gradtrace.__all__) and not hasattr(gradtrace, "GradBatch")


def _wide_entry_points() -> dict[str, int]:
    import dataclasses
    import importlib
    import inspect

    wide: dict[str, int] = {}
    for package in SURFACE:
        module = importlib.import_module(package)
        for name in module.__all__:
            obj = getattr(module, name)
            if inspect.isclass(obj) and dataclasses.is_dataclass(obj):
                continue  # a record or an option object: its fields are the point
            fn = obj.__init__ if inspect.isclass(obj) else obj
            if not callable(fn):
                continue
            try:
                signature = inspect.signature(fn)
            except (TypeError, ValueError):
                continue
            params = [p for p in signature.parameters.values() if p.name not in ("self", "cls")
                      and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
            if len(params) > MAX_PARAMETERS:
                wide[f"{obj.__module__}.{obj.__qualname__}"] = len(params)
    return wide


def test_no_new_public_entry_point_takes_more_than_eight_parameters():
    wide = _wide_entry_points()
    new = {name: n for name, n in wide.items() if name not in WIDE_ENTRY_POINTS}
    grown = {name: (WIDE_ENTRY_POINTS[name], n) for name, n in wide.items()
             if name in WIDE_ENTRY_POINTS and n > WIDE_ENTRY_POINTS[name]}
    assert not new, f"public entry points over {MAX_PARAMETERS} parameters: {new}; take an option object instead"
    assert not grown, f"wide entry points grew (listed, now): {grown}"
    shrunk = sorted(set(WIDE_ENTRY_POINTS) - set(wide))
    assert not shrunk, f"{shrunk} now take at most {MAX_PARAMETERS} parameters: remove them from WIDE_ENTRY_POINTS"

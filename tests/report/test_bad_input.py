"""Bad input to the report: one clear ReportError naming what is wrong and what to pass; nothing written over."""

from __future__ import annotations

import json

import pytest
import torch

from gradtrace.options.report import ReportOptions
from gradtrace.report import ReportError, render_report
from tests.report.helpers import synthetic


def test_no_texts_and_nothing_recorded_names_the_argument():
    scores, _, queries = synthetic()
    with pytest.raises(ReportError, match=r"record no training data .* pass texts="):
        render_report(scores, queries=queries)
    with pytest.raises(ReportError, match=r"record no queries .* pass queries="):
        render_report(scores, texts={t: "x" for t in scores.train_ids})


def test_recorded_data_that_is_gone_names_the_file(tmp_path):
    scores, _, queries = synthetic()
    store = tmp_path / "store"
    store.mkdir()
    (store / "manifest.json").write_text(json.dumps({"config": {"data": str(tmp_path / "gone.jsonl")}}))
    scores.meta["config"] = {"store": str(store)}
    with pytest.raises(ReportError, match=r"gone\.jsonl, does not exist: pass texts="):
        render_report(scores, queries=queries)


def test_recorded_data_is_read_with_the_recorded_fields(tmp_path):
    scores, texts, queries = synthetic(num_train=12)
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"key": t, "body": texts[t]}) + "\n" for t in scores.train_ids))
    store = tmp_path / "store"
    store.mkdir()
    (store / "manifest.json").write_text(json.dumps({"config": {"data": str(data), "text_field": "body",
                                                                "id_field": "key"}}))
    scores.meta["config"] = {"store": str(store)}
    html = render_report(scores, queries=queries, options=ReportOptions(k=2))
    assert f"training text of {scores.topk(1).ids[0][0]}:" in html


def test_ids_missing_from_the_texts_name_the_first_and_count():
    scores, texts, queries = synthetic(num_queries=1, num_train=20)
    shown = scores.topk(3).ids[0] + scores.topk(3, largest=False).ids[0]
    for t in shown[1:3]:
        del texts[t]
    with pytest.raises(ReportError, match=rf"training id '{shown[1]}' is not in the given texts \(1 more are missing"):
        render_report(scores, texts, queries, options=ReportOptions(k=3))
    del queries["query-0"]
    with pytest.raises(ReportError, match=r"query id 'query-0' is not in the given queries"):
        render_report(scores, {t: "x" for t in scores.train_ids}, queries, options=ReportOptions(k=3))


def test_non_finite_matrix_names_query_and_example():
    scores, texts, queries = synthetic(num_queries=3, num_train=20)
    scores.matrix[1, 7] = float("nan")
    scores.matrix[2, 0] = float("inf")
    with pytest.raises(ReportError, match=r"score matrix holds 2 non-finite values \(first: nan at query "
                                          r"'query-1', training example 't7'\)"):
        render_report(scores, texts, queries)


def test_non_finite_kept_top_k_names_the_training_example():
    scores, texts, queries = synthetic(num_queries=2, num_train=20, matrix=False)
    scores.top[0][1, 2] = float("-inf")
    bad = scores.train_ids[int(scores.top[1][1, 2])]
    with pytest.raises(ReportError, match=rf"top-k scores holds 1 non-finite value .* query 'query-1', training "
                                          rf"example '{bad}'"):
        render_report(scores, texts, queries)


def test_more_examples_than_kept_is_an_error():
    scores, texts, queries = synthetic(matrix=False, topk=3)
    with pytest.raises(ReportError, match=r"only the top 3 .* report fewer with ReportOptions\(k=\) / --k"):
        render_report(scores, texts, queries, options=ReportOptions(k=5))


@pytest.mark.parametrize("build, line", [
    (lambda: ReportOptions(k=0), "k must be an integer >= 1, got 0"),
    (lambda: ReportOptions(per_page=-3), "per_page must be an integer >= 1, got -3"),
    (lambda: ReportOptions(max_chars=1.5), "max_chars must be an integer >= 1, got 1.5"),
    (lambda: ReportOptions(self_k=True), "self_k must be an integer >= 1, got True"),
])
def test_a_bad_number_is_refused_when_the_options_are_made(build, line):
    with pytest.raises(ValueError) as refused:
        build()
    assert str(refused.value) == line


def test_options_must_be_report_options():
    scores, texts, queries = synthetic()
    with pytest.raises(TypeError, match=r"options= must be a gradtrace\.ReportOptions, got dict"):
        render_report(scores, texts, queries, options={"k": 3})
    with pytest.raises(TypeError, match="title must be a string"):
        ReportOptions(title=3)


def test_bad_self_scores():
    scores, texts, queries = synthetic(num_train=20)
    with pytest.raises(ReportError, match=r"self_scores has 19 values for 20 training examples"):
        render_report(scores, texts, queries, self_scores=torch.ones(19))
    with pytest.raises(ReportError, match=r"self-influence scores holds 1 non-finite value .* training example 't4'"):
        render_report(scores, texts, queries, self_scores=torch.ones(20).index_fill(0, torch.tensor([4]),
                                                                                     float("nan")))
    with pytest.raises(ReportError, match=r"no value for training example 't0' \(20 missing\)"):
        render_report(scores, texts, queries, self_scores={"other": 1.0})


def _attribution(scores, **fields):
    top = scores.topk(1)
    return {"query_id": "query-0", "train_id": top.ids[0][0], **fields}, float(top.values[0, 0])


@pytest.mark.parametrize("case, message", [
    ("sum", r"training side\) scores sum to .*, not the pair's score"),
    ("length", r"3 tokens but 2 scores"),
    ("nan", r"scores holds non-finite values"),
    ("shape", r"meta\['tokens'\] must be a list"),
    ("modules", r"modules sum to .*, not the pair's score"),
])
def test_malformed_token_and_module_attributions(case, message):
    scores, texts, queries = synthetic()
    entry, value = _attribution(scores, train_tokens=["a", "b", "c"])
    entry["train_scores"] = [value / 3] * 3  # a valid decomposition, broken below
    if case == "sum":
        entry["train_scores"] = [value / 3, value / 3, value / 2]
    elif case == "length":
        entry["train_scores"] = [value / 2, value / 2]
    elif case == "nan":
        entry["train_scores"] = [value, float("nan"), 0.0]
    scores.meta["tokens"] = {"not": "a list"} if case == "shape" else [entry]
    if case == "modules":
        scores.meta["modules"] = [{**entry, "modules": {"a": value, "b": value}}]
    with pytest.raises(ReportError, match=message):
        render_report(scores, texts, queries)


def test_exact_decompositions_pass_within_float32_rounding():
    scores, texts, queries = synthetic()
    entry, value = _attribution(scores)
    parts = (torch.rand(500, dtype=torch.float32) * value).tolist()
    parts[-1] = float(torch.tensor(value, dtype=torch.float32) - torch.tensor(parts[:-1], dtype=torch.float32).sum())
    scores.meta["tokens"] = [{**entry, "train_tokens": ["t"] * 500, "train_scores": parts}]
    render_report(scores, texts, queries)  # summed in another order than float32 did: rounding only


def test_a_failed_render_leaves_the_existing_report(tmp_path):
    scores, texts, queries = synthetic()
    out = tmp_path / "report.html"
    render_report(scores, texts, queries, out=out)
    before = out.read_bytes()
    scores.matrix[0, 0] = float("nan")
    with pytest.raises(ReportError):
        render_report(scores, texts, queries, out=out)
    assert out.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["report.html"]


def test_out_is_a_directory(tmp_path):
    scores, texts, queries = synthetic()
    with pytest.raises(ReportError, match=r"is a directory; give the report's file name"):
        render_report(scores, texts, queries, out=tmp_path)

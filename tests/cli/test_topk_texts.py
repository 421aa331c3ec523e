"""``gradtrace topk`` and ``gradtrace report`` take their texts through one option group (cli/groups.TextOptions):
separate text fields for the training data and the queries, and prompt + completion for prompt-completion data."""

from __future__ import annotations

import json

import pytest

from tests.cli.conftest import error_line, flat, invoke

PAIRS = [("The king speaks:", " fair is foul"), ("The queen hears:", " sweet love and war"),
         ("Night and day:", " the sword and the crown")]


def _jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def scored(ws, runner, store, tmp_path_factory):
    """Scores of queries held in a ``question`` field; the training data again with its text in ``body``."""
    root = tmp_path_factory.mktemp("topk_texts")
    queries = _jsonl(root / "queries.jsonl", [{"id": f"q{i}", "question": p + c} for i, (p, c) in enumerate(PAIRS)])
    invoke(runner, "score", store, queries, "--model", ws.model, "--out", root / "scores", "--topk", 3,
           "--text-field", "question", "--no-progress")
    records = [json.loads(line) for line in ws.train.read_text().splitlines()]
    body = _jsonl(root / "train_body.jsonl", [{"id": r["id"], "body": r["text"]} for r in records])
    return root, queries, body, {r["id"]: r["text"] for r in records}


def _json_rows(runner, *args):
    return json.loads(invoke(runner, "topk", *args, "--k", 2, "--format", "json").stdout)


def test_separate_text_fields_for_training_data_and_queries(runner, scored):
    root, queries, body, train_texts = scored
    want_queries = {f"q{i}": p + c for i, (p, c) in enumerate(PAIRS)}
    for args in (["--text-field", "body", "--query-text-field", "question"],   # one for both, one overridden
                 ["--train-text-field", "body"],                               # queries: as recorded by score
                 ["--train-text-field", "body", "--query-text-field", "question"]):
        rows = _json_rows(runner, root / "scores", "--data", body, "--queries", queries, *args)
        assert len(rows) == 6
        assert [r["train_text"] for r in rows] == [train_texts[r["train_id"]] for r in rows]
        assert [r["query_text"] for r in rows] == [want_queries[r["query_id"]] for r in rows]
    # --text-field alone applies to both sides: the queries have no 'body' field, said in one line
    line = error_line(invoke(runner, "topk", root / "scores", "--data", body, "--queries", queries, "--text-field",
                             "body", code=2))
    assert "body" in line and str(queries) in line


def test_prompt_completion_queries_show_prompt_and_completion(ws, runner, store, scored):
    root, _, _, _ = scored
    pairs = _jsonl(root / "pairs.jsonl", [{"id": f"p{i}", "ask": p, "reply": c} for i, (p, c) in enumerate(PAIRS)])
    invoke(runner, "score", store, pairs, "--model", ws.model, "--out", root / "pair_scores", "--topk", 3,
           "--prompt-field", "ask", "--completion-field", "reply", "--no-progress")
    want = {f"p{i}": p + c for i, (p, c) in enumerate(PAIRS)}
    rows = _json_rows(runner, root / "pair_scores", "--queries", pairs)  # the fields score recorded
    assert {r["query_id"]: r["query_text"] for r in rows} == want
    renamed = _jsonl(root / "renamed.jsonl", [{"id": f"p{i}", "q": p, "a": c} for i, (p, c) in enumerate(PAIRS)])
    rows = _json_rows(runner, root / "pair_scores", "--queries", renamed, "--prompt-field", "q",
                      "--completion-field", "a")
    assert {r["query_id"]: r["query_text"] for r in rows} == want
    table = flat(invoke(runner, "topk", root / "pair_scores", "--queries", renamed, "--prompt-field", "q",
                        "--completion-field", "a", "--width", 200).stdout)
    assert f"query p0: {PAIRS[0][0]}{PAIRS[0][1]}" in table
    # the HTML report takes the same options
    invoke(runner, "report", root / "pair_scores", "--queries", renamed, "--prompt-field", "q", "--completion-field",
           "a", "--out", root / "r.html")
    from markupsafe import escape

    assert str(escape(want["p0"])) in (root / "r.html").read_text()


def test_one_group_declares_the_text_options(runner):
    from gradtrace.cli.commands import flat_fields
    from gradtrace.cli.groups import TextOptions
    from gradtrace.cli.report import ReportCommand
    from gradtrace.cli.topk import TopkCommand

    names = [f.name for f in flat_fields(TextOptions)]
    for command in (TopkCommand, ReportCommand):
        assert [f.name for f in flat_fields(command) if f.panel == "Texts"] == names
    for command in ("topk", "report"):
        shown = flat(invoke(runner, command, "--help").stdout)
        assert "--train-text-field" in shown and "--query-text-field" in shown and "--prompt-field" in shown

"""The command line refuses what it cannot do right with one line and a non-zero exit, before any costly work,
and never reports a partial result as a complete one."""

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from gradtrace.cli import collect as cli_collect
from gradtrace.cli import score_queries  # where gradtrace score loads the models of its queries
from gradtrace.store import GradientStore
from gradtrace.store.layout import acquire_lock, release_lock
from tests.cli import conftest as cli_fixtures
from tests.cli.conftest import copy_store, error_line, invoke

ws, runner, store = cli_fixtures.ws, cli_fixtures.runner, cli_fixtures.store  # the command-line tests' fixtures


def _save_model(ws, target: Path, edit=None) -> Path:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(ws.model)
    if edit is not None:
        with torch.no_grad():
            edit(model)
    model.save_pretrained(target)
    AutoTokenizer.from_pretrained(ws.model).save_pretrained(target)
    return target


def _poisoning_loader(token: int):
    """``load_model`` that makes every row holding ``token`` NaN in the model's input embeddings (an example whose
    own data overflows), as a stand-in for a data-dependent NaN."""
    real = score_queries.load_model

    def load(path, device, dtype="float32", base_model=None):
        model = real(path, device, dtype, base_model)

        def hook(mod, args, output):
            rows = (args[0] == token).any(1)
            return output.masked_fill(rows[:, None, None], float("nan"))

        model.transformer.wte.register_forward_hook(hook)
        return model

    return load


def _queries(ws, tmp_path: Path) -> tuple[Path, int]:
    """Three queries q0..q2 and a token that only q1 holds."""
    from transformers import AutoTokenizer

    texts = [ws.lines[200], ws.lines[201], ws.lines[202]]
    tok = AutoTokenizer.from_pretrained(ws.model)
    ids = [set(tok(t)["input_ids"]) for t in texts]
    only_q1 = sorted(ids[1] - ids[0] - ids[2])[0]
    path = tmp_path / "queries.jsonl"
    path.write_text("".join(json.dumps({"id": f"q{i}", "text": t}) + "\n" for i, t in enumerate(texts)))
    return path, only_q1


# ------------------------------------------------------------------------------------------ score: dropped queries
def test_score_refuses_queries_with_nan_gradients_unless_allow_partial(ws, runner, store, tmp_path, monkeypatch):
    queries, token = _queries(ws, tmp_path)
    monkeypatch.setattr(score_queries, "load_model", _poisoning_loader(token))
    out = tmp_path / "scores"
    result = invoke(runner, "score", store, queries, "--model", ws.model, "--out", out, "--no-progress", code=2)
    assert error_line(result) == (f"Error: 1 of 3 queries of {queries} have NaN/inf gradients with model {ws.model} "
                                  "and cannot be scored: q1. Fix them, or pass --allow-partial to score the other 2")
    assert not (out / "scores.json").exists()

    result = invoke(runner, "score", store, queries, "--model", ws.model, "--out", out, "--no-progress",
                    "--allow-partial")
    assert "Scored 2 queries against 24 training examples" in result.output
    assert "Warning: 1 query with NaN/inf gradients left out (--allow-partial): q1" in result.output
    from gradtrace import Scores

    scores = Scores.load(out)
    assert scores.query_ids == ["q0", "q2"]
    assert scores.meta["dropped_queries"] == {"ids": ["q1"], "reason": "NaN/inf gradients"}


def test_score_with_every_query_nan_is_an_error(ws, runner, store, tmp_path, monkeypatch):
    queries = tmp_path / "q.jsonl"
    queries.write_text(json.dumps({"id": "only", "text": ws.lines[200]}) + "\n")
    from transformers import AutoTokenizer

    token = AutoTokenizer.from_pretrained(ws.model)(ws.lines[200])["input_ids"][0]
    monkeypatch.setattr(score_queries, "load_model", _poisoning_loader(token))
    result = invoke(runner, "score", store, queries, "--model", ws.model, "--out", tmp_path / "s", "--no-progress",
                    code=2)
    assert "all 1 examples have NaN/inf gradients (only)" in error_line(result)


# ------------------------------------------------------------------------------------------ collect
def test_collect_refuses_a_model_with_a_nan_weight_naming_it(ws, runner, tmp_path):
    def edit(model):
        model.transformer.h[1].mlp.c_proj.weight[2, 3] = float("nan")

    model = _save_model(ws, tmp_path / "nan-model", edit)
    out = tmp_path / "store"
    result = invoke(runner, "collect", model, ws.train, "--out", out, "--rank", 4, "--no-progress", code=2)
    assert error_line(result).startswith(f"Error: model {model}: the model's parameter "
                                         "transformer.h.1.mlp.c_proj.weight holds NaN/inf; ")
    assert not out.exists()


def test_collect_where_every_example_is_nan_is_an_error(ws, runner, tmp_path, monkeypatch):
    real = cli_collect.load_model

    def load(path, device, dtype="float32", base_model=None):
        model = real(path, device, dtype, base_model)
        model.transformer.wte.register_forward_hook(lambda m, a, o: o * float("nan"))
        return model

    monkeypatch.setattr(cli_collect, "load_model", load)
    out = tmp_path / "store"
    result = invoke(runner, "collect", ws.model, ws.train, "--out", out, "--rank", 4, "--no-progress", code=2)
    assert "all 24 examples have NaN/inf gradients (t0, t1, t2 ...); nothing new was stored" in error_line(result)


def test_collect_names_single_token_examples(ws, runner, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ws.model)
    word = next(w for w in ("the", "a", "I", ".") if len(tok(w)["input_ids"]) == 1)
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"id": "long", "text": ws.lines[0]}) + "\n" + json.dumps({"id": "one", "text": word})
                    + "\n")
    out = tmp_path / "store"
    result = invoke(runner, "collect", ws.model, data, "--out", out, "--rank", 4, "--no-progress")
    assert ("Warning: 1 example has no token in the loss (a single token, or nothing after the prompt), so nothing "
            'to predict: stored with a zero gradient (first ids: ["one"]).') in " ".join(result.output.split())
    opened = GradientStore.open(out)
    row = opened.ids.index("one")
    assert torch.equal(opened.read(row, row + 1), torch.zeros(1, opened.spec.dim))


def test_collect_refuses_a_pickle_with_code_in_one_line(ws, runner, tmp_path):
    model = tmp_path / "evil"
    shutil.copytree(ws.model, model)
    for weights in model.glob("*.safetensors"):
        weights.unlink()
    marker = tmp_path / "executed"

    class Payload:
        def __reduce__(self):
            return (os.mkdir, (str(marker),))

    torch.save({"transformer.wte.weight": Payload()}, model / "pytorch_model.bin")
    result = invoke(runner, "collect", model, ws.train, "--out", tmp_path / "store", "--no-progress", code=2)
    assert error_line(result) == (f"Error: refusing to load {model}: pytorch_model.bin holds pickled Python objects "
                                  "besides tensors (they could run code when loaded) and gradtrace loads weights "
                                  "only; get the model as safetensors from a source you trust")
    assert not marker.exists()


def test_collect_refuses_a_huge_rank_before_allocating(ws, runner, tmp_path):
    out = tmp_path / "store"
    result = invoke(runner, "collect", ws.model, ws.train, "--out", out, "--rank", 100000, "--no-progress", code=2)
    line = error_line(result)
    assert line.startswith("Error: LoGra rank 100000 is larger than every dimension of the 28 captured parameters "
                           "(the largest is 320): ")
    assert line.endswith("GiB). Use a rank of at most 320 (16-128 is typical)")
    assert not out.exists()


@pytest.mark.parametrize("flag", ["--resume", "--overwrite"])
def test_collect_refuses_a_store_being_written_before_loading_the_model(ws, runner, store, tmp_path, monkeypatch,
                                                                       flag):
    target = copy_store(store, tmp_path / "store")
    monkeypatch.setattr(cli_collect, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    lock = acquire_lock(target, 0)  # a live writer: this process
    try:
        result = invoke(runner, "collect", ws.model, ws.train, "--out", target, "--rank", 4, flag, "--no-progress",
                        code=2)
    finally:
        release_lock(target, 0)
    line = error_line(result)
    assert line.startswith(f"Error: {target} is being written by another run (pid {os.getpid()} on ")
    assert f"rank-00000.lock); two runs cannot write one store. Wait for it to finish, or delete {lock}" in line
    assert GradientStore.open(target).ids == GradientStore.open(store).ids  # nothing lost


def test_collect_refuses_an_existing_store_before_loading_the_model(ws, runner, store, tmp_path, monkeypatch):
    target = copy_store(store, tmp_path / "store")
    monkeypatch.setattr(cli_collect, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    result = invoke(runner, "collect", ws.model, ws.train, "--out", target, "--no-progress", code=2)
    assert "already holds a gradient store: pass --resume" in error_line(result)

"""``gradtrace collect --format preference --loss dpo --ref-model REF_DIR``: one row per preference pair, the gradient
of its DPO loss -- the rows equal the Python API's (``load_preference`` + ``DPOLoss``), and what cannot be a DPO
collection is refused before any gradient."""

from __future__ import annotations

import json

import torch

import gradtrace
from gradtrace.loss import DPO, DPOLoss
from gradtrace.options import CaptureOptions
from tests.cli.conftest import invoke

PAIRS = [("The cat sat on", " the mat.", " a hat."), ("Dogs like to", " run and play.", " sleep."),
         ("The sky is", " blue today.", " green."), ("Water is", " wet.", " dry and hot.")]


def _pairs_file(root, extra=None):
    path = root / "pairs.jsonl"
    with path.open("w") as f:
        for i, (p, c, r) in enumerate(PAIRS):
            f.write(json.dumps({"id": f"pair{i}", "prompt": p, "chosen": c, "rejected": r, **(extra or {})}) + "\n")
    return path


def test_collect_dpo_pairs_match_the_python_api(ws, runner, fresh):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    pairs, out = _pairs_file(fresh), fresh / "store"
    result = invoke(runner, "collect", ws.model2, pairs, "--out", out, "--rank", 4, "--batch-size", 3,
                    "--ref-model", ws.model, "--beta", 0.3, "--dpo-loss-type", "sigmoid", "--dpo-loss-type", "ipo",
                    "--loss-weight", 1.0, "--loss-weight", 0.5, "--no-progress")
    text = " ".join(result.output.split())
    assert "4 pairs, preference" in text and "reference log-probs from the reference model" in text
    assert "Stored 4 new examples" in text
    stored = gradtrace.GradientStore.open(out)
    assert stored.ids == [f"pair{i}" for i in range(4)]
    load = dict(local_files_only=True, dtype=torch.float32)
    policy = AutoModelForCausalLM.from_pretrained(str(ws.model2), **load)
    reference = AutoModelForCausalLM.from_pretrained(str(ws.model), **load)
    tokenizer = AutoTokenizer.from_pretrained(str(ws.model2), local_files_only=True)
    settings = DPO(beta=0.3, loss_type=("sigmoid", "ipo"), loss_weights=(1.0, 0.5))
    data = gradtrace.data.load_preference(pairs, tokenizer).with_reference(reference, settings)
    expected = gradtrace.collect(policy, data, DPOLoss(settings),
                                 options=CaptureOptions(projection=gradtrace.LoGra(rank=4, seed=0)))
    got = stored.read(0, len(stored))
    scale = float(expected.vectors.abs().max())
    assert scale > 0
    torch.testing.assert_close(got, expected.vectors, rtol=1e-4, atol=1e-5 * scale)
    import yaml

    recorded = yaml.safe_load((out / "gradtrace-collect.yaml").read_text())  # the run's settings, for repeating it
    assert recorded["beta"] == 0.3 and recorded["dpo_loss_type"] == ["sigmoid", "ipo"]
    assert recorded["ref_model"] is not None and recorded["loss"] == "auto"


def test_collect_dpo_reads_trls_precomputed_reference_logps(ws, runner, fresh):
    pairs = _pairs_file(fresh, {"ref_chosen_logps": -12.5, "ref_rejected_logps": -14.0})
    result = invoke(runner, "collect", ws.model, pairs, "--out", fresh / "store", "--rank", 2, "--no-progress")
    assert "reference log-probs from the data" in " ".join(result.output.split())
    result = invoke(runner, "collect", ws.model, pairs, "--out", fresh / "store2", "--ref-model", ws.model,
                    "--no-progress", code=2)
    assert "drop --ref-model" in " ".join(result.output.split())


def test_collect_dpo_refusals(ws, runner, fresh):
    pairs = _pairs_file(fresh)
    cases = [
        (["--loss", "dpo"], "needs the run's reference model"),  # preference data, no reference
        (["--loss", "lm", "--format", "preference"], "--loss dpo"),
        (["--loss", "lm"], "preference data"),  # auto-detected pairs read as fine-tuning text
        (["--ref-model", str(ws.model), "--dpo-loss-type", "aot"], "no gradient of its own"),
    ]
    for flags, message in cases:
        result = invoke(runner, "collect", ws.model, pairs, "--out", fresh / "never", *flags, "--no-progress", code=2)
        assert message in " ".join(result.output.split()), (flags, result.output)
        assert not (fresh / "never").exists()
    result = invoke(runner, "collect", ws.model, ws.train, "--out", fresh / "never", "--loss", "dpo",
                    "--no-progress", code=2)
    assert "not a preference pair" in " ".join(result.output.split())


def test_score_preference_pair_queries_match_the_python_api(ws, runner, fresh):
    """``gradtrace score STORE pairs.jsonl --ref-model``: what made the model prefer the query's chosen answer --
    the query gradients are those of each query pair's DPO loss, scored like any query."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    pairs, out = _pairs_file(fresh), fresh / "store"
    invoke(runner, "collect", ws.model2, pairs, "--out", out, "--rank", 4, "--ref-model", ws.model, "--no-progress")
    queries = fresh / "queries.jsonl"
    queries.write_text(json.dumps({"id": "q", "prompt": "The cat sat on", "chosen": " the mat.",
                                   "rejected": " the dog."}) + "\n")
    result = invoke(runner, "score", out, queries, "--out", fresh / "scores", "--method", "grad_dot",
                    "--ref-model", ws.model, "--matrix", "yes", "--no-progress")
    assert "1 pair, preference" in " ".join(result.output.split())
    scores = gradtrace.Scores.load(fresh / "scores")
    load = dict(local_files_only=True, dtype=torch.float32)
    policy = AutoModelForCausalLM.from_pretrained(str(ws.model2), **load)
    reference = AutoModelForCausalLM.from_pretrained(str(ws.model), **load)
    tokenizer = AutoTokenizer.from_pretrained(str(ws.model2), local_files_only=True)
    data = gradtrace.data.load_preference(queries, tokenizer).with_reference(reference)
    capture = CaptureOptions(projection=gradtrace.LoGra(rank=4, seed=0))
    expected = gradtrace.collect(policy, data, DPOLoss(), options=capture)
    store = gradtrace.GradientStore.open(out)
    exact = expected.vectors.double() @ store.read(0, len(store)).double().T
    assert scores.query_ids == ["q"] and scores.train_ids == store.ids
    torch.testing.assert_close(scores.matrix.double(), exact, rtol=1e-4, atol=1e-6 * float(exact.abs().max()))
    result = invoke(runner, "score", out, queries, "--out", fresh / "s2", "--topk", 2, "--tokens", "--ref-model",
                    ws.model, "--no-progress", code=2)
    assert "attributed whole" in " ".join(result.output.split())

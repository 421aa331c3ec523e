"""``gradtrace metagrad RUN_DIR QUERIES``: a Trainer run recorded by record_trainer, scored from its directory alone,
equals the Python API's metagradients; the plan, topk's texts and the refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from .conftest import error_line, flat, invoke

transformers = pytest.importorskip("transformers")


class _Lines(torch.utils.data.Dataset):
    def __init__(self, tokenizer, lines: list[str]) -> None:
        self.rows = [tokenizer(line)["input_ids"] for line in lines]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.rows[i]}


@pytest.fixture(scope="module")
def recorded(ws, tmp_path_factory) -> Path:
    """A Trainer run of the workspace GPT-2 (dropout 0) on 8 lines, batch 2, accumulation 2, 2 epochs: 4 steps."""
    return _trainer_run(ws, tmp_path_factory.mktemp("metagrad"))


def _trainer_run(ws, root: Path, keep_states: int | None = None) -> Path:
    from gradtrace.replay.hf import record_trainer

    tokenizer = transformers.AutoTokenizer.from_pretrained(ws.model)
    model = transformers.AutoModelForCausalLM.from_pretrained(ws.model, attn_implementation="eager")
    args = transformers.TrainingArguments(
        output_dir=str(root / "out"), per_device_train_batch_size=2, gradient_accumulation_steps=2,
        num_train_epochs=2, learning_rate=5e-3, weight_decay=0.1, lr_scheduler_type="cosine", warmup_steps=1,
        max_grad_norm=1.0, use_cpu=True, report_to="none", save_strategy="no", logging_strategy="no",
        remove_unused_columns=False, dataloader_num_workers=0, seed=0, disable_tqdm=True)
    collator = transformers.DataCollatorForLanguageModeling(tokenizer, mlm=False)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=_Lines(tokenizer, ws.lines[:8]),
                                   data_collator=collator, processing_class=tokenizer)
    record_trainer(trainer, root / "run", keep_states=keep_states)
    trainer.train()
    return root / "run"


def _api_scores(run_dir: Path, queries: Path):
    """The Python API on the same run and queries: saved config, examples and causal_lm_loss."""
    import numpy as np

    from gradtrace.data import load
    from gradtrace.replay import load_run, metagradients
    from gradtrace.replay.examples import load_examples
    from gradtrace.replay.hf import causal_lm_loss, run_loss

    config = transformers.AutoConfig.from_pretrained(run_dir / "model")
    config._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(config)
    tokenizer = transformers.AutoTokenizer.from_pretrained(run_dir / "model")
    data = load(queries, tokenizer)
    batches = []
    for i in range(data.num_examples):
        row = {k: v for k, v in data.rows(np.array([i])).items() if k != "id"}
        row.setdefault("labels", row["input_ids"].clone())
        batches.append(row)
    query_loss = lambda forward, q: causal_lm_loss(forward, q)[0].sum()  # each query's summed token loss
    loss = run_loss(run_dir)  # the Trainer's label counting, from the run directory
    return metagradients(load_run(run_dir), model, loss, load_examples(run_dir), batches, query_loss), data


def test_metagrad_equals_the_python_api_and_topk_shows_texts(ws, runner, recorded, fresh):
    from gradtrace.score import Scores

    out = fresh / "scores"
    result = invoke(runner, "metagrad", recorded, ws.queries, "--out", out, "--no-progress")
    text = flat(result.output)
    assert "Plan:" in text and "Time: T x t_step for the forward replay + T x 1 pass(es)" in text
    assert "t_reverse: one timed reverse step of 3 queries" in text  # measured, not a guessed factor
    assert "plus one reverse step's graph (measured on CUDA devices only)" in text  # this CPU run
    assert "Saved metagradient scores of 3 queries" in text
    saved = Scores.load(out)
    api, data = _api_scores(recorded, ws.queries)
    assert saved.method == "metagradients" and saved.query_ids == [str(i) for i in data.ids]
    assert saved.train_ids == [str(i) for i in api.ids] and len(saved.train_ids) == 8
    torch.testing.assert_close(saved.matrix, api.scores, rtol=1e-5, atol=0)
    meta = saved.meta["metagradients"]
    assert meta["replay_difference"] <= 1e-6 and meta["steps"] == 4 and meta["query_loss"] == "summed token loss"
    assert not list(recorded.glob("metagrad_checkpoints_*"))
    rows = json.loads(invoke(runner, "topk", out, "--k", 3, "--format", "json", "--no-progress").stdout)
    assert len(rows) == 9
    assert all(row["train_text"] == ws.lines[int(row["train_id"])] for row in rows)  # decoded saved examples
    assert all(row.get("query_text") for row in rows)
    table = flat(invoke(runner, "--width", 200, "topk", out, "--k", 2, "--no-progress").output)
    assert "metagradients scores of 3 queries against 8 training examples" in table
    assert " ".join(ws.lines[int(rows[0]["train_id"])].split())[:30] in table
    invoke(runner, "report", out, "--out", fresh / "report.html", "--no-progress")
    html = (fresh / "report.html").read_text()
    assert "metagradients" in html and ws.lines[int(rows[0]["train_id"])].split()[0] in html


def test_dry_run_prints_the_plan_and_writes_nothing(ws, runner, recorded, fresh):
    before = sorted(p.name for p in recorded.iterdir())
    out = fresh / "scores"
    text = flat(invoke(runner, "metagrad", recorded, ws.queries, "--out", out, "--dry-run", "--checkpoint-every", 3,
                       "--memory-limit", 0, "--no-progress").output)
    assert "4 optimizer steps" in text and "Checkpoints every k = 3 steps: 2 checkpoints" in text
    assert "Disk: 2 checkpoints beyond --memory-limit" in text and "Dry run: nothing replayed" in text
    assert not out.exists() and sorted(p.name for p in recorded.iterdir()) == before


def test_float64_and_query_batches_agree(ws, runner, recorded, fresh):
    from gradtrace.score import Scores

    invoke(runner, "metagrad", recorded, ws.queries, "--out", fresh / "a", "--no-progress")
    invoke(runner, "metagrad", recorded, ws.queries, "--out", fresh / "b", "--no-progress", "--dtype", "float64",
           "--query-batch", 1, "--checkpoint-every", 1)
    a, b = Scores.load(fresh / "a"), Scores.load(fresh / "b")
    assert b.matrix.dtype == torch.float64 and b.meta["metagradients"]["dtype"] == "float64"
    torch.testing.assert_close(b.matrix.float(), a.matrix, rtol=1e-2, atol=1e-3 * a.matrix.abs().max().item())


def test_bad_inputs_are_refused(ws, runner, recorded, fresh):
    from gradtrace.replay import Reduction, RunRecorder

    empty = fresh / "empty"
    empty.mkdir()
    line = error_line(invoke(runner, "metagrad", empty, ws.queries, "--out", fresh / "s", code=2))
    assert "is not a recorded run" in line
    model = torch.nn.Linear(2, 1)
    rec = RunRecorder(fresh / "plain", model, torch.optim.SGD(model.parameters(), lr=0.1), reduction=Reduction())
    rec.finish(model)
    line = error_line(invoke(runner, "metagrad", fresh / "plain", ws.queries, "--out", fresh / "s", code=2))
    assert "without its saved model configuration and examples" in line
    tokenizer = transformers.AutoTokenizer.from_pretrained(ws.model)
    assert len(tokenizer("e")["input_ids"]) == 1  # one token: nothing to predict
    short = fresh / "short.jsonl"
    short.write_text(json.dumps({"text": "e"}) + "\n")
    line = error_line(invoke(runner, "metagrad", recorded, short, "--out", fresh / "s", code=2))
    assert "have no loss tokens" in line
    line = error_line(invoke(runner, "metagrad", recorded, ws.queries, "--out", fresh / "s", "--dtype", "float64",
                             "--tolerance", 1e-12, code=2))  # a float32 run replayed in float64 drifts off it
    assert "the replay does not reproduce the recorded run" in line and not (fresh / "s").exists()
    invoke(runner, "metagrad", recorded, ws.queries, "--out", fresh / "t", "--no-progress")
    line = error_line(invoke(runner, "metagrad", recorded, ws.queries, "--out", fresh / "t", code=2))
    assert "already holds scores" in line
    invoke(runner, "metagrad", recorded, ws.queries, "--out", fresh / "t", "--overwrite", "--no-progress")
    assert (fresh / "t" / "train_texts.jsonl").exists()


def test_attribute_with_metagrad_runs_metagrad_then_the_report(ws, runner, recorded, fresh):
    """``gradtrace attribute RUN_DIR DATA QUERIES --method metagrad --recorded DIR``: the scores are gradtrace
    metagrad's, bit for bit, and the report shows them; a RUN_DIR that is the recorded run needs no --recorded."""
    from gradtrace.score import Scores

    trainer_out = fresh / "trainer-out"
    trainer_out.mkdir()
    out = fresh / "attribution"
    text = flat(invoke(runner, "attribute", trainer_out, ws.train, ws.queries, "--out", out, "--method", "metagrad",
                       "--recorded", recorded, "--k", 3, "--no-progress").output)
    assert "metagradients through the recorded run" in text and "is not read" in text
    assert "$ gradtrace metagrad" in text and "$ gradtrace report" in text
    invoke(runner, "metagrad", recorded, ws.queries, "--out", fresh / "by_hand", "--no-progress")
    got, by_hand = Scores.load(out / "scores"), Scores.load(fresh / "by_hand")
    assert got.train_ids == by_hand.train_ids and got.query_ids == by_hand.query_ids
    assert torch.equal(got.matrix, by_hand.matrix)
    assert "metagradients" in (out / "report.html").read_text()
    again = fresh / "again"
    invoke(runner, "attribute", recorded, ws.train, ws.queries, "--out", again, "--method", "metagrad",
           "--no-progress")
    assert torch.equal(Scores.load(again / "scores").matrix, by_hand.matrix)
    late = fresh / "late"
    text = flat(invoke(runner, "attribute", recorded, ws.train, ws.queries, "--out", late, "--method", "metagrad",
                       "--start-step", 2, "--no-progress").output)
    assert "--start-step 2" in text  # passed on to gradtrace metagrad, printed with its command
    invoke(runner, "metagrad", recorded, ws.queries, "--out", fresh / "late_by_hand", "--start-step", 2,
           "--no-progress")
    assert torch.equal(Scores.load(late / "scores").matrix, Scores.load(fresh / "late_by_hand").matrix)


def test_attribute_with_metagrad_refuses_what_does_not_apply(ws, runner, recorded, fresh):
    plain = fresh / "trainer-out"
    plain.mkdir()
    line = error_line(invoke(runner, "attribute", plain, ws.train, ws.queries, "--out", fresh / "a", "--method",
                             "metagrad", code=2))
    assert "is not one: pass --recorded DIR" in line
    line = error_line(invoke(runner, "attribute", plain, ws.train, ws.queries, "--out", fresh / "a", "--method",
                             "metagrad", "--recorded", recorded, "--last", 2, "--generate", code=2))
    assert "--last, --generate apply to the checkpoint ensemble" in line
    line = error_line(invoke(runner, "attribute", plain, ws.train, ws.queries, "--out", fresh / "a", "--recorded",
                             recorded, code=2))
    assert "--recorded applies to --method metagrad" in line
    line = error_line(invoke(runner, "attribute", plain, ws.train, ws.queries, "--out", fresh / "a", "--start-step",
                             3, code=2))
    assert "--start-step applies to --method metagrad" in line
    assert not (fresh / "a").exists()


def test_the_plan_adds_a_measured_reverse_step(recorded):
    """The time line uses the timed reverse step; where its peak memory was measured (CUDA) the memory line adds it."""
    from types import SimpleNamespace

    from gradtrace.cli.metagrad import Timing, plan_lines
    from gradtrace.options import MetagradOptions
    from gradtrace.replay import load_run

    setup = SimpleNamespace(run=load_run(recorded), options=MetagradOptions(), queries=[{}] * 3, dtype=torch.float32)
    lines = plan_lines(setup, Timing(step=0.5, reverse=2.0, reverse_peak=5 << 20), 1 << 20)
    memory = next(line for line in lines if line.startswith("Memory:"))
    assert "one reverse step's graph, measured: 5.0 MiB" in memory
    time_line = next(line for line in lines if line.startswith("Time:"))
    assert "4 x 0.5 + 4 x 1 x (0.5 + 2) s = about 12.0 s" in time_line and "4.0 t_step" in time_line
    setup.options = MetagradOptions(start_step=3)  # truncated: one step reversed, one checkpoint
    lines = plan_lines(setup, Timing(step=0.5, reverse=2.0), 1 << 20)
    assert "each over steps 3..3 (1 of 4: --start-step 3 truncates the pass" in lines[1]
    assert "Checkpoints every k = 1 steps: 1 checkpoints" in lines[2]
    assert "4 x 0.5 + 1 x 1 x (0.5 + 2) s = about 4.5 s" in lines[-1]


def test_start_step_truncates_the_pass_as_the_python_api_does(ws, runner, recorded, fresh):
    from gradtrace.options import MetagradOptions
    from gradtrace.replay import load_run, metagradients
    from gradtrace.replay.examples import load_examples
    from gradtrace.replay.hf import run_loss
    from gradtrace.score import Scores

    out = fresh / "scores"
    text = flat(invoke(runner, "metagrad", recorded, ws.queries, "--out", out, "--start-step", 2,
                       "--no-progress").output)
    assert "each over steps 2..3 (2 of 4: --start-step 2 truncates the pass" in text
    saved = Scores.load(out)
    assert saved.meta["metagradients"]["options"]["start_step"] == 2
    full, data = _api_scores(recorded, ws.queries)
    config = transformers.AutoConfig.from_pretrained(recorded / "model")
    config._attn_implementation = "eager"
    query_loss = lambda forward, q: run_loss(recorded)(forward, q)[0].sum()
    import numpy as np

    queries = []
    for i in range(data.num_examples):
        row = {k: v for k, v in data.rows(np.array([i])).items() if k != "id"}
        row.setdefault("labels", row["input_ids"].clone())
        queries.append(row)
    api = metagradients(load_run(recorded), transformers.AutoModelForCausalLM.from_config(config), run_loss(recorded),
                        load_examples(recorded), queries, query_loss, options=MetagradOptions(start_step=2))
    torch.testing.assert_close(saved.matrix, api.scores, rtol=1e-5, atol=0)
    assert not torch.allclose(api.scores, full.scores, rtol=1e-2)  # the first two steps are left out
    line = error_line(invoke(runner, "metagrad", recorded, ws.queries, "--out", fresh / "b", "--start-step", 4,
                             "--no-progress", code=2))
    assert "--start-step 4: " in line and "records 4 optimizer step(s)" in line and not (fresh / "b").exists()


def test_a_truncated_pass_replays_from_the_state_the_trainer_run_kept(ws, runner, fresh):
    """record_trainer(keep_states=2): the plan says where the forward replay starts, and the scores are those of a
    replay from the first step (the same run with its states ignored)."""
    from gradtrace.options import MetagradOptions
    from gradtrace.replay import load_run, metagradients
    from gradtrace.replay.examples import load_examples
    from gradtrace.replay.hf import run_loss
    from gradtrace.score import Scores

    run_dir = _trainer_run(ws, fresh / "kept", keep_states=2)
    assert sorted(load_run(run_dir).states) == [2]
    out = fresh / "scores"
    text = flat(invoke(runner, "metagrad", run_dir, ws.queries, "--out", out, "--start-step", 3,
                       "--no-progress").output)
    assert "Forward replay from the state the run recorded before step 2 (keep_states): 2 of 4 steps." in text
    assert "Time: (T - S) x t_step for the forward replay + (T - K) x 1 pass(es)" in text
    saved = Scores.load(out)
    _, data = _api_scores(run_dir, ws.queries)
    import numpy as np

    queries = []
    for i in range(data.num_examples):
        row = {k: v for k, v in data.rows(np.array([i])).items() if k != "id"}
        row.setdefault("labels", row["input_ids"].clone())
        queries.append(row)
    config = transformers.AutoConfig.from_pretrained(run_dir / "model")
    config._attn_implementation = "eager"
    run = load_run(run_dir)
    run.states = {}  # replayed from the initial weights
    loss = run_loss(run_dir)
    api = metagradients(run, transformers.AutoModelForCausalLM.from_config(config), loss, load_examples(run_dir),
                        queries, lambda forward, q: loss(forward, q)[0].sum(), options=MetagradOptions(start_step=3))
    assert api.replayed_from == 0
    torch.testing.assert_close(saved.matrix, api.scores, rtol=1e-5, atol=0)

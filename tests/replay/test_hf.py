"""A Hugging Face Trainer run recorded by record_trainer replays within its bound and yields metagradients."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from gradtrace.replay import load_run, metagradients, replay  # noqa: E402
from gradtrace.replay.hf import causal_lm_loss, record_trainer, run_loss  # noqa: E402


class _Rows(torch.utils.data.Dataset):
    def __init__(self, n: int = 8, length: int = 6) -> None:
        gen = torch.Generator().manual_seed(0)
        self.tokens = torch.randint(0, 40, (n, length), generator=gen)
        self.lengths = torch.randint(3, length + 1, (n,), generator=gen).tolist()

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict:
        ids = self.tokens[i].clone()
        labels = ids.clone()
        labels[self.lengths[i]:] = -100
        return {"input_ids": ids, "labels": labels}


def _collate(features: list) -> dict:
    return {k: torch.stack([f[k] for f in features]) for k in features[0]}


def _gpt2():
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, n_positions=8, vocab_size=40, bos_token_id=0,
                                     eos_token_id=0, resid_pdrop=0.0,
                                     embd_pdrop=0.0, attn_pdrop=0.0)
    config._attn_implementation = "eager"  # the CPU sdpa kernel has no double backward
    return transformers.GPT2LMHeadModel(config)


@pytest.mark.parametrize("optim", ["adamw_torch", "adamw_torch_fused"])
def test_a_trainer_run_replays_and_differentiates(tmp_path, optim):
    data = _Rows()
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=2, gradient_accumulation_steps=2,
        num_train_epochs=2, learning_rate=5e-3, weight_decay=0.1, lr_scheduler_type="cosine", warmup_steps=1,
        max_grad_norm=1.0, optim=optim, use_cpu=True, report_to="none", save_strategy="no", logging_strategy="no",
        remove_unused_columns=False, dataloader_num_workers=0, seed=0, disable_tqdm=True)
    model = _gpt2()
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data, data_collator=_collate)
    record_trainer(trainer, tmp_path / "run")
    trainer.train()
    run = load_run(tmp_path / "run")
    assert len(run.steps) == 4 and all(len(s.micro_batches) == 2 for s in run.steps)
    assert len(run.optimizer.groups) == 2  # the Trainer's decay / no-decay groups
    assert run.reduction.num_items_in_batch
    batches = lambda ids: _collate([data[i] for i in ids])
    loss = run_loss(tmp_path / "run")  # causal_lm_loss counting the labels as this Trainer did
    result = replay(run, _gpt2(), loss, batches)
    print(f"{optim}: replay difference {result.difference:.2e}")
    assert result.difference <= 1e-5
    query = lambda forward, q: (lambda s, c: s.sum() / c.sum())(*causal_lm_loss(forward, q))
    got = metagradients(run, _gpt2(), loss, batches, [batches([0]), batches([5])], query)
    assert got.scores.shape == (2, 8) and torch.isfinite(got.scores).all()
    assert sorted(got.ids) == list(range(8))


def _loss64(forward, batch):
    """``causal_lm_loss`` without the float32 cast: per-example summed token losses and counts, in float64."""
    logits = forward(input_ids=batch["input_ids"]).logits[:, :-1]
    labels = batch["labels"][:, 1:]
    tokens = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                               ignore_index=-100, reduction="none").view(labels.shape)
    return tokens.sum(-1), (labels != -100).sum(-1)


def test_metagradients_through_gpt2_match_finite_differences(tmp_path):
    from gradtrace.replay import Reduction, RunRecorder

    data = _Rows()
    batches = lambda ids: _collate([data[i] for i in ids])
    model = _gpt2().double()
    opt = torch.optim.AdamW(model.parameters(), lr=5e-3, weight_decay=0.1)
    reduction = Reduction("token_mean", num_items_in_batch=True, divide_by_accumulation=False)
    rec = RunRecorder(tmp_path / "run", model, opt, grad_clip=1.0, accumulation=2, reduction=reduction)
    order = [[[0, 1], [2, 3]], [[4, 5], [6, 7]], [[7, 2], [0, 5]]]
    for micro in order:
        outs = [_loss64(model, batches(ids)) for ids in micro]
        total = sum(c.sum() for _, c in outs)
        for losses, _ in outs:
            (losses.sum() / total).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        rec.step(micro)
    rec.finish(model)
    run = load_run(tmp_path / "run")
    assert replay(run, _gpt2().double(), _loss64, batches).difference == 0.0
    query = lambda forward, q: (lambda s, c: s.sum() / c.sum())(*_loss64(forward, q))
    queries = [batches([1]), batches([6])]
    got = metagradients(run, _gpt2().double(), _loss64, batches, queries, query, train_ids=list(range(8)))
    # Adam's first steps are m / sqrt(v) ~ sign(g) for small gradients: the run is strongly curved in w, and the
    # central difference converges as h^2 (2.5e-4 at h = 1e-4, 2.5e-6 at 1e-5, 2.7e-8 at 1e-6), so h = 1e-6 here
    h, fd = 1e-6, []
    for i in (0, 3, 7):
        pair = []
        for sign in (1, -1):
            state = replay(run, _gpt2().double(), _loss64, batches, weights={i: 1 + sign * h}).state
            tensors = {**dict(model.named_buffers()), **state.params}
            forward = lambda tensors=tensors, **kw: torch.func.functional_call(model, tensors, (), kw)
            pair.append(torch.stack([query(forward, q) for q in queries]).detach())
        fd.append((pair[0] - pair[1]) / (2 * h))
    fd = torch.stack(fd, 1)
    assert ((-got.scores[:, [0, 3, 7]] - fd).norm() / fd.norm()).item() <= 1e-5


class _Ragged(torch.utils.data.Dataset):
    """Rows of 3..7 tokens, unpadded: the collator pads them."""

    def __init__(self, n: int = 8) -> None:
        gen = torch.Generator().manual_seed(1)
        self.rows = [torch.randint(1, 40, (int(torch.randint(3, 8, (1,), generator=gen)),), generator=gen)
                     for _ in range(n)]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.rows[i].clone()}


def _padding_collator(side: str):
    """Pads to the longest row (pad 0, mask 0, labels -100), on ``side``, as DataCollatorForLanguageModeling."""

    def collate(features: list) -> dict:
        width = max(len(f["input_ids"]) for f in features)
        ids = torch.zeros(len(features), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for b, f in enumerate(features):
            row = f["input_ids"]
            cut = slice(0, len(row)) if side == "right" else slice(width - len(row), width)
            ids[b, cut], mask[b, cut] = row, 1
        return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}

    return collate


@pytest.mark.parametrize("side", ["right", "left"])
def test_a_recorded_trainer_run_is_self_contained(tmp_path, side):
    """Without clipping (which hides a gradient off by a constant factor), from the run directory alone."""
    from gradtrace.replay.examples import load_examples

    data, collate = _Ragged(), _padding_collator(side)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=2, gradient_accumulation_steps=2,
        num_train_epochs=2, learning_rate=5e-3, weight_decay=0.1, lr_scheduler_type="cosine", warmup_steps=1,
        max_grad_norm=0.0, optim="adamw_torch", use_cpu=True, report_to="none", save_strategy="no",
        logging_strategy="no", remove_unused_columns=False, dataloader_num_workers=0, seed=0, disable_tqdm=True)
    trainer = transformers.Trainer(model=_gpt2(), args=args, train_dataset=data, data_collator=collate)
    received = []
    original = trainer.compute_loss

    def spy(model, inputs, *a, **kw):  # what the model receives (record_trainer's wrapper took the ids out)
        received.append({k: v.clone() for k, v in inputs.items()})
        return original(model, inputs, *a, **kw)

    trainer.compute_loss = spy
    record_trainer(trainer, tmp_path / "run")
    trainer.train()
    run = load_run(tmp_path / "run")
    micro = [list(m) for s in run.steps for m in s.micro_batches]
    assert len(micro) == len(received) == 8
    batches = load_examples(tmp_path / "run")
    for ids, got in zip(micro, received):
        rebuilt = batches(ids)
        assert rebuilt.keys() == got.keys()
        assert all(torch.equal(rebuilt[k], got[k]) and rebuilt[k].dtype == got[k].dtype for k in got)
    assert any((b["attention_mask"] == 0).any() for b in received)  # the batches were padded
    # the run from its directory alone: config, initial weights, examples
    config = transformers.AutoConfig.from_pretrained(tmp_path / "run" / "model")
    assert config.architectures == ["GPT2LMHeadModel"]
    config._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(config)
    result = replay(run, model, run_loss(tmp_path / "run"), batches)
    print(f"{side} padding: replay difference from the saved pieces {result.difference:.2e}")
    assert result.difference <= 1e-5
    # GPT-2's Trainer counts num_items_in_batch over every label (GPT2LMHeadModel has no causal-LM loss_type): the
    # shifted count scales every gradient by another factor, and the run does not replay
    assert json.loads((tmp_path / "run" / "trainer.json").read_text()) == {"label_counts": "all"}
    assert replay(run, model, causal_lm_loss, batches, tolerance=1.0).difference > 1e-4


def test_record_trainer_refuses_batches_it_cannot_save(tmp_path):
    from gradtrace.replay import ReplayError
    from gradtrace.replay.examples import ExampleRecorder

    rec = ExampleRecorder()
    with pytest.raises(ReplayError, match="neither right- nor left-padding"):
        rec.add([0, 1], {"input_ids": torch.ones(2, 3, dtype=torch.long),
                         "attention_mask": torch.tensor([[1, 0, 1], [1, 1, 1]])})
    with pytest.raises(ReplayError, match="only \\[B\\] and \\[B, T\\]"):
        rec.add([0], {"pixel_values": torch.zeros(1, 3, 4, 4)})
    rec.add([0], {"input_ids": torch.tensor([[5, 6]])})
    with pytest.raises(ReplayError, match="other values at another step"):
        rec.add([0], {"input_ids": torch.tensor([[5, 7]])})

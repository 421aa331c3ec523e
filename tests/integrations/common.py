"""Shared pieces of the integration tests: a character tokenizer, data, and brute-force references."""

from __future__ import annotations

import random
from collections.abc import Callable

import torch
from transformers import TrainerCallback, TrainingArguments

from gradtrace.common.modules import canonical_param_names, unwrap
from gradtrace.projection.logra import Projector
from tests import tiny

CHARS = "abcdefghijklmnopqrstuvwxyz .,?!'"  # 32 characters + <pad> + <eos>: fits tiny.VOCAB


def char_tokenizer():
    """A character-level ``PreTrainedTokenizerFast`` with 34 tokens (no download)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, **{c: i + 2 for i, c in enumerate(CHARS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")


def lm_rows(count: int, seed: int = 0, low: int = 4, high: int = 11) -> list[dict]:
    """Token sequences of random lengths: ``[{"id", "input_ids"}]``."""
    rng = random.Random(seed)
    rows = []
    for i in range(count):
        length = rng.randint(low, high)
        rows.append({"id": f"doc-{i}", "input_ids": [rng.randrange(2, tiny.VOCAB) for _ in range(length)]})
    return rows


def pad_collate(features: list[dict]) -> dict:
    """Right-pads ``input_ids`` (and ``labels``, default: a copy of the inputs) into tensors."""
    width = max(len(f["input_ids"]) for f in features)
    ids = torch.zeros(len(features), width, dtype=torch.long)
    mask = torch.zeros(len(features), width, dtype=torch.long)
    labels = torch.full((len(features), width), -100, dtype=torch.long)
    for row, f in enumerate(features):
        n = len(f["input_ids"])
        ids[row, :n] = torch.as_tensor(f["input_ids"])
        mask[row, :n] = 1
        labels[row, :n] = torch.as_tensor(f.get("labels", f["input_ids"]))
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def training_args(out: str, **overrides) -> TrainingArguments:
    settings = dict(per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=3, learning_rate=5e-2,
                    lr_scheduler_type="linear", report_to=[], use_cpu=True, save_strategy="no",
                    logging_strategy="no", disable_tqdm=True, seed=0, dataloader_num_workers=0)
    settings.update(overrides)
    return TrainingArguments(out, **settings)


class WeightRecorder(TrainerCallback):
    """Keeps the model's state at the start of every optimizer step: ``states[global_step]``."""

    def __init__(self) -> None:
        self.states: dict[int, dict[str, torch.Tensor]] = {}

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        self.states[state.global_step] = {k: v.detach().clone() for k, v in model.state_dict().items()}


def causal_loss(model, example: dict) -> torch.Tensor:
    """Sum over the example's target tokens of the next-token loss (labels default to the inputs)."""
    ids = torch.as_tensor(example["input_ids"]).unsqueeze(0)
    labels = torch.as_tensor(example.get("labels", example["input_ids"])).unsqueeze(0)
    return tiny.lm_example_loss(model(input_ids=ids).logits, labels)[0]


def reference_rows(model, store, states: dict, examples: dict, loss_fn: Callable, projection=None,
                   autocast: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Brute force for every row of ``store``: the gradient of the row's example's own loss at the weights of
    the row's step, flattened (and projected) in the store's parameter order. Returns ``(got, want)``.

    Runs on ``model`` itself (TRL binds its patched forward to the model object, so a deep copy would still
    run the original) and puts its final weights back afterwards."""
    work = model
    final = {k: v.detach().clone() for k, v in work.state_dict().items()}
    work.train()
    names = canonical_param_names(unwrap(work))
    params = {names[id(p)]: p for p in unwrap(work).parameters() if id(p) in names}
    projector = Projector(projection) if projection is not None else None
    examples_field = store.field("example")
    steps = store.field("step")
    want = []
    for row, ident in enumerate(store.ids):
        example_id = examples_field[row] if examples_field[row] is not None else ident
        work.load_state_dict(states[steps[row]])
        work.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=autocast, enabled=autocast is not None):
            loss = loss_fn(work, examples[example_id])
        loss.backward()
        parts = []
        for name, _dim in store.spec.params:
            grad = params[name].grad
            grad = torch.zeros_like(params[name]) if grad is None else grad.float()
            parts.append(projector.project_full(name, grad[None], tuple(grad.shape))[0] if projector is not None
                         else grad.reshape(-1))
        want.append(torch.cat(parts))
    work.load_state_dict(final)
    work.zero_grad(set_to_none=True)
    return store.read(0, len(store)), torch.stack(want)


def assert_rows_close(store, got: torch.Tensor, want: torch.Tensor, rtol: float = 1e-4) -> None:
    """Per row and parameter: max abs error within ``rtol`` of the reference's largest entry."""
    assert got.shape == want.shape, (tuple(got.shape), tuple(want.shape))
    for name, (start, stop) in store.spec.offsets().items():
        g, w = got[:, start:stop], want[:, start:stop]
        scale = w.abs().amax(dim=1).clamp(min=1e-8)
        err = (g - w).abs().amax(dim=1)
        bad = (err > rtol * scale + 1e-7).nonzero().flatten().tolist()
        assert not bad, f"{name}: rows {[store.ids[i] for i in bad][:4]} err {err[bad].tolist()[:4]} " \
                        f"ref max {scale[bad].tolist()[:4]}"

"""DPO preference pairs: each pair's gradient is the gradient of TRL's own DPO loss for that pair alone.

The reference for every pair runs ``trl.DPOTrainer._compute_loss`` on a batch of that one pair (TRL's collator on
its tokenized features, the trainer's reference model or precomputed reference log-probabilities, at the weights
of the step), one backward per pair. gradtrace's side is :func:`gradtrace.collect` with
:class:`gradtrace.loss.preference.DPOLoss` over :func:`gradtrace.data.load_preference` (after training), and
:class:`~gradtrace.integrations.hf.GradtraceCallback` inside ``DPOTrainer`` (during training).
"""

from __future__ import annotations

import copy

import pytest

pytest.importorskip("trl")

import torch
from datasets import Dataset
from torch import Tensor
from trl import DPOConfig, DPOTrainer

import gradtrace
from gradtrace.common.modules import canonical_param_names, unwrap
from gradtrace.data import DataError, load_preference
from gradtrace.integrations.hf import GradtraceCallback
from gradtrace.loss.preference import DPO, DPOLoss
from tests import tiny
from tests.integrations.common import WeightRecorder, assert_rows_close, char_tokenizer

PAIRS = [("say hi ", "hello there", "go away"), ("count ", "one two", "three"), ("name? ", "bob", "alice in"),
         ("color? ", "red", "blue sky"), ("where? ", "here", "there or far"), ("why? ", "because", "no"),
         ("when? ", "now", "later, maybe"), ("who? ", "me", "nobody at all")]
RECORDS = [{"id": f"p{i}", "prompt": p, "chosen": c, "rejected": r} for i, (p, c, r) in enumerate(PAIRS)]


def _models(seed: int = 0):
    """A tiny tied GPT-2 policy and its reference (the policy before DPO, perturbed so that log-ratios differ)."""
    torch.manual_seed(seed)
    reference = tiny.gpt2(tied=True, pad_token_id=0)
    policy = copy.deepcopy(reference)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return policy, reference


def _config(tmp_path, **overrides) -> DPOConfig:
    settings = dict(per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=2, learning_rate=5e-2,
                    report_to=[], use_cpu=True, save_strategy="no", logging_strategy="no", disable_tqdm=True, seed=0,
                    bf16=False, beta=0.2)
    settings.update(overrides)
    return DPOConfig(str(tmp_path / "out"), **settings)


def _trainer(tmp_path, records=RECORDS, callbacks=(), tokenizer=None, **overrides):
    policy, reference = _models()
    return DPOTrainer(model=policy, ref_model=reference, args=_config(tmp_path, **overrides),
                      train_dataset=Dataset.from_list(records), processing_class=tokenizer or char_tokenizer(),
                      callbacks=list(callbacks))


def _params(model) -> dict[str, torch.nn.Parameter]:
    names = canonical_param_names(unwrap(model))
    return {names[id(p)]: p for p in unwrap(model).parameters() if id(p) in names}


def _trl_rows(trainer, store, ids: list[str], states: dict | None = None, steps: list[int] | None = None) -> Tensor:
    """One backward per pair of TRL's ``_compute_loss`` on a batch of that pair alone, in the store's layout."""
    model = trainer.model
    final = {k: v.detach().clone() for k, v in model.state_dict().items()}
    model.train()
    params = _params(model)
    features = {row["id"]: row for row in trainer.train_dataset}
    keys = ["prompt_ids", "chosen_ids", "rejected_ids", "ref_chosen_logps", "ref_rejected_logps"]
    want = []
    for index, ident in enumerate(ids):
        if states is not None:
            model.load_state_dict(states[steps[index]])
        feature = {k: features[ident][k] for k in keys if k in features[ident]}
        model.zero_grad(set_to_none=True)
        trainer._compute_loss(model, trainer.data_collator([feature]), False).backward()
        want.append(torch.cat([(params[n].grad if params[n].grad is not None else torch.zeros_like(params[n]))
                               .reshape(-1).float() for n, _ in store.spec.params]))
    model.load_state_dict(final)
    model.zero_grad(set_to_none=True)
    return torch.stack(want)


LOSSES = {
    "sigmoid": dict(loss_type=["sigmoid"]),
    "ipo": dict(loss_type=["ipo"]),  # per-token averages of the log-ratios
    "hinge+robust": dict(loss_type=["hinge", "robust"], loss_weights=[0.7, 0.3], label_smoothing=0.1),
    "js_divergence": dict(loss_type=["sigmoid"], f_divergence_type="js_divergence"),
    "ld_alpha": dict(loss_type=["sigmoid"], ld_alpha=0.5),  # LD-DPO: tokens past the shorter completion count half
}


@pytest.mark.parametrize("case", list(LOSSES))
def test_collected_pair_gradients_equal_autograd_of_trls_dpo_loss(tmp_path, case):
    trainer = _trainer(tmp_path, **LOSSES[case])
    settings = DPO.of(trainer.args)
    data = load_preference(RECORDS, trainer.processing_class).with_reference(trainer.ref_model, settings)
    rows = gradtrace.collect(trainer.model, data, DPOLoss(settings))
    assert rows.ids == [r["id"] for r in RECORDS]
    want = _trl_rows(trainer, rows, rows.ids)
    assert_rows_close(rows, rows.read(0, len(rows)), want)
    assert float(want.abs().max()) > 0


def test_tokens_and_reference_logps_are_trls(tmp_path):
    """The pairs are tokenized as DPOTrainer tokenizes them, and the reference log-probabilities gradtrace computes
    equal the ones TRL precomputes (``precompute_ref_log_probs``)."""
    trainer = _trainer(tmp_path, precompute_ref_log_probs=True)
    trainer.get_train_dataloader()  # TRL precomputes the reference log-probabilities here
    data = load_preference(RECORDS, trainer.processing_class).with_reference(trainer.ref_model)
    for index, feature in enumerate(trainer.train_dataset):
        batch = data.rows(torch.tensor([index]).numpy())
        for side in ("chosen", "rejected"):
            ids = batch[f"{side}_input_ids"][0].tolist()
            labels = batch[f"{side}_labels"][0].tolist()
            assert ids == feature["prompt_ids"] + feature[f"{side}_ids"]
            assert labels == [-100] * len(feature["prompt_ids"]) + feature[f"{side}_ids"]
    precomputed = torch.tensor([[f["ref_chosen_logps"], f["ref_rejected_logps"]] for f in trainer.train_dataset])
    torch.testing.assert_close(torch.from_numpy(data.reference), precomputed.float(), rtol=1e-5, atol=1e-5)


def test_callback_rows_equal_trls_per_pair_loss_at_each_step(tmp_path):
    recorder = WeightRecorder()
    callback = GradtraceCallback(tmp_path / "store", ids="id", trajectory=True)
    trainer = _trainer(tmp_path, callbacks=[recorder, callback], loss_type=["sigmoid", "ipo"], loss_weights=[1.0, 0.5])
    trainer.train()
    store = callback.result()
    config = store.manifest["config"]["trainer"]
    assert config["trainer"] == "DPOTrainer" and config["loss"]["trainer_loss"] == "DPO"
    assert config["loss"]["loss_type"] == ["sigmoid", "ipo"] and config["loss"]["beta"] == pytest.approx(0.2)
    assert len(store) == 8  # 2 steps x 2 micro-batches x 2 pairs: one row per pair, not per chosen/rejected row
    examples = store.field("example")
    ids = [e if e is not None else i for e, i in zip(examples, store.ids)]
    want = _trl_rows(trainer, store, ids, recorder.states, store.field("step"))
    assert_rows_close(store, store.read(0, len(store)), want)


@pytest.mark.parametrize("precompute", [False, True])
def test_in_training_capture_equals_collection_afterwards(tmp_path, precompute):
    """With the weights held still (lr 0) a pair's row captured in DPOTrainer equals the one collected after
    training -- ids too: with ``ids=None`` both are the content hash of the pair's chosen then rejected tokens."""
    callback = GradtraceCallback(tmp_path / "store", ids=None)
    trainer = _trainer(tmp_path, callbacks=[callback], learning_rate=0.0, precompute_ref_log_probs=precompute,
                       max_steps=2)
    trainer.train()
    store = callback.result()
    assert len(store) == 8
    tokenizer = trainer.processing_class
    if precompute:  # TRL's columns: the reference log-probabilities come with the data
        columns = trainer.train_dataset.select_columns(["prompt", "chosen", "rejected", "ref_chosen_logps",
                                                        "ref_rejected_logps"])
        data = load_preference(columns, tokenizer)
        assert data.summary.reference == "data"
    else:
        data = load_preference([{k: v for k, v in r.items() if k != "id"} for r in RECORDS], tokenizer)
        data = data.with_reference(trainer.ref_model)
    after = gradtrace.collect(trainer.model, data, DPOLoss(DPO.of(trainer.args)))
    assert sorted(store.ids) == sorted(after.ids)
    order = after.index_of(store.ids)
    assert_rows_close(store, store.read(0, len(store)), after.read(0, len(after))[order])


@pytest.mark.parametrize("loss_type", ["aot", "sft"])
def test_batch_coupled_loss_types_are_refused(tmp_path, loss_type):
    callback = GradtraceCallback(tmp_path / "store")
    trainer = _trainer(tmp_path, callbacks=[callback], loss_type=[loss_type])
    with pytest.raises(ValueError, match="no gradient of its own"):
        trainer.train()
    with pytest.raises(ValueError, match="no gradient of its own"):
        DPO(loss_type=loss_type)


TEMPLATE = ("{% for m in messages %}{{ m['role'] }} {{ m['content'] }}. {% endfor %}"
            "{% if add_generation_prompt %}assistant {% endif %}")


def _chat_tokenizer():
    tokenizer = char_tokenizer()
    tokenizer.chat_template = TEMPLATE
    return tokenizer


@pytest.mark.parametrize("form", ["conversational", "implicit", "implicit conversational"])
def test_conversational_and_implicit_prompt_pairs_tokenize_as_trl(tmp_path, form):
    conversational = "conversational" in form
    records = []
    for p, c, r in PAIRS[:4]:
        if conversational:
            prompt = [{"role": "user", "content": p.strip()}]
            chosen, rejected = [{"role": "assistant", "content": c}], [{"role": "assistant", "content": r}]
        else:
            prompt, chosen, rejected = p, c, r
        if "implicit" in form:
            records.append({"chosen": prompt + chosen, "rejected": prompt + rejected})
        else:
            records.append({"prompt": prompt, "chosen": chosen, "rejected": rejected})
    tokenizer = _chat_tokenizer()
    trainer = _trainer(tmp_path, records=records, tokenizer=tokenizer)
    data = load_preference(records, tokenizer)
    assert data.summary.conversational == conversational and data.summary.implicit_prompt == ("implicit" in form)
    for index, feature in enumerate(trainer.train_dataset):
        batch = data.rows(torch.tensor([index]).numpy())
        for side in ("chosen", "rejected"):
            assert batch[f"{side}_input_ids"][0].tolist() == feature["prompt_ids"] + feature[f"{side}_ids"]
            assert batch[f"{side}_labels"][0].tolist() == [-100] * len(feature["prompt_ids"]) + feature[f"{side}_ids"]


def test_preference_data_read_as_fine_tuning_text_is_refused():
    with pytest.raises(DataError, match="preference data"):
        gradtrace.data.load(RECORDS, char_tokenizer())


def test_the_dpo_loss_needs_reference_logps():
    policy, _ = _models()
    data = load_preference(RECORDS, char_tokenizer())
    with pytest.raises(ValueError, match="reference model's log-probabilities"):
        gradtrace.collect(policy, data, DPOLoss())


def test_dpo_example_runs(tmp_path, capsys):
    from examples import trl_dpo

    result = trl_dpo.main(tmp_path, epochs=2, rank=8)
    store = result["store"]
    assert len(store) == 52 * 2 and store.complete  # each of the 52 pairs once per epoch (trajectory=True)
    out = capsys.readouterr().out
    assert "preference pair: 'tell me a drink :' -> 'zumbleberry tea'" in out and "response NLL" in out
    for ranked in result["ranked"].values():  # every pair ranked once (its steps' scores summed)
        assert sorted(ranked) == sorted(set(store.field("example")))

"""GradtraceCallback inside TRL's GRPOTrainer: one row per completion, the gradient of the trainer's loss for it.

The reference for every row runs TRL's own ``GRPOTrainer._compute_loss`` on that completion alone (its inputs,
advantages, old and reference log-probabilities as the trainer had them, at the weights of the row's step), one
backward per completion, and multiplies the loss by the factor that turns TRL's one-row normalisation into the
documented per-completion loss ``L_i = sum_t m[i, t] * l[i, t]`` (:mod:`gradtrace.integrations.trl_grpo`).
"""

from __future__ import annotations

import pytest

pytest.importorskip("trl")

import torch
from datasets import Dataset
from torch import Tensor
from trl import GRPOConfig, GRPOTrainer

import gradtrace
from gradtrace.common.modules import canonical_param_names, unwrap
from gradtrace.integrations.hf import GradtraceCallback
from gradtrace.integrations.trainer_ids import ID_KEY
from gradtrace.options import CaptureOptions, Loss
from gradtrace.projection.logra import Projector
from tests import tiny
from tests.integrations.common import WeightRecorder, assert_rows_close, char_tokenizer

PROMPTS = ["say hi ", "count to three ", "name? ", "where is it? ", "why? ", "when? ", "who? ", "a color "]


def reward_e(completions: list[str], **kwargs) -> list[float]:
    """A toy reward: the letters 'e' of the completion, plus a little for its length."""
    return [float(c.count("e")) + 0.3 * len(c) for c in completions]


def _grpo(tmp_path, callback, loss_type: str, **overrides):
    """Train a tiny tied GPT-2 with GRPO; returns the trainer, the weights at each step and every training
    ``compute_loss`` call's inputs (as the trainer had them, with the gradient accumulation steps)."""
    torch.manual_seed(0)
    tiny.gpt2(tied=True, pad_token_id=0).save_pretrained(tmp_path / "init")  # a path: TRL loads the reference from it
    from transformers import GPT2LMHeadModel

    model = GPT2LMHeadModel.from_pretrained(tmp_path / "init")
    data = Dataset.from_dict({"id": [f"q{i}" for i in range(len(PROMPTS))], "prompt": PROMPTS})
    settings = dict(per_device_train_batch_size=4, gradient_accumulation_steps=2, num_generations=2,
                    max_completion_length=5, max_steps=2, learning_rate=5e-2, report_to=[], use_cpu=True,
                    save_strategy="no", logging_strategy="no", disable_tqdm=True, seed=0, bf16=False,
                    loss_type=loss_type)  # TRL's gradient checkpointing stays on
    settings.update(overrides)
    recorder = WeightRecorder()
    trainer = GRPOTrainer(model=model, reward_funcs=reward_e, args=GRPOConfig(str(tmp_path / "out"), **settings),
                          train_dataset=data, processing_class=char_tokenizer(), callbacks=[recorder, callback])
    calls: list[dict] = []
    original = trainer.compute_loss

    def compute_loss(model, inputs, *args, **kwargs):
        if model.training and torch.is_grad_enabled():
            kept = {k: v.detach().clone() if isinstance(v, Tensor) else v for k, v in inputs.items()}
            calls.append({"step": trainer.state.global_step, "inputs": kept,
                          "accumulation": trainer.current_gradient_accumulation_steps})
        return original(model, inputs, *args, **kwargs)

    trainer.compute_loss = compute_loss  # the callback wraps it in turn: it sees the inputs the trainer passes
    trainer.train()
    return trainer, recorder.states, calls


def _per_completion_factor(trainer, inputs: dict, accumulation: int) -> Tensor:
    """TRL's loss of one completion alone times this is ``L_i = sum_t m * l`` (the documented per-completion loss)."""
    tokens = inputs["completion_mask"].sum().clamp(min=1).float()
    kind = trainer.loss_type
    if kind in ("grpo", "sapo", "bnpo"):  # (sum / tokens) / A for one row
        return accumulation * tokens
    if kind == "dr_grpo":
        return torch.tensor(float(accumulation * trainer.max_completion_length))
    if kind == "luspo":
        return torch.tensor(float(accumulation))
    num_items = inputs["num_items_in_batch"].clamp(min=1).float()  # dapo, cispo, vespo
    return num_items / trainer.accelerator.num_processes * accumulation / trainer.args.steps_per_generation


def _locate(calls: list[dict]) -> dict[tuple[str, int], tuple[dict, int]]:
    """``(completion id, step) -> (the compute_loss call, its row)``."""
    found = {}
    for call in calls:
        for row, ident in enumerate(call["inputs"][ID_KEY]):
            found[(ident, call["step"])] = (call, row)
    return found


def _brute_force(trainer, store, states, calls, mean: bool = False) -> Tensor:
    """One backward per stored row of TRL's own loss of that completion alone, flattened in the store's order."""
    model = trainer.model
    final = {k: v.detach().clone() for k, v in model.state_dict().items()}
    model.train()
    names = canonical_param_names(unwrap(model))
    params = {names[id(p)]: p for p in unwrap(model).parameters() if id(p) in names}
    located = _locate(calls)
    examples, steps = store.field("example"), store.field("step")
    want = []
    for index, ident in enumerate(store.ids):
        example = examples[index] if examples[index] is not None else ident
        call, row = located[(example, steps[index])]
        one = {k: (v[row:row + 1] if isinstance(v, Tensor) and v.dim() > 0 else v)
               for k, v in call["inputs"].items() if k != ID_KEY}
        model.load_state_dict(states[steps[index]])
        model.zero_grad(set_to_none=True)
        trainer.current_gradient_accumulation_steps = call["accumulation"]
        loss = trainer._compute_loss(model, one) * _per_completion_factor(trainer, one, call["accumulation"])
        if mean:
            loss = loss / one["completion_mask"].sum().clamp(min=1)
        loss.backward()
        want.append(torch.cat([(params[n].grad if params[n].grad is not None else torch.zeros_like(params[n]))
                               .reshape(-1).float() for n, _ in store.spec.params]))
    model.load_state_dict(final)
    model.zero_grad(set_to_none=True)
    return torch.stack(want)


CASES = {
    # the per-completion token mean, with a KL term to the reference model, each rollout trained on twice
    # (num_iterations=2: the second pass has ratios != 1 against the stored old log-probabilities)
    "grpo": dict(beta=0.1, num_iterations=2),
    # TRL's default: the generation batch's token count, generated for two optimizer steps at once
    "dapo": dict(steps_per_generation=4),
    # TRL scores log-probabilities at the sampling temperature: the unfused LM head divides the logits by it
    "bnpo": dict(beta=0.1, temperature=0.7),
    "dr_grpo": dict(),
    "luspo": dict(importance_sampling_level="sequence"),
}


@pytest.mark.parametrize("loss_type", list(CASES))
def test_grpo_rows_equal_trl_per_completion_loss(tmp_path, loss_type):
    callback = GradtraceCallback(tmp_path / "store", ids="id", trajectory=True)
    trainer, states, calls = _grpo(tmp_path, callback, loss_type, **CASES[loss_type])
    store = callback.result()
    config = store.manifest["config"]["trainer"]
    assert config["trainer"] == "GRPOTrainer" and config["fused_lm_head"] == "unfused"
    assert config["loss"]["loss_type"] == loss_type and config["loss"]["trainer_loss"] == "GRPO"
    assert len(store) == 16  # 2 steps x 2 micro-batches x 4 completions (num_iterations=2: each one used twice)
    names = canonical_param_names(unwrap(trainer.model))
    assert [n for n, _ in store.spec.params] == list(dict.fromkeys(names.values()))  # every parameter, tied once
    if loss_type in ("grpo", "dapo"):  # old log-probabilities from an earlier policy: ratios differ from 1
        assert all("old_per_token_logps" in c["inputs"] for c in calls)
    got, want = store.read(0, len(store)), _brute_force(trainer, store, states, calls)
    assert_rows_close(store, got, want)
    assert float(want.abs().max()) > 0 and torch.isfinite(got).all()


def test_grpo_example_loss_mean(tmp_path):
    """``Loss(example_loss="mean")``: the completion's token mean -- for ``grpo`` the trainer's own per-sequence
    term, and its scale ``B * A``."""
    callback = GradtraceCallback(tmp_path / "store", ids="id", loss=Loss(example_loss="mean"), trajectory=True)
    trainer, states, calls = _grpo(tmp_path, callback, "grpo", max_steps=1)
    store = callback.result()
    assert store.manifest["config"]["trainer"]["loss"]["per_completion"].startswith("mean")
    assert_rows_close(store, store.read(0, len(store)), _brute_force(trainer, store, states, calls, mean=True))


def test_grpo_ids_tie_completions_to_prompts(tmp_path):
    callback = GradtraceCallback(tmp_path / "store", ids="id")
    trainer, _, calls = _grpo(tmp_path, callback, "dapo", max_steps=2)
    store = callback.result()
    fields = {name: store.field(name) for name in ("prompt", "rollout", "group", "completion", "advantage")}
    assert len(store) == 16  # 2 rollouts (one per optimizer step) x 8 completions
    assert len(set(store.ids)) == len(store)
    tokenizer = trainer.processing_class
    located = _locate(calls)
    groups: dict[tuple, set] = {}
    for index, ident in enumerate(store.ids):
        prompt, rollout, group, k = (fields[n][index] for n in ("prompt", "rollout", "group", "completion"))
        assert ident == f"{prompt}/{rollout}/{group}.{k}"
        groups.setdefault((prompt, rollout, group), set()).add(k)
        call, row = located[(ident, store.field("step")[index])]
        inputs = call["inputs"]
        text = tokenizer.decode(inputs["prompt_ids"][row][inputs["prompt_mask"][row].bool()])
        assert text == PROMPTS[int(prompt[1:])]  # the id's prompt is the prompt the completion was generated for
        assert fields["advantage"][index] == pytest.approx(float(inputs["advantages"][row]), abs=1e-6)
    assert all(ks == {0, 1} for ks in groups.values())  # num_generations completions per prompt and rollout
    assert {r for _, r, _ in groups} == {"0", "1"}  # generated at steps 0 and 1
    # content hashes of the prompts' tokens when there is no id column
    callback = GradtraceCallback(tmp_path / "store2", ids=None)
    _grpo(tmp_path / "two", callback, "dapo", max_steps=1)
    hashed = callback.result().field("prompt")
    assert len(set(hashed)) == 4 and all(len(h) == 16 for h in hashed)


def test_scoring_a_query_against_rollouts_is_the_exact_dot_product(tmp_path):
    projection = gradtrace.LoGra(rank=2, vector_rank=2)
    capturing = CaptureOptions(projection=projection)
    callback = GradtraceCallback(tmp_path / "store", options=capturing)
    trainer, _, _ = _grpo(tmp_path, callback, "grpo", max_steps=1)
    store = callback.result()
    model = trainer.model
    tokenizer = trainer.processing_class
    # a query: the NLL of a response to a prompt (the prompt's tokens are inputs, not targets)
    prompt, response = tokenizer("say hi ")["input_ids"], tokenizer("hello there")["input_ids"]
    ids = torch.tensor([prompt + response])
    labels = torch.tensor([[-100] * len(prompt) + response])
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}
    queries = gradtrace.collect(model, [batch], options=capturing)
    scores = gradtrace.Attributor("grad_dot", store).score(queries)
    # brute force: autograd of the response's summed NLL at the final weights, projected like the store's rows
    model.zero_grad(set_to_none=True)
    tiny.lm_example_loss(model(input_ids=ids).logits, labels)[0].backward()
    names = canonical_param_names(unwrap(model))
    params = {names[id(p)]: p for p in unwrap(model).parameters() if id(p) in names}
    projector = Projector(projection)
    query = torch.cat([projector.project_full(n, params[n].grad.float()[None], tuple(params[n].shape))[0]
                       for n, _ in store.spec.params])
    model.zero_grad(set_to_none=True)
    exact = store.read(0, len(store)).double() @ query.double()
    assert scores.train_ids == store.ids and scores.matrix.shape == (1, len(store))
    torch.testing.assert_close(scores.matrix[0].double(), exact, rtol=1e-4, atol=1e-6 * float(exact.abs().max()))


def test_grpo_example_runs(tmp_path, capsys):
    from examples import trl_grpo

    result = trl_grpo.main(tmp_path, steps=1, generations=2, width=16, rank=2)
    store = result["store"]
    assert len(store) == 16 and store.complete  # 1 step x 2 micro-batches x 8 completions
    assert result["scores"].matrix.shape == (1, 16)
    out = capsys.readouterr().out
    assert "query-tree" in out and "(prompt, rollout) groups of [2] completions" in out


@pytest.mark.parametrize("case", ["entropy_bonus", "reduction"])
def test_grpo_refuses_what_has_no_per_completion_gradient(tmp_path, case):
    loss = Loss(reduction="sum") if case == "reduction" else None
    callback = GradtraceCallback(tmp_path / "store", loss=loss)
    overrides = {"entropy_coef": 0.01} if case == "entropy_bonus" else {}
    match = "entropy_coef=0" if case == "entropy_bonus" else "derived from its loss_type"
    with pytest.raises(ValueError, match=match):
        _grpo(tmp_path, callback, "grpo", **overrides)

"""The runnable examples, with tiny settings: they run, and what they store and print is what they claim."""

from __future__ import annotations

import pytest

from gradtrace.data.corpus import PLANTED

TINY = dict(docs=12, epochs=2, batch_size=4, width=32, rank=4)


def _check_scores(result, capsys, rows: int) -> None:
    store = result["store"]
    assert len(store) == rows and store.complete
    assert result["scores"].topk(3).ids and len(result["scores"].query_ids) == len(PLANTED)
    assert "recall@1" in capsys.readouterr().out


@pytest.mark.parametrize("peft", [False, True], ids=["full", "lora"])
def test_hf_trainer_example(tmp_path, capsys, peft):
    from examples import hf_trainer

    result = hf_trainer.main(tmp_path, peft=peft, **TINY)
    _check_scores(result, capsys, rows=12 + len(PLANTED))
    store = result["store"]
    assert set(store.ids) >= {p.id for p in PLANTED}
    assert set(store.field("epoch")) == {1}  # the last epoch only
    names = [n for n, _ in store.spec.params]
    assert all("lora_" in n for n in names) if peft else any(n.endswith("wte.weight") for n in names)
    assert store.manifest["config"]["trainer"]["check"]["loss_ratio"] == pytest.approx(1, abs=1e-4)


@pytest.mark.parametrize("peft", [False, True], ids=["full", "lora"])
def test_trl_sft_example(tmp_path, capsys, peft):
    pytest.importorskip("trl")
    from examples import trl_sft

    result = trl_sft.main(tmp_path, peft=peft, **TINY)
    _check_scores(result, capsys, rows=12 + len(PLANTED))
    config = result["store"].manifest["config"]["trainer"]
    assert config["trainer"] == "SFTTrainer" and config["check"]["loss_ratio"] == pytest.approx(1, abs=1e-4)
    assert config.get("fused_lm_head") == (None if peft else "unfused")


def test_plain_loop_example(tmp_path, capsys):
    from examples import plain_loop

    result = plain_loop.main(tmp_path, **TINY)
    _check_scores(result, capsys, rows=12 + len(PLANTED))
    assert result["store"].spec.dtype == "int8" and result["report"].ok


def test_olmo_core_example(tmp_path, capsys):
    """Runs where OLMo-core is installed (not in this project's pinned environment: see the example's docstring).
    Every stored row equals the brute-force gradient of its document's summed token loss at its step's weights."""
    from examples import olmo_core

    if not olmo_core.available():
        pytest.skip("ai2-olmo-core is not installed")
    import torch
    from olmo_core.train.callbacks import Callback

    class Weights(Callback):
        def __init__(self):
            super().__init__()
            self.states = {}

        def pre_step(self, batch):
            model = self.trainer.train_module.model
            self.states[self.trainer.global_step - 1] = {k: v.clone() for k, v in model.state_dict().items()}

    weights = Weights()
    result = olmo_core.main(tmp_path, docs=8, steps=3, batch_size=4, micro_batch=2, rank=None,
                            callbacks={"weights": weights})
    store, model = result["store"], result["model"]
    assert len(store) == 12 and set(store.field("step")) == {0, 1, 2}
    tokens = dict(zip([i for i, _ in result["corpus"]], result["tokens"]))
    params = dict(model.named_parameters())
    want = []
    for ident, step in zip(store.ids, store.field("step")):
        model.load_state_dict(weights.states[step])
        model.zero_grad(set_to_none=True)
        ids = torch.tensor(tokens[ident])[None]
        torch.nn.functional.cross_entropy(model(ids)[0, :-1], ids[0, 1:], reduction="sum").backward()
        want.append(torch.cat([params[name].grad.reshape(-1) for name, _ in store.spec.params]))
    got, want = store.read(0, len(store)), torch.stack(want)
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-5 * float(want.abs().max()))
    assert "store: 12 rows" in capsys.readouterr().out

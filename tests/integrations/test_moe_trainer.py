"""GradtraceCallback inside TRL's SFTTrainer on a fused-experts MoE model (Qwen3-MoE): experts and router captured."""

from __future__ import annotations

import pytest

pytest.importorskip("trl")

from gradtrace.integrations.hf import GradtraceCallback
from gradtrace.options import CaptureOptions
from tests.capture.test_experts import qwen3_moe
from tests.integrations.common import assert_rows_close, causal_loss, reference_rows
from tests.integrations.test_trl import _sft


def test_sft_moe_experts_and_router_equal_brute_force(tmp_path):
    """Without the load-balancing loss (router_aux_loss_coef=0): every row equals its example's own gradient, the
    experts' 3-D weights and the routers' included (the LM head through TRL's fused head, unfused)."""
    callback = GradtraceCallback(tmp_path / "store", ids="id")
    trainer, recorder, examples = _sft(tmp_path, qwen3_moe(), callback, router_aux_loss_coef=0.0)
    store = callback.result()
    names = [n for n, _ in store.spec.params]
    assert any(n.endswith("experts.gate_up_proj") for n in names) and any(n.endswith("mlp.gate.weight") for n in names)
    assert set(names) == {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    got, want = reference_rows(trainer.model, store, recorder.states, examples, causal_loss)
    assert_rows_close(store, got, want)


def test_sft_moe_with_load_balancing_loss_sums_to_the_batch_gradient(tmp_path):
    """With TRL's default load-balancing loss the router's rows carry each example's tokens' share of it (the batch's
    routing fractions held fixed); rows still sum to the batch gradient (checked every step by verify)."""
    callback = GradtraceCallback(tmp_path / "store", ids="id", options=CaptureOptions(verify=True))
    trainer, _, _ = _sft(tmp_path, qwen3_moe(), callback, router_aux_loss_coef=0.05)
    assert trainer.router_aux_loss_coef == 0.05 and trainer.aux_loss_enabled
    store = callback.result()
    assert len(store) == 8
    check = store.manifest["config"]["trainer"]["check"]
    assert check["loss_ratio"] == pytest.approx(1, abs=1e-5) and check["aux_loss"] > 0

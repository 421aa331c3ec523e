"""``gradtrace collect`` on a fused-experts MoE model directory (Qwen3-MoE): the experts and routers are in the store,
which equals the Python API's."""

from __future__ import annotations

import json

import torch

import gradtrace
from gradtrace.options import CaptureOptions
from tests.cli.conftest import invoke
from tests.cli.test_pipeline import _api_batches


def _moe_dir(ws, root):
    from transformers import AutoTokenizer, Qwen3MoeConfig, Qwen3MoeForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(str(ws.model), local_files_only=True)
    cfg = Qwen3MoeConfig(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, moe_intermediate_size=8,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=4, num_experts=4,
                         num_experts_per_tok=2, max_position_embeddings=48, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    path = root / "moe"
    Qwen3MoeForCausalLM(cfg).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_collect_moe_model_matches_python_api(ws, runner, fresh):
    from transformers import AutoModelForCausalLM

    model_dir = _moe_dir(ws, fresh)
    out = fresh / "store"
    result = invoke(runner, "collect", model_dir, ws.train, "--out", out, "--rank", 4, "--batch-size", 3,
                    "--no-progress")
    assert "Stored 24 new examples" in " ".join(result.output.split())
    stored = gradtrace.GradientStore.open(out)
    names = [n for n, _ in stored.spec.params]
    assert sum(n.endswith(("experts.gate_up_proj", "experts.down_proj")) for n in names) == 4
    assert sum(n.endswith("mlp.gate.weight") for n in names) == 2
    records = [json.loads(line) for line in ws.train.read_text().splitlines()]
    batches = _api_batches(ws, [r["text"] for r in records], [r["id"] for r in records], 3)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), local_files_only=True, dtype=torch.float32)
    expected = gradtrace.collect(model, batches, options=CaptureOptions(projection=gradtrace.LoGra(rank=4, seed=0)))
    assert stored.ids == expected.ids
    torch.testing.assert_close(stored.read(0, len(stored)), expected.vectors, rtol=1e-4, atol=1e-6)

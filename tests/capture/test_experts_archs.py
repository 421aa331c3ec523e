"""More of the pinned transformers' MoE architectures on the experts interface -- shared experts (Qwen2-MoE,
DeepSeek-V2/V3, GLM-4-MoE, Ernie-4.5-MoE), group-limited sigmoid routing with a score-correction bias (DeepSeek-V3,
GLM-4-MoE), OLMoE, GraniteMoE: every trainable parameter captured, per-example gradients equal brute force, and the
experts' hooks read their forward's values (nothing recomputed)."""

import pytest
import torch

from gradtrace.options import CaptureOptions
from tests import tiny
from tests.capture.test_exact import _lm_single_loss
from tests.capture.test_experts import _sharpen
from tests.capture.test_experts_forward import _batch, _run

_COMMON = dict(vocab_size=tiny.VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               max_position_embeddings=64)
_MLA = dict(q_lora_rank=None, kv_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=4, head_dim=4,
            num_key_value_heads=4)
ARCHS = {
    "qwen2_moe": ("Qwen2Moe", dict(intermediate_size=32, moe_intermediate_size=8, shared_expert_intermediate_size=8,
                                   num_experts=6, num_experts_per_tok=2)),
    "deepseek_v2": ("DeepseekV2", dict(intermediate_size=32, moe_intermediate_size=8, n_routed_experts=8,
                                       num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, **_MLA)),
    "deepseek_v3": ("DeepseekV3", dict(intermediate_size=32, moe_intermediate_size=8, n_routed_experts=8,
                                       num_experts_per_tok=2, n_shared_experts=1, n_group=2, topk_group=1,
                                       first_k_dense_replace=1, **_MLA)),
    "glm4_moe": ("Glm4Moe", dict(intermediate_size=32, moe_intermediate_size=8, n_routed_experts=8,
                                 num_experts_per_tok=2, n_shared_experts=1, n_group=2, topk_group=1,
                                 first_k_dense_replace=1, head_dim=4)),
    "ernie4_5_moe": ("Ernie4_5_Moe", dict(intermediate_size=32, moe_intermediate_size=8, moe_num_experts=6, moe_k=2,
                                          moe_num_shared_experts=1, moe_layer_start_index=0)),
    "olmoe": ("Olmoe", dict(intermediate_size=8, num_experts=6, num_experts_per_tok=2)),
    "granitemoe": ("GraniteMoe", dict(intermediate_size=8, num_local_experts=6, num_experts_per_tok=2)),
}


@pytest.mark.parametrize("arch", list(ARCHS))
def test_architecture_is_captured_exactly_from_its_forward(arch):
    import transformers

    prefix, settings = ARCHS[arch]
    config = getattr(transformers, f"{prefix}Config")(**{**_COMMON, **settings})
    torch.manual_seed(0)
    model = _sharpen(getattr(transformers, f"{prefix}ForCausalLM")(config).float())
    assert model.config._experts_implementation == "grouped_mm"
    got, calls = _run(model, options=CaptureOptions(verify=True))
    assert calls == {"_hidden": 0, "_gate": 0}
    ref = tiny.reference_grads(model, _batch()[0], _lm_single_loss)
    assert set(got) == set(ref), "every trainable parameter is captured"
    assert sum(name.endswith("experts.down_proj") for name in got) >= 1
    tiny.assert_grads_close(got, ref)

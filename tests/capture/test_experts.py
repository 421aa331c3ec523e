"""Fused MoE experts and routers (Qwen3-MoE, Mixtral, gpt-oss): per-example gradients equal brute force."""

import pytest
import torch
from torch import nn

import gradtrace
from gradtrace.capture.layers import ExpertsHandler, RouterHandler, find_handler
from gradtrace.capture.layers import experts as ex
from gradtrace.capture.layers import experts_ops as ops
from gradtrace.options import CaptureOptions, Loss
from gradtrace.projection.logra import Projector
from tests import tiny
from tests.capture.test_exact import _lm_batch, _lm_single_loss
from tests.capture.test_ids_packing import _packed


def _sharpen(model: nn.Module) -> nn.Module:
    """Larger expert and router weights than the default init, so routing and experts' gradients are not tiny."""
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 3 or ".gate.weight" in name or ".router." in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return model


def qwen3_moe():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(vocab_size=tiny.VOCAB, hidden_size=16, intermediate_size=32, moe_intermediate_size=8,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=4, num_experts=6,
                         num_experts_per_tok=2, max_position_embeddings=64, norm_topk_prob=True)
    return _sharpen(Qwen3MoeForCausalLM(cfg).float())


def mixtral():
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(vocab_size=tiny.VOCAB, hidden_size=16, intermediate_size=8, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=4, num_local_experts=5,
                        num_experts_per_tok=2, max_position_embeddings=64)
    return _sharpen(MixtralForCausalLM(cfg).float())


def gpt_oss():
    """gpt-oss: transposed experts with biases, interleaved clamped GLU, a router with a bias. Its attention's
    ``sinks`` are captured too (tests/capture/test_attention_sinks.py)."""
    from transformers import GptOssConfig, GptOssForCausalLM

    cfg = GptOssConfig(vocab_size=tiny.VOCAB, hidden_size=16, intermediate_size=8, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=4, num_local_experts=4,
                       num_experts_per_tok=2, max_position_embeddings=64, sliding_window=8)
    model = _sharpen(GptOssForCausalLM(cfg).float())
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("_bias") or name.endswith("router.bias"):
                p.normal_(0, 0.2)  # biases start at 0: make their gradients' layout matter
    return model


MODELS = {"qwen3_moe": qwen3_moe, "mixtral": mixtral, "gpt_oss": gpt_oss}


def _expert_params(model):
    return [n for n, p in model.named_parameters() if p.requires_grad and (p.dim() == 3 or n.endswith("proj_bias"))]


def _router_params(model):
    return [n for n, p in model.named_parameters()
            if p.requires_grad and isinstance(find_handler(model.get_submodule(n.rsplit(".", 1)[0])), type)
            and find_handler(model.get_submodule(n.rsplit(".", 1)[0])) is RouterHandler]


@pytest.mark.parametrize("arch", list(MODELS))
@pytest.mark.parametrize("pad_side", ["right", "left"])
def test_experts_and_router_match_loop(arch, pad_side):
    torch.manual_seed(0)
    model = MODELS[arch]()
    rows, ids, mask, labels, pos = _lm_batch([5, 9, 3, 7], pad_side)
    ref = tiny.reference_grads(model, rows, _lm_single_loss)
    with gradtrace.capture(model, options=CaptureOptions(verify=True)) as cap:
        out = model(input_ids=ids, attention_mask=mask, position_ids=pos)
        tiny.lm_example_loss(out.logits, labels).mean().backward()
    report = cap.report()
    assert report.ok, str(report)
    batch = cap.batches[0]
    assert set(batch.params) == set(tiny.trainable(model)), "every trainable parameter is captured"
    experts, routers = _expert_params(model), _router_params(model)
    assert len(experts) >= 4 and len(routers) >= 2
    kinds = {kind for _, kind, _ in report.layers}
    assert any(k.startswith("experts(") for k in kinds) and "router" in kinds
    tiny.assert_grads_close(batch.per_example_grads(), ref)
    # top-k routing: some expert receives no token of some example, and its gradient block is exactly zero
    down = next(n for n in experts if n.endswith("down_proj"))
    per_expert = ref[down].flatten(2).abs().sum(-1)  # [examples, experts]
    assert bool((per_expert == 0).any()) and bool((per_expert > 0).any())
    assert torch.equal(batch.per_example_grads()[down].flatten(2).abs().sum(-1) == 0, per_expert == 0)


@pytest.mark.parametrize("ranks", [(3, 2), (16, 8)], ids=["blocks", "grouped"])
@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
def test_logra_projects_each_expert_block(arch, ranks):
    """Projected rows equal each expert's block of the exact rows projected with the parameter's two matrices. Ranks
    3 x 2 sum the pairs' outer products by blocks (widths the grouped kernel refuses); 16 x 8 by one grouped product."""
    torch.manual_seed(1)
    model = MODELS[arch]()
    _, ids, mask, labels, pos = _lm_batch([6, 4, 8])
    spec = gradtrace.LoGra(rank=ranks[0], rank_cols=ranks[1], vector_rank=3, seed=5)

    def run(options):
        with gradtrace.capture(model, loss=Loss(reduction="sum"), options=options) as cap:
            out = model(input_ids=ids, attention_mask=mask, position_ids=pos)
            tiny.lm_example_loss(out.logits, labels).sum().backward()
        return cap.batches[0]

    exact = run(CaptureOptions()).per_example_grads()
    proj = run(CaptureOptions(projection=spec, verify=True))
    tokens = run(CaptureOptions(projection=gradtrace.LoGra(rank=ranks[0], rank_cols=ranks[1], vector_rank=3, seed=5,
                                                           keep_tokens=True)))
    projector = Projector(spec)
    handlers = {h.params[r]: h for h in gradtrace.capture(model).handlers for r in h.params
                if isinstance(h, ExpertsHandler)}
    assert handlers
    for name, handler in handlers.items():
        full = exact[name]
        want = handler.project_full(projector, name, full, tuple(full.shape[1:]))
        got = proj.params[name].flat()
        assert got.shape == want.shape, name
        assert torch.allclose(got, want, rtol=1e-4, atol=1e-5 * float(want.abs().max())), name
        # per-token rows (one term per routing slot) sum to the same rows
        assert torch.allclose(tokens.params[name].flat(), want, rtol=1e-4, atol=1e-5 * float(want.abs().max())), name


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_packed_rows_split_experts_per_document(arch):
    """(gpt-oss's eager attention does not keep packed documents apart, so its packed rows are not documents.)"""
    torch.manual_seed(2)
    model = MODELS[arch]()
    docs, ids, pos, labels, _ = _packed([[4, 6, 3], [7, 6]])
    ref = tiny.reference_grads(model, docs, _lm_single_loss)
    with gradtrace.capture(model, loss=Loss(reduction="sum"), options=CaptureOptions(packing=True, verify=True)) as cap:
        out = model(input_ids=ids, position_ids=pos, use_cache=False)
        tiny.lm_example_loss(out.logits, labels).sum().backward()
    batch = cap.batches[0]
    assert len(batch) == 5
    tiny.assert_grads_close(batch.per_example_grads(), ref, names=_expert_params(model) + _router_params(model))


def test_float64_experts_match_loop_tightly():
    """In float64 the experts' rule (recomputed pairs, the gate's vjp) equals autograd to round-off."""
    torch.manual_seed(3)
    model = qwen3_moe().double()
    model.config._experts_implementation = "eager"  # the grouped_mm kernel has no float64
    rows, ids, mask, labels, pos = _lm_batch([5, 8, 4])
    ref = tiny.reference_grads(model, rows, _lm_single_loss)
    with gradtrace.capture(model, loss=Loss(reduction="sum")) as cap:
        out = model(input_ids=ids, attention_mask=mask, position_ids=pos)
        tiny.lm_example_loss(out.logits, labels).sum().backward()
    got = cap.batches[0].per_example_grads(torch.float64)
    for name in _expert_params(model) + _router_params(model):
        err = (got[name] - ref[name]).abs().max() / ref[name].abs().max()
        assert err < 1e-10, (name, float(err))


@pytest.mark.parametrize("implementation", ["eager", "batched_mm", "grouped_mm"])
def test_every_experts_implementation_is_captured_alike(implementation):
    """The rule is the experts' math, not one kernel's: each of the interface's CPU implementations gives it."""
    torch.manual_seed(4)
    model = qwen3_moe()
    model.config._experts_implementation = implementation
    rows, ids, mask, labels, pos = _lm_batch([4, 7])
    ref = tiny.reference_grads(model, rows, _lm_single_loss)
    with gradtrace.capture(model, options=CaptureOptions(verify=True)) as cap:
        out = model(input_ids=ids, attention_mask=mask, position_ids=pos)
        tiny.lm_example_loss(out.logits, labels).mean().backward()
    assert cap.report().ok
    tiny.assert_grads_close(cap.batches[0].per_example_grads(), ref, names=_expert_params(model))


def _routing(rows, tokens, experts, k, seed):
    gen = torch.Generator().manual_seed(seed)
    index = torch.rand(rows, tokens, experts, generator=gen).argsort(-1)[..., :k]
    return ex.Routing(index, experts), index


@pytest.mark.parametrize("widths", [(16, 8), (3, 2)], ids=["grouped", "blocks"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_segment_outer_sums_equal_a_loop_over_rows_and_experts(widths, dtype):
    """Each (row, expert) group's sum of outer products (the grouped product, or blocks where the kernel refuses the
    widths or dtype) equals the loop over groups; experts without a pair of a row give exact zeros."""
    rows, tokens, experts, k = 3, 5, 6, 2
    routing, index = _routing(rows, tokens, experts, k, seed=7)
    segment, ends = routing.segments(rows)
    assert bool((segment[1:] >= segment[:-1]).all()) and int(ends[-1]) == rows * tokens * k
    gen = torch.Generator().manual_seed(8)
    r = torch.randn(rows * tokens * k, widths[0], generator=gen).to(dtype)
    c = torch.randn(rows * tokens * k, widths[1], generator=gen).to(dtype)
    got = ops.segment_outer_sums(r, c, segment, ends)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    assert got.dtype == acc and got.shape == (experts * rows, *widths)
    row_of = routing.token // tokens
    empty = 0
    for e in range(experts):
        for b in range(rows):
            mine = (routing.expert == e) & (row_of == b)
            want = r[mine].to(acc).t() @ c[mine].to(acc)
            assert torch.allclose(got[e * rows + b], want, rtol=1e-6, atol=1e-6), (e, b)
            empty += int(not bool(mine.any()))
    assert empty > 0, "some expert receives no pair of some row"


def test_segment_outer_sums_fall_back_to_blocks_alike(monkeypatch):
    """Without the grouped kernel the blocks give the same sums (a block smaller than the pairs: several blocks)."""
    routing, _ = _routing(4, 6, 5, 2, seed=9)
    segment, ends = routing.segments(4)
    gen = torch.Generator().manual_seed(10)
    r, c = torch.randn(48, 16, generator=gen), torch.randn(48, 8, generator=gen)
    grouped = ops.segment_outer_sums(r, c, segment, ends)
    monkeypatch.setattr(torch.nn.functional, "grouped_mm", None, raising=False)
    monkeypatch.setattr(ops, "_PAIR_BLOCK", 16 * 8 * 5)
    blocks = ops.segment_outer_sums(r, c, segment, ends)
    assert torch.allclose(grouped, blocks, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("projection", [None, gradtrace.LoGra(rank=16, rank_cols=8),
                                        gradtrace.LoGra(rank=16, rank_cols=8, keep_tokens=True)],
                         ids=["exact", "logra", "logra-tokens"])
def test_experts_hook_reads_nothing_back_to_the_host(projection, monkeypatch):
    """The experts' gradient hooks (the output's and the forward h's: per-token projections, grouped sums) make no
    host read (counted by ``bench/host_reads.py``), with biases (gpt-oss) and padding, on the device path
    (``CPU_FAST_PATH`` off)."""
    from gradtrace.capture import assemble
    from tests.capture.test_host_reads import _counter

    monkeypatch.setattr(assemble, "CPU_FAST_PATH", False)
    model = gpt_oss()
    _, ids, mask, labels, pos = _lm_batch([6, 4, 8])
    calls = []
    backward = ExpertsHandler.backward

    def counted(self, *args):
        with _counter()() as reads:
            out = backward(self, *args)
        calls.append(sum(n for (_, where), n in reads.sites.items() if "layers/experts.py" in where))
        return out

    on_grad = ex._Later.on_grad  # the part of the rule that runs at the forward's h (its gradient from autograd)

    def counted_later(self, grad):
        with _counter()() as reads:
            on_grad(self, grad)
        calls.append(sum(n for (_, where), n in reads.sites.items() if "layers/experts.py" in where))

    monkeypatch.setattr(ExpertsHandler, "backward", counted)
    monkeypatch.setattr(ex._Later, "on_grad", counted_later)
    with gradtrace.capture(model, loss=Loss(reduction="sum"), options=CaptureOptions(projection=projection)):
        out = model(input_ids=ids, attention_mask=mask, position_ids=pos)
        tiny.lm_example_loss(out.logits, labels).sum().backward()
    assert calls == [0, 0, 0, 0]  # two layers, each hook


def test_experts_forward_other_than_the_rule_is_reported():
    """A subclass whose forward computes something else (here: twice the experts' output) is not captured."""
    model = qwen3_moe()
    experts = model.model.layers[0].mlp.experts
    base = type(experts)

    class Doubled(base):
        def forward(self, hidden_states, top_k_index, top_k_weights):
            return 2 * base.forward(self, hidden_states, top_k_index, top_k_weights)

    experts.__class__ = Doubled
    with pytest.warns(UserWarning, match="cannot be captured"):
        cap = gradtrace.capture(model, options=CaptureOptions(partial=True))
        with cap:
            pass
    left_out = {u.module: u.reason for u in cap.report().unsupported}
    assert "model.layers.0.mlp.experts" in left_out
    assert "standard experts expression" in left_out["model.layers.0.mlp.experts"]
    assert "model.layers.1.mlp.experts" not in left_out


def test_router_whose_logits_are_not_its_routing_input_is_reported():
    """A router returning a detached copy of its logits: a hook on them would miss the routing path."""
    model = mixtral()
    router = model.model.layers[1].mlp.gate
    base = type(router)

    class Detached(base):
        def forward(self, hidden_states):
            logits, scores, index = base.forward(self, hidden_states)
            return logits.detach().clone().requires_grad_(), scores, index

    router.__class__ = Detached
    with pytest.warns(UserWarning, match="cannot be captured"):
        cap = gradtrace.capture(model, options=CaptureOptions(partial=True))
        with cap:
            pass
    left_out = {u.module: u.reason for u in cap.report().unsupported}
    assert "logits its routing is computed from" in left_out["model.layers.1.mlp.gate"]
    assert "model.layers.0.mlp.gate" not in left_out

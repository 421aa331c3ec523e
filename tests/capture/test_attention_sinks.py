"""gpt-oss's attention ``sinks`` (issue #31): per-example gradients equal one backward pass per example.

The rule, ``dL/ds_h = -sum_q p_s(h, q) sum_k p_k(h, q) dL/dp_k(h, q)``, is checked against brute force (float32 and
float64, padded both sides, a sliding-window layer), its per-query terms against the other form of the same rule
(``-p_s <dL/do, o>`` from ``o_proj``'s input and gradient), under LoGra, with a cast softmax (float64 sinks), under
activation checkpointing and with NaN in padding's gradient; attention implementations it does not hold for are
reported with the fix.
"""

from __future__ import annotations

import copy

import pytest
import torch

import gradtrace
from gradtrace.capture import assemble
from gradtrace.capture.coverage import CoverageError
from gradtrace.capture.layers import AttentionSinksHandler, find_handler
from gradtrace.options import CaptureOptions, Loss
from gradtrace.projection.logra import Projector
from tests import tiny
from tests.capture.test_exact import _lm_batch, _lm_single_loss

HEADS = 4


def gpt_oss(**config):
    """A tiny random gpt-oss (eager attention; layer 0 has a sliding window of 4) with sinks far from 0, so the
    sink's probability ranges from small to large across heads."""
    from transformers import GptOssConfig, GptOssForCausalLM

    cfg = GptOssConfig(vocab_size=tiny.VOCAB, hidden_size=16, intermediate_size=8, num_hidden_layers=2,
                       num_attention_heads=HEADS, num_key_value_heads=2, head_dim=4, num_local_experts=4,
                       num_experts_per_tok=2, max_position_embeddings=64, sliding_window=4, **config)
    cfg._experts_implementation = "eager"  # the grouped_mm kernel has no float64
    model = GptOssForCausalLM(cfg).float()
    gen = torch.Generator().manual_seed(31)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("sinks"):
                p.copy_(torch.tensor([-3.0, 0.0, 1.5, 4.0]) + 0.3 * torch.randn(p.shape, generator=gen))
    return model.eval()


def _sinks(model) -> list[str]:
    return [n for n, _ in model.named_parameters() if n.endswith("sinks")]


def _capture(model, ids, mask, labels, pos, options=None, loss=None):
    with gradtrace.capture(model, loss=loss, options=options or CaptureOptions()) as cap:
        out = model(input_ids=ids, attention_mask=mask, position_ids=pos)
        per_example = tiny.lm_example_loss(out.logits, labels)
        (per_example.sum() if loss is not None and loss.reduction == "sum" else per_example.mean()).backward()
    model.zero_grad(set_to_none=True)
    return cap


def _rel_err(got, ref) -> float:
    return float((got - ref).abs().max() / ref.abs().max())


@pytest.mark.parametrize("pad_side", ["right", "left"])
def test_sinks_match_loop_and_the_model_is_fully_covered(pad_side):
    torch.manual_seed(0)
    model = gpt_oss()
    rows, ids, mask, labels, pos = _lm_batch([5, 9, 3, 7], pad_side)
    ref = tiny.reference_grads(model, rows, _lm_single_loss)
    cap = _capture(model, ids, mask, labels, pos, CaptureOptions(verify=True))
    report = cap.report()
    assert report.ok, str(report)
    coverage = cap.coverage()
    assert coverage.share == 1.0 and not coverage.uncovered and "sinks" not in coverage.line()
    assert {kind for _, kind, _ in report.layers} >= {"attention-sinks", "linear", "router"}
    got = cap.batches[0].per_example_grads()
    assert set(got) == set(tiny.trainable(model))
    tiny.assert_grads_close(got, ref)  # every parameter, q/k/v/o of the attention included
    for name in _sinks(model):
        assert _rel_err(got[name], ref[name]) < 1e-4, name


def test_float64_sinks_match_loop_to_round_off():
    torch.manual_seed(1)
    model = gpt_oss().double()
    rows, ids, mask, labels, pos = _lm_batch([6, 9, 2, 8], "left")
    ref = tiny.reference_grads(model, rows, _lm_single_loss)
    cap = _capture(model, ids, mask, labels, pos, loss=Loss(reduction="sum"))
    got = cap.batches[0].per_example_grads(torch.float64)
    for name in _sinks(model):
        assert _rel_err(got[name], ref[name]) < 1e-10, name


def test_small_sink_probabilities_stay_exact_in_float32():
    """Sinks of -14 .. -6 (p_s from 2e-7 to 3e-3): p_s is read from the softmax, where ``1 - sum_k p_k`` in float32
    would be off by up to ~40% of it; each head's float32 gradient still equals the float64 brute force."""
    torch.manual_seed(6)
    model = gpt_oss()
    with torch.no_grad():
        for name in _sinks(model):
            model.get_parameter(name).copy_(torch.tensor([-14.0, -10.0, -8.0, -6.0]))
    rows, ids, mask, labels, pos = _lm_batch([5, 9, 3, 7], "left")
    ref = tiny.reference_grads(copy.deepcopy(model).double(), rows, _lm_single_loss)
    batch = _capture(model, ids, mask, labels, pos, loss=Loss(reduction="sum")).batches[0]
    got = batch.per_example_grads(torch.float64)
    for name in _sinks(model):
        per_head = (got[name] - ref[name]).abs().amax(0) / ref[name].abs().amax(0)  # [H]
        assert float(per_head.max()) < 1e-4, (name, per_head.tolist())


def _per_query_reference(model, row) -> dict[str, torch.Tensor]:
    """``[T, H]`` per query: ``-p_s <dL/do, o>`` from one example's pass (float64), ``o`` being ``o_proj``'s input,
    ``dL/do = dL/d(o_proj out) @ W_o`` and ``p_s = 1 - sum_k p_k`` of the returned attention probabilities."""
    kept, handles = {}, []
    for name, module in model.named_modules():
        if isinstance(find_handler(module), type) and find_handler(module) is AttentionSinksHandler:
            def pre(mod, args, name=name):
                kept[name] = {"o": args[0]}
                args[0].register_hook(lambda g, name=name: kept[name].__setitem__("g_o", g))

            def post(mod, args, output, name=name):
                kept[name]["p"] = output[1]

            handles += [module.o_proj.register_forward_pre_hook(pre), module.register_forward_hook(post)]
    try:
        _lm_single_loss(model, row).backward()
    finally:
        for h in handles:
            h.remove()
        model.zero_grad(set_to_none=True)
    out = {}
    for name, k in kept.items():
        o, g_o = (x.reshape(1, x.shape[1], HEADS, -1) for x in (k["o"].detach(), k["g_o"]))  # [1, T, H, hd]
        p_sink = (1 - k["p"].detach().sum(-1)).transpose(1, 2)  # [1, T, H]
        out[name + ".sinks"] = (-p_sink * (o * g_o).sum(-1))[0]
    return out


def test_per_query_terms_equal_the_output_form_of_the_rule():
    """keep_tokens: token ``t``'s term is query ``t``'s ``-p_s <dL/do, o>`` (computed from o_proj's side instead)."""
    torch.manual_seed(2)
    model = gpt_oss().double()
    lengths = [5, 8, 3]
    rows, ids, mask, labels, pos = _lm_batch(lengths, "right")
    cap = _capture(model, ids, mask, labels, pos, CaptureOptions(keep_tokens=True), loss=Loss(reduction="sum"))
    batch = cap.batches[0]
    for i, row in enumerate(rows):
        want = _per_query_reference(model, row)
        for name, per_query in want.items():
            (term,) = batch.params[name].terms
            tokens = term.token_materialize(torch.float64)[i]  # [T, H]
            n = lengths[i]
            assert _rel_err(tokens[:n], per_query) < 1e-10, name
            assert float(tokens[n:].abs().sum()) == 0.0  # padding queries are no example's


@pytest.mark.parametrize("keep_tokens", [False, True])
def test_logra_projects_the_exact_rows(keep_tokens):
    torch.manual_seed(3)
    model = gpt_oss()
    _, ids, mask, labels, pos = _lm_batch([6, 4, 8], "left")
    spec = gradtrace.LoGra(rank=3, vector_rank=3, seed=5, keep_tokens=keep_tokens)
    exact = _capture(model, ids, mask, labels, pos, loss=Loss(reduction="sum")).batches[0].per_example_grads()
    proj = _capture(model, ids, mask, labels, pos, CaptureOptions(projection=spec, verify=True),
                    loss=Loss(reduction="sum")).batches[0]
    projector = Projector(spec)
    for name in _sinks(model):
        want = projector.project_full(name, exact[name], (HEADS,))
        got = proj.params[name].flat()
        assert got.shape == want.shape == (3, 3), name
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5 * float(want.abs().max()))


def test_cast_softmax_and_checkpointing():
    """float64 sinks in a float32 model: the softmax runs in float64 and the returned weights are a float32 copy of
    its slice (read from the softmax's saved output). Activation checkpointing (non-reentrant) on the plain model."""
    torch.manual_seed(4)
    model = gpt_oss()
    for layer in model.model.layers:
        layer.self_attn.sinks.data = layer.self_attn.sinks.data.double()
    rows, ids, mask, labels, pos = _lm_batch([5, 9, 3], "right")
    ref = tiny.reference_grads(model, rows, _lm_single_loss)
    got = _capture(model, ids, mask, labels, pos, CaptureOptions(verify=True)).batches[0].per_example_grads()
    tiny.assert_grads_close(got, ref)
    # under checkpointing the cast copy's softmax output cannot be read in the forward: the call is reported
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    with pytest.raises(CoverageError, match="a dtype cast of the softmax's"):
        _capture(model, ids, mask, labels, pos)

    plain = gpt_oss().train()
    plain.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ref = tiny.reference_grads(plain, rows, _lm_single_loss)
    got = _capture(plain, ids, mask, labels, pos, CaptureOptions(verify=True)).batches[0].per_example_grads()
    tiny.assert_grads_close(got, ref)


class _NanInPadding(torch.autograd.Function):
    """Adds nothing to the loss; puts NaN into the attention weights' gradient at padded queries."""

    @staticmethod
    def forward(ctx, weights, outside):
        ctx.shape, ctx.outside = weights.shape, outside
        return weights.new_zeros(())

    @staticmethod
    def backward(ctx, grad):
        nan = torch.zeros(ctx.shape, dtype=grad.dtype)
        return nan.masked_fill(ctx.outside[:, None, :, None], float("nan")), None


@pytest.mark.parametrize("lengths", [[5, 9, 3, 7], [4, 2, 3]])  # T != heads, T == heads
@pytest.mark.parametrize("fast_path", [True, False])
def test_isolate_padding_cleans_queries_of_the_attention_weights(lengths, fast_path, monkeypatch):
    """isolate_padding finds positions along the queries dim of the weights ([B, H, Q, K]), not dim 1 (heads)."""
    monkeypatch.setattr(assemble, "CPU_FAST_PATH", fast_path)
    torch.manual_seed(5)
    model = gpt_oss()
    rows, ids, mask, labels, pos = _lm_batch(lengths, "right")
    ref = tiny.reference_grads(model, rows, _lm_single_loss)
    with gradtrace.capture(model, options=CaptureOptions(isolate_padding=True)) as cap:
        out = model(input_ids=ids, attention_mask=mask, position_ids=pos, output_attentions=True)
        injected = sum(_NanInPadding.apply(w, mask == 0) for w in out.attentions)
        (tiny.lm_example_loss(out.logits, labels).mean() + injected).backward()
    batch = cap.batches[0]
    assert not bool(batch.nonfinite.any())
    tiny.assert_grads_close(batch.per_example_grads(), ref)


def test_attention_without_probabilities_is_reported_with_the_fix():
    model = gpt_oss()
    model.set_attn_implementation("flex_attention")  # transformers refuses sdpa for gpt-oss; flex returns no weights
    with pytest.raises(CoverageError) as raised:
        gradtrace.capture(model)
    message = str(raised.value)
    assert "sinks" in message and 'attn_implementation="eager"' in message and "*.self_attn" in message
    cap = gradtrace.capture(model, options=CaptureOptions(exclude=["*.self_attn"]))
    captured = {n for h in cap.handlers for n in h.params.values()}
    assert "model.layers.0.self_attn.o_proj.weight" in captured and not any(n.endswith("sinks") for n in captured)
    assert cap.coverage().uncovered == []


def test_attention_dropout_in_training_is_reported():
    model = gpt_oss(attention_dropout=0.1).train()
    cap = gradtrace.capture(model, options=CaptureOptions(partial=True))
    reasons = {u.module: u.reason for u in cap.selection.unsupported}
    assert "attention dropout" in reasons["model.layers.0.self_attn"]
    model.eval()
    assert not gradtrace.capture(model).selection.unsupported
    # switched to training after the capture was set up: each call is checked, and reported
    _, ids, mask, labels, pos = _lm_batch([5, 3])
    cap = gradtrace.capture(model)
    model.train()
    with pytest.raises(CoverageError, match="attention dropout is active"), cap:
        model(input_ids=ids, attention_mask=mask, position_ids=pos)


def test_sinks_computed_another_way_are_not_captured():
    """Granite-SWA's sinks scale the attention output after a plain softmax: the probe refuses the rule there."""
    from transformers import GraniteSWAConfig, GraniteSWAForCausalLM

    cfg = GraniteSWAConfig(vocab_size=tiny.VOCAB, hidden_size=16, intermediate_size=8, num_hidden_layers=1,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = GraniteSWAForCausalLM(cfg)
    model.set_attn_implementation("eager")
    attn = model.model.layers[0].self_attn
    handler = AttentionSinksHandler("model.layers.0.self_attn", attn, {"sinks": "model.layers.0.self_attn.sinks"})
    assert "does not compute the sinks" in handler.unsupported_reason()


def test_no_host_read_in_the_sinks_hooks(monkeypatch):
    """The graph reads (the softmax's slice and output) and the rule are device ops only (run on the device path)."""
    from tests.capture.test_host_reads import _counter

    monkeypatch.setattr(assemble, "CPU_FAST_PATH", False)
    model = gpt_oss()
    _, ids, mask, labels, pos = _lm_batch([5, 9, 3], "left")
    cap = gradtrace.capture(model, options=CaptureOptions(isolate_padding=True))  # the probe runs here, before
    with _counter()() as reads, cap:
        out = model(input_ids=ids, attention_mask=mask, position_ids=pos)
        tiny.lm_example_loss(out.logits, labels).mean().backward()
    assert cap.batches
    assert not [site for site in reads.sites if "attention_sinks" in site[1]], reads.sites

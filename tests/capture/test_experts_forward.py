"""The fused experts' hidden values read from their own forward (``grouped_mm``), not recomputed in the hook: the
same per-example gradients as brute force and as the recomputing path; anything other than the probed call is
recomputed; the probe runs on a copy of four experts."""

import pytest
import torch

import gradtrace
from gradtrace.capture.layers import ExpertsHandler
from gradtrace.options import CaptureOptions
from tests import tiny
from tests.capture.test_exact import _lm_batch, _lm_single_loss
from tests.capture.test_experts import MODELS, _expert_params, _router_params, qwen3_moe


def _batch():
    """The same padded batch at every call: ``(rows, ids, mask, labels, positions)``."""
    with torch.random.fork_rng():
        torch.manual_seed(123)
        return _lm_batch([5, 9, 3, 7])


def _in_backward(calls, fn):
    def counted(self, *args):
        if torch._C._current_graph_task_id() != -1:  # in a backward pass (the probe's own calls are not counted)
            calls.append(fn.__name__)
        return fn(self, *args)

    return counted


def _run(model, projection=None, options=None, to_outputs=False):
    """Per-example gradients of one captured step, and which of the experts' forward the hooks computed again in
    backward: ``W1 x`` (``_hidden``) and the gate (``_gate``, whose vjp gives ``dh`` where autograd's is not used)."""
    _, ids, mask, labels, pos = _batch()
    calls = []
    options = options or CaptureOptions(projection=projection, verify=True)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ExpertsHandler, "_hidden", _in_backward(calls, ExpertsHandler._hidden))
        mp.setattr(ExpertsHandler, "_gate", _in_backward(calls, ExpertsHandler._gate))
        with gradtrace.capture(model, options=options) as cap:
            cap.track_outputs = to_outputs  # as collect() does: backpropagate to the captured outputs only
            out = model(input_ids=ids, attention_mask=mask, position_ids=pos)
            loss = tiny.lm_example_loss(out.logits, labels).mean()
            if to_outputs:
                torch.autograd.grad(loss, cap.pop_outputs())
            else:
                loss.backward()
    batch = cap.batches[0]
    grads = batch.per_example_grads() if projection is None else {n: p.flat() for n, p in batch.params.items()}
    return grads, {name: calls.count(name) for name in ("_hidden", "_gate")}


def _recomputed(model, projection=None, **kwargs):
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ExpertsHandler, "watch_forward", lambda self, args, kwargs: None)
        return _run(model, projection, **kwargs)


def _close(got, want, names, rtol=1e-5):
    for name in names:
        err = (got[name] - want[name]).abs().max() / want[name].abs().max()
        assert err < rtol, (name, float(err))


@pytest.mark.parametrize("arch", list(MODELS))
@pytest.mark.parametrize("projection", [None, gradtrace.LoGra(rank=16, rank_cols=8, vector_rank=4)],
                         ids=["exact", "logra"])
def test_forward_values_are_read_and_equal_the_recomputed_ones(arch, projection):
    """With the default implementation (``grouped_mm``) the hook reads ``h`` from the forward (``W1 x`` is never
    recomputed), and the rows equal the recomputing path's to float32 round-off and brute force to 1e-4."""
    torch.manual_seed(0)
    model = MODELS[arch]()
    assert model.config._experts_implementation == "grouped_mm"
    read, calls = _run(model, projection)
    assert calls == {"_hidden": 0, "_gate": 0}  # dh is autograd's own gradient at the forward's h
    again, calls = _recomputed(model, projection)
    assert calls == {"_hidden": 2, "_gate": 2}  # one per layer
    names = _expert_params(model) + _router_params(model) if projection is None else list(read)
    _close(read, again, names)
    if projection is None:
        rows = _batch()[0]
        ref = tiny.reference_grads(model, rows, _lm_single_loss)
        tiny.assert_grads_close(read, ref, names=names)


def test_under_gradient_checkpointing_the_reread_forward_gives_the_values():
    """Non-reentrant checkpointing (HF's): the watch runs in the re-run forward; nothing is recomputed by the hook
    and the rows equal the plain step's."""
    torch.manual_seed(1)
    model = qwen3_moe()
    model.train()
    plain, _ = _run(model)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    got, calls = _run(model)
    assert calls == {"_hidden": 0, "_gate": 0}
    _close(got, plain, _expert_params(model))


def test_another_implementation_after_the_probe_is_recomputed():
    """The config's implementation switched while capturing (eager: a loop over experts, no grouped product): the
    hook recomputes, with the same rows."""
    torch.manual_seed(2)
    model = qwen3_moe()
    read, _ = _run(model)
    model.config._experts_implementation = "eager"
    got, calls = _run(model)
    assert calls == {"_hidden": 2, "_gate": 2}
    _close(got, read, _expert_params(model))


def test_a_gate_that_changes_h_in_place_is_recomputed():
    """A gate that changes its input in place in the training forward (here by a factor 1, so the rule still holds)
    leaves the forward's ``h`` changed after the product: the call's ``_version`` check sees it and the hook
    recomputes ``W1 x``, with exact rows. (The probe's forward, without autograd, does not change it.)"""
    torch.manual_seed(3)
    model = qwen3_moe()
    for layer in model.model.layers:
        experts = layer.mlp.experts
        base = type(experts)

        class Scaled(base):
            def _apply_gate(self, gate_up_out):
                if gate_up_out.grad_fn is not None:
                    gate_up_out.mul_(1.0)
                return super()._apply_gate(gate_up_out)

        experts.__class__ = Scaled
    got, calls = _run(model)
    assert calls == {"_hidden": 2, "_gate": 2}
    rows = _batch()[0]
    tiny.assert_grads_close(got, tiny.reference_grads(model, rows, _lm_single_loss), names=_expert_params(model))


def test_the_probe_runs_on_four_experts_and_on_all_where_that_fails():
    """Six experts: the probe's copy has four (its random weights are 4/6 of the module's). A forward that checks
    the expert count against the config fails there and passes on the full copy, so it is still captured."""
    model = qwen3_moe()
    experts = model.model.layers[0].mlp.experts
    sizes = []
    probe_with = ExpertsHandler._probe_with

    def recorded(self, count):
        sizes.append(count)
        return probe_with(self, count)

    base = type(experts)

    class Strict(base):
        def forward(self, hidden_states, top_k_index, top_k_weights):
            assert self.gate_up_proj.shape[0] == self.config.num_experts
            return super().forward(hidden_states, top_k_index, top_k_weights)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ExpertsHandler, "_probe_with", recorded)
        handler = ExpertsHandler("e", experts, {"gate_up_proj": "a", "down_proj": "b"})
        assert handler.unsupported_reason() is None and sizes == [4]
        assert handler._reuse == ("grouped_mm", 0)
        sizes.clear()
        experts.__class__ = Strict
        strict = ExpertsHandler("e", experts, {"gate_up_proj": "a", "down_proj": "b"})
        assert strict.unsupported_reason() is None and sizes == [4, 6]
        assert strict._reuse == ("grouped_mm", 0)


def test_padding_that_is_not_finite_reaches_no_example():
    """NaN in the last experts' input at padding positions (so in the forward's h there): with isolate_padding the
    read h is cleaned as the recomputed one is, and every example's rows equal brute force on its own."""
    torch.manual_seed(4)
    model = qwen3_moe()
    rows, _, mask, _, _ = _batch()
    experts = model.model.layers[-1].mlp.experts
    padding = (mask == 0).reshape(-1)

    def poison(module, args):
        x = args[0].clone()
        x[padding] = float("nan")
        return (x, *args[1:])

    handle = experts.register_forward_pre_hook(poison)
    try:
        got, calls = _run(model, options=CaptureOptions(isolate_padding=True))
    finally:
        handle.remove()
    assert calls == {"_hidden": 0, "_gate": 0}
    names = _expert_params(model)
    assert all(torch.isfinite(got[n]).all() for n in names)
    ref = tiny.reference_grads(model, rows, _lm_single_loss)
    tiny.assert_grads_close(got, ref, names=names)


def test_a_backward_that_stops_at_the_experts_output_computes_dh_in_its_hook():
    """Only the experts captured and autograd asked for the captured outputs' gradients (as ``collect`` does): the
    first layer's h is below every output asked for, so autograd computes no gradient there and that layer's hook
    takes dh by the gate's vjp; the second layer's comes from autograd. Both equal brute force."""
    torch.manual_seed(5)
    model = MODELS["gpt_oss"]()
    options = CaptureOptions(layers=["*experts"], partial=True, verify=True)

    got, calls = _run(model, options=options, to_outputs=True)
    assert calls == {"_hidden": 0, "_gate": 1}
    rows = _batch()[0]
    tiny.assert_grads_close(got, tiny.reference_grads(model, rows, _lm_single_loss), names=_expert_params(model))


def test_two_backward_passes_through_one_graph_give_two_exact_batches():
    """``retain_graph=True``: each backward pass delivers its own up-projection terms."""
    torch.manual_seed(6)
    model = qwen3_moe()
    _, ids, mask, labels, pos = _batch()
    with gradtrace.capture(model) as cap:
        out = model(input_ids=ids, attention_mask=mask, position_ids=pos)
        loss = tiny.lm_example_loss(out.logits, labels).mean()
        loss.backward(retain_graph=True)
        (2 * loss).backward()
    first, second = (b.per_example_grads() for b in cap.batches)
    ref = tiny.reference_grads(model, _batch()[0], _lm_single_loss)
    tiny.assert_grads_close(first, ref, names=_expert_params(model))
    tiny.assert_grads_close(second, {n: 2 * g for n, g in ref.items()}, names=_expert_params(model))


def test_a_term_never_delivered_is_an_error_that_names_it():
    from gradtrace.capture.assemble import LaterTerm

    with pytest.raises(RuntimeError, match="gate_up_proj was not delivered"):
        LaterTerm("model.layers.0.mlp.experts.gate_up_proj").resolve()


def test_a_forward_that_raises_leaves_no_watch_behind():
    """An experts call that fails inside its forward (here in a pre-hook after the capture's): the watch's function
    mode is popped all the same, and the next step captures exactly."""
    torch.manual_seed(7)
    model = qwen3_moe()
    _, ids, mask, labels, pos = _batch()
    experts = model.model.layers[0].mlp.experts
    with gradtrace.capture(model) as cap:
        handle = experts.register_forward_pre_hook(lambda module, args: 1 / 0)
        with pytest.raises(ZeroDivisionError):
            model(input_ids=ids, attention_mask=mask, position_ids=pos)
        handle.remove()
        assert torch._C._len_torch_function_stack() == 0
        out = model(input_ids=ids, attention_mask=mask, position_ids=pos)
        tiny.lm_example_loss(out.logits, labels).mean().backward()
    ref = tiny.reference_grads(model, _batch()[0], _lm_single_loss)
    tiny.assert_grads_close(cap.batches[-1].per_example_grads(), ref, names=_expert_params(model))


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
def test_transformers_fallback_kernel_is_read_too(arch, monkeypatch):
    """Where transformers cannot use ``grouped_mm`` (older torch, older GPUs) it calls its own fallback op, which
    writes its output in place; its values are read as well (the in-place check counts from the op's return)."""
    import transformers.integrations.moe as hf_moe

    monkeypatch.setattr(hf_moe, "_can_use_grouped_mm", lambda *args, **kwargs: False)
    torch.manual_seed(8)
    model = MODELS[arch]()
    got, calls = _run(model)
    assert calls == {"_hidden": 0, "_gate": 0}
    ref = tiny.reference_grads(model, _batch()[0], _lm_single_loss)
    tiny.assert_grads_close(got, ref, names=_expert_params(model))


def test_reentrant_checkpointing_and_save_on_cpu_give_the_plain_rows():
    """Reentrant checkpointing (the forward re-run inside backward, its own graph differentiated) and
    ``save_on_cpu`` (the kept values moved to host memory and back): nothing recomputed, the plain step's rows."""
    torch.manual_seed(9)
    model = qwen3_moe()
    model.train()
    plain, _ = _run(model)
    _, ids, mask, labels, pos = _batch()
    with gradtrace.capture(model) as cap, torch.autograd.graph.save_on_cpu():
        out = model(input_ids=ids, attention_mask=mask, position_ids=pos)
        tiny.lm_example_loss(out.logits, labels).mean().backward()
    _close(cap.batches[0].per_example_grads(), plain, _expert_params(model))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    got, calls = _run(model)
    assert calls == {"_hidden": 0, "_gate": 0}
    _close(got, plain, _expert_params(model))

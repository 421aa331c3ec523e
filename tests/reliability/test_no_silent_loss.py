"""No silent loss: every example is either captured exactly or left out with its id and the reason said.

NaN confined to some examples must not take others with it (padding isolates examples), a model with NaN
weights is refused before any work, a run where nothing is finite is an error, and examples without a target
token are named."""

import warnings

import pytest
import torch

import gradtrace
from gradtrace.loss.functions import causal_lm_loss
from gradtrace.options import CaptureOptions, StoreOptions
from tests import tiny

LENGTHS = [10, 7, 4, 9, 2, 6]  # right-padded to 10
NAN_AT = 7  # the position whose hidden state is NaN: only examples longer than 7 tokens really have it
NAMES = [f"e{i}" for i in range(len(LENGTHS))]


def _padded_batch(lengths=LENGTHS, pad_id: int = 0) -> dict:
    width = max(lengths)
    input_ids = torch.randint(3, tiny.VOCAB, (len(lengths), width))
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for row, length in enumerate(lengths):
        mask[row, :length] = 1
        input_ids[row, length:] = pad_id
    return {"input_ids": input_ids, "attention_mask": mask}


def _nan_at_position(module, position: int = NAN_AT):
    """A forward hook making ``module``'s hidden states NaN at ``position`` of every row that has it (as a NaN
    position embedding, or an overflow at long positions, would)."""

    def hook(mod, args, output):
        hidden = output[0] if isinstance(output, tuple) else output
        if hidden.shape[1] <= position:
            return None
        hidden = hidden.clone()
        hidden[:, position] = float("nan")
        return (hidden, *output[1:]) if isinstance(output, tuple) else hidden

    return module.register_forward_hook(hook)


def _first_block(model):
    return model.transformer.h[0] if hasattr(model, "transformer") else model.model.layers[0]


def _single_loss(model, tokens):
    return causal_lm_loss(model, {"input_ids": tokens.unsqueeze(0)}).sum()


def _split(vectors: torch.Tensor, spec) -> dict[str, torch.Tensor]:
    out, start = {}, 0
    for name, dim in spec.params:
        out[name] = vectors[:, start:start + dim]
        start += dim
    return out


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_nan_at_padded_positions_flags_only_the_examples_that_have_it(arch):
    model = getattr(tiny, arch)()
    batch = _padded_batch()
    own = [i for i, n in enumerate(LENGTHS) if n > NAN_AT]  # e0, e3
    healthy = [i for i in range(len(LENGTHS)) if i not in own]
    handle = _nan_at_position(_first_block(model))  # NaN born outside any captured layer, in the residual stream
    try:
        with pytest.warns(UserWarning, match=r"2 example\(s\) have NaN/inf gradients in backward pass 0: e0, e3 "):
            grads = gradtrace.collect(model, [{**batch, "id": NAMES}])
        # brute force: each healthy example alone, unpadded (it never reaches the NaN position)
        ref = tiny.reference_grads(model, [batch["input_ids"][i, :LENGTHS[i]] for i in healthy], _single_loss)
    finally:
        handle.remove()
    assert grads.dropped == ["e0", "e3"]
    assert grads.ids == [NAMES[i] for i in healthy]
    got = _split(grads.vectors, grads.spec)
    tiny.assert_grads_close({n: g.reshape(ref[n].shape) for n, g in got.items()}, ref)


def collect_with_nan_in_padding(model, batch: dict, **options):
    """``collect`` of ``batch`` with a NaN in one row's padding (the token embeddings of row 2, 4 tokens long, at
    position 8), refusing any warning: padding is no example's."""

    def hook(mod, args, output):
        output = output.clone()
        output[2, 8] = float("nan")
        return output

    handle = model.transformer.wte.register_forward_hook(hook)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            return gradtrace.collect(model, [{**batch, "id": NAMES}], **options)  # store=, store_options=
    finally:
        handle.remove()


def test_nan_only_in_one_examples_padding_flags_nothing():
    """Padding is no example's: a NaN there (in the saved activations) does not make its row's example NaN."""
    model = tiny.gpt2()
    batch = _padded_batch()
    grads = collect_with_nan_in_padding(model, batch)
    ref = tiny.reference_grads(model, [batch["input_ids"][i, :n] for i, n in enumerate(LENGTHS)], _single_loss)
    assert grads.dropped == [] and grads.ids == NAMES
    got = _split(grads.vectors, grads.spec)
    tiny.assert_grads_close({n: g.reshape(ref[n].shape) for n, g in got.items()}, ref)


def test_loss_gives_padding_exactly_zero_gradient_even_where_its_logits_are_nan():
    from gradtrace.loss.functions import token_cross_entropy

    logits = torch.randn(4, 5, requires_grad=True)
    poisoned = logits.detach().clone()
    poisoned[1] = float("nan")  # an ignored row
    poisoned = poisoned.requires_grad_()
    targets = torch.tensor([2, -100, 0, 4])
    token_cross_entropy(poisoned, targets).sum().backward()
    token_cross_entropy(logits, targets).sum().backward()
    assert torch.equal(poisoned.grad[1], torch.zeros(5))
    assert torch.equal(poisoned.grad[[0, 2, 3]], logits.grad[[0, 2, 3]])


def _nan_everywhere(module):
    def hook(mod, args, output):
        return torch.full_like(output, float("nan"))

    return module.register_forward_hook(hook)


def test_nan_weight_is_refused_before_any_work(tmp_path):
    from gradtrace.capture.collect import NonFiniteError

    model = tiny.gpt2()
    with torch.no_grad():
        model.transformer.h[1].mlp.c_fc.weight[3, 5] = float("nan")
    batch = {**_padded_batch(), "id": NAMES}
    with pytest.raises(NonFiniteError, match=r"parameter transformer\.h\.1\.mlp\.c_fc\.weight holds NaN/inf"):
        gradtrace.collect(model, [batch])
    with pytest.raises(NonFiniteError, match=r"c_fc\.weight"):
        gradtrace.collect(model, [batch], store=tmp_path / "store")
    assert not (tmp_path / "store").exists()


def test_a_run_where_every_example_is_nonfinite_is_an_error_and_keeps_the_store(tmp_path):
    from gradtrace.capture.collect import NonFiniteError
    from gradtrace.store import GradientStore

    model = tiny.gpt2()
    store = tmp_path / "store"
    first = {**_padded_batch([5, 3]), "id": ["a", "b"]}
    gradtrace.collect(model, [first], store=store)
    handle = _nan_everywhere(model.transformer.wte)
    partial = CaptureOptions(partial=True)  # the hook's NaN output needs no gradient: wte is left out, as allowed
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the capture's per-batch warning
            with pytest.raises(NonFiniteError, match=r"all 6 examples have NaN/inf gradients \(e0, e1, e2 \.\.\.\); "
                                                     r"nothing new was stored in .*store \(it keeps what it held\)"):
                gradtrace.collect(model, [{**_padded_batch(), "id": NAMES}], store=store, options=partial,
                                  store_options=StoreOptions(resume=True))
            with pytest.raises(NonFiniteError, match="no gradient is left"):
                gradtrace.collect(model, [{**_padded_batch(), "id": NAMES}], options=partial)
    finally:
        handle.remove()
    kept = GradientStore.open(store)
    assert kept.ids == ["a", "b"]


def test_one_token_examples_are_named_and_get_a_zero_gradient():
    model = tiny.gpt2()
    batch = {**_padded_batch([5, 1, 3, 1]), "id": ["long", "one", "mid", "two"]}
    with pytest.warns(UserWarning, match=r"2 example\(s\) have no target token in backward pass 0 .*: one, two$"):
        grads = gradtrace.collect(model, [batch])
    assert grads.ids == ["long", "one", "mid", "two"]
    assert torch.equal(grads.vectors[[1, 3]], torch.zeros(2, grads.dim))
    assert bool((grads.vectors[[0, 2]].abs().sum(1) > 0).all())


def test_capture_counts_targets_from_labels_in_a_training_loop():
    model = tiny.gpt2()
    batch = _padded_batch([4, 1])
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    with pytest.warns(UserWarning, match=r"1 example\(s\) have no target token .*: b$"), \
            gradtrace.capture(model, ids=["a", "b"]) as cap:
        model(**batch, labels=labels).loss.backward()
    assert cap.batches[0].num_targets.tolist() == [3.0, 0.0]


def test_rank_beyond_every_dimension_is_refused_before_allocating():
    with pytest.raises(ValueError, match=r"LoGra rank 100000 is larger than every dimension of the 28 captured "
                                         r"parameters \(the largest is 64\): .* each example's projected "
                                         r"gradient would take 100,001,800,000 floats \(372\.5 GiB\)\. Use a rank "
                                         r"of at most 64"):
        gradtrace.capture(tiny.gpt2(), options=CaptureOptions(projection=gradtrace.LoGra(rank=100000)))
    gradtrace.capture(tiny.gpt2(), options=CaptureOptions(projection=gradtrace.LoGra(rank=64)))  # the largest accepted
    with pytest.raises(ValueError, match="LoGra rank 65 is larger"):
        gradtrace.capture(tiny.gpt2(),
                          options=CaptureOptions(projection=gradtrace.LoGra(rank=4, ranks={"*wte.weight": (65, 4)})))

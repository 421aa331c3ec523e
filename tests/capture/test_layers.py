"""Every supported layer kind against a loop of single-example backward passes, and every module that
cannot be captured per example reported (warned about, listed, left out) instead of silently missed."""

import copy

import pytest
import torch
from torch import nn

import gradtrace
from gradtrace.options import CaptureOptions
from tests import tiny
from tests.capture.test_exact import _lm_batch, _lm_single_loss


def _sq_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per-example squared error ``[B]`` for outputs of any shape."""
    return (out - target).pow(2).flatten(1).sum(1)


def _single_sq_loss(model, example):
    x, target = example
    return _sq_loss(model(x.unsqueeze(0)), target.unsqueeze(0)).sum()


def _capture_vs_loop(model, x, **kw):
    """Capture one mean-reduced backward pass over ``x`` and the brute-force loop's gradients."""
    with torch.no_grad():
        target = torch.randn_like(model(x))
    ref = tiny.reference_grads(model, list(zip(x, target)), _single_sq_loss)
    with gradtrace.capture(model, options=CaptureOptions(**kw)) as cap:
        _sq_loss(model(x), target).mean().backward()
    assert len(cap.batches) == 1
    return cap, cap.batches[0], ref


def _kinds(cap) -> dict[str, str]:
    return {name: kind for name, kind, _ in cap.report().layers}


def _unsupported(cap) -> dict[str, str]:
    return {u.module: u.reason for u in cap.report().unsupported}


def _randomize_(module: nn.Module) -> nn.Module:
    """Non-trivial weights/biases (norms start at ones/zeros, which hides offset and bias mistakes)."""
    with torch.no_grad():
        for param in module.parameters():
            param.copy_(torch.randn_like(param) * 0.5 + 0.3)
    return module


class NormNet(nn.Module):
    """Linear -> norm -> Linear over ``[B, T, 5]`` inputs."""

    def __init__(self, norm: nn.Module, width: int = 8):
        super().__init__()
        self.inp = nn.Linear(5, width)
        self.norm = norm
        self.out = nn.Linear(width, 3)

    def forward(self, x):
        return self.out(self.norm(self.inp(x)))


# ---------------------------------------------------------------------------------------------- norms
def _hf_norm(module_path: str, cls: str, **kw):
    def make():
        import importlib

        return getattr(importlib.import_module(module_path), cls)(8, **kw)

    return make


_NORMS = {
    "llama": (_hf_norm("transformers.models.llama.modeling_llama", "LlamaRMSNorm", eps=1e-5), "rmsnorm"),
    "qwen2": (_hf_norm("transformers.models.qwen2.modeling_qwen2", "Qwen2RMSNorm"), "rmsnorm"),
    "mistral": (_hf_norm("transformers.models.mistral.modeling_mistral", "MistralRMSNorm"), "rmsnorm"),
    "gemma": (_hf_norm("transformers.models.gemma.modeling_gemma", "GemmaRMSNorm"), "rmsnorm(1+w)"),
    "t5": (_hf_norm("transformers.models.t5.modeling_t5", "T5LayerNorm"), "rmsnorm"),
    "layernorm": (lambda: nn.LayerNorm(8), "layernorm"),
    "layernorm-nobias": (lambda: nn.LayerNorm(8, bias=False), "layernorm"),
    "rmsnorm": (lambda: nn.RMSNorm(8), "rmsnorm"),
    "rmsnorm-eps": (lambda: nn.RMSNorm(8, eps=0.1), "rmsnorm"),
}


@pytest.mark.parametrize("name", list(_NORMS))
def test_norm_matches_loop_and_is_reported(name):
    make, kind = _NORMS[name]
    model = NormNet(_randomize_(make()))
    cap, batch, ref = _capture_vs_loop(model, torch.randn(4, 3, 5))
    assert cap.report().ok, str(cap.report())
    assert _kinds(cap)["norm"] == kind
    assert set(batch.params) == set(tiny.trainable(model))
    tiny.assert_grads_close(batch.per_example_grads(), ref)


def test_layernorm_over_two_dims_matches_loop():
    model = NormNet(nn.Identity())
    model.norm = _randomize_(nn.LayerNorm((3, 8)))  # normalizes each example's whole [3, 8] block
    _, batch, ref = _capture_vs_loop(model, torch.randn(4, 3, 5))
    assert batch.params["norm.weight"].shape == (3, 8)
    tiny.assert_grads_close(batch.per_example_grads(), ref)


def test_layernorm_without_affine_has_nothing_to_capture():
    model = NormNet(nn.LayerNorm(8, elementwise_affine=False))
    cap, batch, ref = _capture_vs_loop(model, torch.randn(4, 3, 5))
    assert "norm" not in _kinds(cap) and cap.report().ok
    assert set(batch.params) == {"inp.weight", "inp.bias", "out.weight", "out.bias"}
    tiny.assert_grads_close(batch.per_example_grads(), ref)


class CenteredNorm(nn.Module):
    """A hand-written LayerNorm with a bias: norm-like by structure, and the probe confirms the formula."""

    def __init__(self, width: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.bias = nn.Parameter(torch.zeros(width))
        self.eps = 1e-3

    def forward(self, x):
        x = x - x.mean(-1, keepdim=True)
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight + self.bias


class FancyNorm(nn.Module):
    """Norm-like by structure (name, a 1-d weight), but not a normalization at all."""

    def __init__(self, width: int):
        super().__init__()
        self.weight = nn.Parameter(torch.rand(width) + 0.5)

    def forward(self, x):
        return torch.tanh(x) * self.weight


def test_custom_layernorm_is_verified_and_exact():
    model = NormNet(_randomize_(CenteredNorm(8)))
    cap, batch, ref = _capture_vs_loop(model, torch.randn(4, 3, 5) * 0.1)  # small inputs: eps matters
    assert _kinds(cap)["norm"] == "layernorm"
    tiny.assert_grads_close(batch.per_example_grads(), ref)


def test_norm_lookalike_with_another_formula_is_reported_not_captured():
    model = NormNet(FancyNorm(8))
    with pytest.warns(UserWarning, match=r"norm \(FancyNorm"):
        cap, batch, ref = _capture_vs_loop(model, torch.randn(4, 3, 5), partial=True)
    assert "matches no known formula" in _unsupported(cap)["norm"]
    assert not cap.report().ok and "FancyNorm" in str(cap.report())
    assert "norm.weight" not in batch.params
    tiny.assert_grads_close(batch.per_example_grads(), ref, names=["inp.weight", "inp.bias", "out.weight",
                                                                   "out.bias"])
    with pytest.raises(ValueError, match="FancyNorm"), gradtrace.capture(model):  # the default: partial=False
        pass


class CountingRMSNorm(nn.Module):
    """An RMSNorm that counts its calls in a buffer: detecting its formula must not touch the model's state."""

    def __init__(self, width: int):
        super().__init__()
        self.weight = nn.Parameter(torch.rand(width) + 0.5)
        self.eps = 1e-6
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        self.calls += 1
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def test_norm_detection_leaves_module_state_alone():
    model = NormNet(CountingRMSNorm(8))
    cap, batch, ref = _capture_vs_loop(model, torch.randn(4, 3, 5))
    assert _kinds(cap)["norm"] == "rmsnorm"
    tiny.assert_grads_close(batch.per_example_grads(), ref)
    assert int(model.norm.calls) == 1 + 4 + 1, "target forward + 4 loop forwards + 1 captured forward"


@pytest.mark.parametrize("norm", [nn.BatchNorm1d(3), nn.BatchNorm1d(8, momentum=None),
                                  nn.InstanceNorm1d(3, affine=True)], ids=["batchnorm", "batchnorm-cumulative",
                                                                           "instancenorm"])
def test_batch_and_instance_norm_are_reported_and_state_untouched(norm):
    model = NormNet(norm)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.warns(UserWarning, match=type(norm).__name__), \
            gradtrace.capture(model, options=CaptureOptions(partial=True)) as cap:  # the norm is the subject
        pass
    assert "per-example rule" in _unsupported(cap)["norm"]
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before), "capture() changed running statistics"


# ---------------------------------------------------------------------------------------------- embeddings
class EmbedNet(nn.Module):
    def __init__(self, **kw):
        super().__init__()
        self.emb = nn.Embedding(11, 6, **kw)
        self.head = nn.Linear(6, 3)

    def forward(self, ids):
        return self.head(torch.tanh(self.emb(ids)))


def _embed_loop(model, ids, **kw):
    with torch.no_grad():
        target = torch.randn_like(model(ids))
    ref = tiny.reference_grads(model, list(zip(ids, target)), _single_sq_loss)
    with gradtrace.capture(model, options=CaptureOptions(**kw)) as cap:
        _sq_loss(model(ids), target).mean().backward()
    return cap, cap.batches[0], ref


def test_embedding_padding_idx_row_gets_no_gradient():
    model = EmbedNet(padding_idx=3)
    ids = torch.tensor([[3, 1, 3, 5], [2, 3, 3, 3], [7, 8, 9, 10], [3, 3, 3, 4]])
    cap, batch, ref = _embed_loop(model, ids)
    assert cap.report().ok
    grads = batch.per_example_grads()
    assert torch.equal(grads["emb.weight"][:, 3], torch.zeros(4, 6))
    assert ref["emb.weight"][:, 3].abs().max() == 0
    tiny.assert_grads_close(grads, ref)


def test_embedding_repeated_tokens_accumulate():
    model = EmbedNet()
    ids = torch.tensor([[1, 1, 1, 2], [4, 0, 4, 0], [10, 9, 10, 9]])
    _, batch, ref = _embed_loop(model, ids)
    tiny.assert_grads_close(batch.per_example_grads(), ref)


def test_embedding_scale_grad_by_freq_is_unsupported():
    model = EmbedNet(scale_grad_by_freq=True)
    ids = torch.randint(0, 11, (3, 5))
    with pytest.warns(UserWarning, match="scale_grad_by_freq"):
        cap, batch, ref = _embed_loop(model, ids, partial=True)
    assert "scale_grad_by_freq" in _unsupported(cap)["emb"]
    assert "emb.weight" not in batch.params
    tiny.assert_grads_close(batch.per_example_grads(), ref, names=["head.weight", "head.bias"])
    with pytest.raises(ValueError, match="scale_grad_by_freq"):
        gradtrace.capture(model, options=CaptureOptions(layers=["emb"]))


# ---------------------------------------------------------------------------------------------- convolutions
class Wrap(nn.Module):
    def __init__(self, layer: nn.Module):
        super().__init__()
        self.layer = layer

    def forward(self, x):
        return self.layer(x)


_CONVS = {
    "1d-stride": (lambda: nn.Conv1d(3, 4, 3, stride=2), (3, 11)),
    "1d-dilation-nobias": (lambda: nn.Conv1d(3, 4, 3, dilation=2, padding=2, bias=False), (3, 9)),
    "1d-same-even-circular": (lambda: nn.Conv1d(3, 4, 4, padding="same", padding_mode="circular"), (3, 9)),
    "1d-replicate": (lambda: nn.Conv1d(3, 4, 3, padding=2, padding_mode="replicate"), (3, 8)),
    "2d-stride-rect": (lambda: nn.Conv2d(3, 4, (3, 2), stride=(2, 1), padding=(1, 0)), (3, 7, 6)),
    "2d-same-dilation-reflect": (lambda: nn.Conv2d(3, 4, 3, dilation=(2, 1), padding="same",
                                                   padding_mode="reflect"), (3, 7, 6)),
    "2d-circular-nobias": (lambda: nn.Conv2d(3, 4, 3, padding=1, padding_mode="circular", bias=False), (3, 5, 6)),
    "2d-same-even-zeros": (lambda: nn.Conv2d(3, 4, 2, padding="same"), (3, 5, 5)),
    "2d-replicate-stride": (lambda: nn.Conv2d(3, 2, 3, stride=2, padding=1, padding_mode="replicate"), (3, 6, 7)),
    "2d-1x1": (lambda: nn.Conv2d(3, 4, 1), (3, 4, 4)),
}


@pytest.mark.parametrize("name", list(_CONVS))
def test_conv_matches_loop(name):
    make, shape = _CONVS[name]
    model = Wrap(make())
    cap, batch, ref = _capture_vs_loop(model, torch.randn(3, *shape))
    assert cap.report().ok and _kinds(cap)["layer"] == "conv(" + type(model.layer).__name__ + ")"
    assert set(batch.params) == set(tiny.trainable(model))
    tiny.assert_grads_close(batch.per_example_grads(), ref)


class GroupedNet(nn.Module):
    def __init__(self, groups: int):
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.grouped = nn.Conv2d(4, 4, 3, padding=1, groups=groups)
        self.head = nn.Linear(4 * 5 * 5, 3)

    def forward(self, x):
        return self.head(torch.relu(self.grouped(torch.relu(self.conv(x)))).flatten(1))


@pytest.mark.parametrize("groups", [2, 4])
def test_grouped_conv_is_reported_and_left_out(groups):
    model = GroupedNet(groups)
    with pytest.warns(UserWarning, match=rf"grouped \(Conv2d: grouped convolution \(groups={groups}\)"):
        cap, batch, ref = _capture_vs_loop(model, torch.randn(3, 2, 5, 5), partial=True)
    assert "groups" in _unsupported(cap)["grouped"]
    assert not {"grouped.weight", "grouped.bias"} & set(batch.params)
    assert set(batch.params) == {"conv.weight", "conv.bias", "head.weight", "head.bias"}
    tiny.assert_grads_close(batch.per_example_grads(), ref, names=list(batch.params))


@pytest.mark.parametrize("make", [lambda: nn.Conv3d(2, 2, 1), lambda: nn.ConvTranspose1d(2, 2, 3, padding=1)],
                         ids=["conv3d", "conv-transpose"])
def test_conv_kinds_without_rule_are_reported(make):
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.other = make()
            self.head = nn.Linear(2, 2)

        def forward(self, x):
            return self.head(self.other(x).transpose(1, -1))

    model = Net()
    x = torch.randn(3, 2, 4) if isinstance(model.other, nn.ConvTranspose1d) else torch.randn(3, 2, 2, 3, 4)
    with pytest.warns(UserWarning, match=type(model.other).__name__):
        cap, batch, ref = _capture_vs_loop(model, x, partial=True)
    assert "other" in _unsupported(cap)
    assert set(batch.params) == {"head.weight", "head.bias"}
    tiny.assert_grads_close(batch.per_example_grads(), ref, names=list(batch.params))


# ---------------------------------------------------------------------------------------------- attention
class AttnNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(5, 8)
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
        self.out = nn.Linear(8, 3)

    def forward(self, x):
        h = self.inp(x)
        return self.out(self.attn(h, h, h, need_weights=False)[0])


def test_multihead_attention_is_reported_and_never_mis_captured():
    model = AttnNet()
    with pytest.warns(UserWarning) as record:
        cap, batch, ref = _capture_vs_loop(model, torch.randn(4, 3, 5), partial=True)
    entry = [str(w.message) for w in record if "cannot be captured" in str(w.message)]
    assert entry and "attn (MultiheadAttention" in entry[0]
    report = cap.report()
    assert "attn" in _unsupported(cap) and not report.ok
    assert "MultiheadAttention" in str(report)
    # out_proj is an nn.Linear whose forward never runs (F.multi_head_attention_forward uses its weight):
    # it must be absent or reported as functional, never a wrong gradient
    for name in ("attn.out_proj.weight", "attn.out_proj.bias"):
        if name in batch.params:
            tiny.assert_grads_close(batch.per_example_grads(), ref, names=[name])
        else:
            listed = [p for u in report.unsupported for p in u.params]
            assert name in report.functional or name in listed
    assert not {"attn.in_proj_weight", "attn.in_proj_bias"} & set(batch.params)
    tiny.assert_grads_close(batch.per_example_grads(), ref, names=["inp.weight", "inp.bias", "out.weight",
                                                                   "out.bias"])
    with pytest.raises(ValueError, match="MultiheadAttention"), gradtrace.capture(model):  # the default: partial=False
        pass


def test_multihead_attention_out_proj_is_reported_up_front():
    """Known before any backward pass: out_proj is applied functionally, so selecting it is an error and
    the default selection lists it as unsupported rather than as captured."""
    model = AttnNet()
    cap = gradtrace.capture(model, options=CaptureOptions(partial=True))
    assert "attn.out_proj" not in _kinds(cap)
    assert "attn.out_proj" in _unsupported(cap)
    with pytest.raises(ValueError, match=r"attn\.out_proj"):
        gradtrace.capture(model, options=CaptureOptions(layers=["attn.out_proj", "out"]))


class FunctionalUse(nn.Module):
    """Uses a Linear's parameters through F.linear: the Linear's forward hook never fires."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(5, 5)
        self.out = nn.Linear(5, 2)

    def forward(self, x):
        return self.out(torch.tanh(nn.functional.linear(x, self.lin.weight, self.lin.bias)))


def test_functional_use_is_detected_at_runtime():
    model = FunctionalUse()
    with pytest.warns(UserWarning, match=r"lin\.bias, lin\.weight received gradients"):
        cap, batch, ref = _capture_vs_loop(model, torch.randn(4, 5), partial=True)
    assert sorted(cap.report().functional) == ["lin.bias", "lin.weight"] and not cap.report().ok
    assert list(batch.params) == ["out.weight", "out.bias"]
    tiny.assert_grads_close(batch.per_example_grads(), ref, names=["out.weight", "out.bias"])


def test_functional_use_raises_without_partial():
    model = FunctionalUse()
    with pytest.raises(ValueError, match=r"lin\.weight"), gradtrace.capture(model):
        model(torch.randn(4, 5)).sum().backward()


# ---------------------------------------------------------------------------------------------- frozen
def _frozen_mlp(freeze_first: bool) -> nn.Sequential:
    model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 8), _randomize_(nn.LayerNorm(8)), nn.Linear(8, 3))
    frozen = [model[2], model[3]] + ([model[0]] if freeze_first else [])
    for module in frozen:
        module.requires_grad_(False)
    return model


def _all_trainable_ref(model, x, target):
    """Brute force over *every* parameter, frozen ones included (on a copy made trainable)."""
    free = copy.deepcopy(model).requires_grad_(True)
    return tiny.reference_grads(free, list(zip(x, target)), _single_sq_loss)


def test_frozen_layers_are_skipped_by_default():
    model = _frozen_mlp(freeze_first=False)
    cap, batch, ref = _capture_vs_loop(model, torch.randn(4, 5))
    assert sorted(cap.report().frozen) == ["2", "3"]
    assert cap.report().ok
    assert set(batch.params) == {"0.weight", "0.bias", "4.weight", "4.bias"}
    tiny.assert_grads_close(batch.per_example_grads(), ref)


def test_include_frozen_captures_frozen_layers_exactly():
    model = _frozen_mlp(freeze_first=False)
    x = torch.randn(4, 5)
    with torch.no_grad():
        target = torch.randn(4, 3)
    ref = _all_trainable_ref(model, x, target)
    with gradtrace.capture(model, options=CaptureOptions(include_frozen=True)) as cap:
        _sq_loss(model(x), target).mean().backward()
    batch = cap.batches[0]
    assert cap.report().frozen == []
    assert set(batch.params) == {n for n, _ in model.named_parameters()}
    tiny.assert_grads_close(batch.per_example_grads(), ref)
    assert model[2].weight.grad is None, "frozen parameters still get no .grad"


def test_include_frozen_first_layer_with_input_requiring_grad():
    model = _frozen_mlp(freeze_first=True)
    x = torch.randn(4, 5)
    target = torch.randn(4, 3)
    ref = _all_trainable_ref(model, x, target)
    with gradtrace.capture(model, options=CaptureOptions(include_frozen=True)) as cap:
        _sq_loss(model(x.requires_grad_()), target).mean().backward()
    batch = cap.batches[0]
    assert set(batch.params) == {n for n, _ in model.named_parameters()}
    tiny.assert_grads_close(batch.per_example_grads(), ref)


def test_include_frozen_layer_outside_the_graph_is_reported():
    model = _frozen_mlp(freeze_first=True)
    x = torch.randn(4, 5)
    with pytest.warns(UserWarning, match="does not require grad"), \
            gradtrace.capture(model, options=CaptureOptions(include_frozen=True)) as cap:
        _sq_loss(model(x), torch.randn(4, 3)).mean().backward()
    assert "0.weight" not in cap.batches[0].params
    assert "0" in cap.report().runtime_skipped and not cap.report().ok


# ---------------------------------------------------------------------------------------------- PEFT LoRA
def test_peft_lora_captures_only_adapters_exactly():
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
                             init_lora_weights=False)  # random lora_B, so lora_A's gradient is not zero
    model = peft.get_peft_model(tiny.llama(), config)
    rows, ids, mask, labels, pos = _lm_batch([5, 8, 3])
    ref = tiny.reference_grads(model, rows, _lm_single_loss)
    with gradtrace.capture(model) as cap:
        out = model(input_ids=ids, attention_mask=mask, position_ids=pos)
        tiny.lm_example_loss(out.logits, labels).mean().backward()
    batch = cap.batches[0]
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    assert len(names) == 2 * 2 * 2 and all(".lora_A." in n or ".lora_B." in n for n in names)
    assert list(batch.params) == names
    assert cap.report().ok and cap.report().frozen
    assert all(g.abs().max() > 0 for g in ref.values())
    tiny.assert_grads_close(batch.per_example_grads(), ref)


# ---------------------------------------------------------------------------------------------- selection
def test_layer_selection_by_glob_type_and_exclude():
    model = tiny.llama()
    rows, ids, mask, labels, pos = _lm_batch([5, 8, 3])
    ref = tiny.reference_grads(model, rows, _lm_single_loss)
    names = list(ref)
    cases = {
        "glob": ({"layers": ["*.mlp.*"]}, [n for n in names if ".mlp." in n]),
        "type": ({"layers": [nn.Embedding]}, ["model.embed_tokens.weight"]),
        "exclude": ({"exclude": ["lm_head", "*.self_attn.*", nn.Embedding]},
                    [n for n in names if ".self_attn." not in n and n not in ("lm_head.weight",
                                                                              "model.embed_tokens.weight")]),
        "glob+exclude": ({"layers": ["model.layers.1.*"], "exclude": ["*_layernorm"]},
                         [n for n in names if n.startswith("model.layers.1.") and "layernorm" not in n]),
    }
    for case, (kw, expected) in cases.items():
        with gradtrace.capture(model, options=CaptureOptions(**kw)) as cap:
            out = model(input_ids=ids, attention_mask=mask, position_ids=pos)
            tiny.lm_example_loss(out.logits, labels).mean().backward()
        batch = cap.batches[0]
        assert expected and list(batch.params) == expected, case
        assert cap.report().ok, case
        tiny.assert_grads_close(batch.per_example_grads(), ref, names=expected)
    assert any("layernorm" in n for n in cases["exclude"][1]), "HF RMSNorms are captured without configuration"


@pytest.mark.parametrize("chosen,added", [("lm_head", "transformer.wte"), ("transformer.wte", "lm_head")])
def test_tied_weight_selection_includes_every_use_site(chosen, added):
    model = tiny.gpt2(tied=True)
    rows, ids, mask, labels, pos = _lm_batch([5, 8, 3])
    ref = tiny.reference_grads(model, rows, _lm_single_loss)
    with gradtrace.capture(model, options=CaptureOptions(layers=[chosen])) as cap:
        out = model(input_ids=ids, attention_mask=mask, position_ids=pos)
        tiny.lm_example_loss(out.logits, labels).mean().backward()
    batch = cap.batches[0]
    assert list(batch.params) == ["transformer.wte.weight"]
    assert any(t.startswith(added + " ") for t in cap.report().tied), cap.report().tied
    assert {"lm_head", "transformer.wte"} <= set(_kinds(cap))
    tiny.assert_grads_close(batch.per_example_grads(), ref, names=["transformer.wte.weight"])
    with pytest.raises(ValueError, match="shares parameter"):
        gradtrace.capture(model, options=CaptureOptions(layers=[chosen], exclude=[added]))


def test_shared_parameter_with_an_unsupported_site_is_left_out():
    """A tied weight captured at one site only would be a partial gradient passed off as the whole one."""

    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(11, 6, scale_grad_by_freq=True)
            self.head = nn.Linear(6, 11)
            self.head.weight = self.emb.weight

        def forward(self, ids):
            return self.head(torch.tanh(self.emb(ids)))

    model = Tied()
    with pytest.warns(UserWarning, match="shares emb.weight with emb"):
        cap, batch, ref = _capture_vs_loop(model, torch.randint(0, 11, (3, 4)), partial=True)
    assert list(batch.params) == ["head.bias"]
    assert {"emb", "head"} <= set(_unsupported(cap))
    tiny.assert_grads_close(batch.per_example_grads(), ref, names=["head.bias"])
    with pytest.raises(ValueError, match="scale_grad_by_freq"):
        gradtrace.capture(model, options=CaptureOptions(layers=["head"]))


# ---------------------------------------------------------------------------------------------- subclasses
class ScaledLinear(nn.Linear):
    def forward(self, x):
        return super().forward(x) * 3.0


class MaskedLinear(nn.Linear):
    """Uses a transformed weight: its gradient is not the plain linear rule's."""

    def forward(self, x):
        return nn.functional.linear(x, self.weight.tril(), self.bias)


class PlainLinear(nn.Linear):
    """A subclass that does not override forward."""


class CausalConv1d(nn.Conv1d):
    def forward(self, x):
        return super().forward(nn.functional.pad(x, (self.kernel_size[0] - 1, 0)))


class StdConv2d(nn.Conv2d):
    """Weight standardization (timm/HF ``WeightStandardizedConv2d``)."""

    def forward(self, x):
        w = self.weight
        w = (w - w.mean((1, 2, 3), keepdim=True)) / (w.std((1, 2, 3), keepdim=True) + 1e-5)
        return self._conv_forward(x, w, self.bias)


class ChannelsFirstLayerNorm(nn.LayerNorm):
    """A LayerNorm over dim 1 (SAM/ConvNeXt ``LayerNorm2d``)."""

    def forward(self, x):
        return super().forward(x.transpose(1, -1)).transpose(1, -1)


class ScaledEmbedding(nn.Embedding):
    """Gemma/BART ``*ScaledWordEmbedding``: the lookup times a constant."""

    def __init__(self, *args, scale: float, **kw):
        super().__init__(*args, **kw)
        self.register_buffer("embed_scale", torch.tensor(scale), persistent=False)

    def forward(self, ids):
        return super().forward(ids) * self.embed_scale


class PositionalEmbedding(nn.Embedding):
    """BART ``LearnedPositionalEmbedding``: looks up positions, not the ids it is given."""

    def forward(self, ids):
        return super().forward(torch.arange(ids.shape[1]).expand_as(ids))


_SUBCLASSES = {
    "linear-scaled": (lambda: ScaledLinear(5, 4), (3, 5), True),
    "linear-plain": (lambda: PlainLinear(5, 4), (3, 5), True),
    "linear-masked": (lambda: MaskedLinear(5, 5), (3, 5), False),
    "embedding-scaled": (lambda: ScaledEmbedding(11, 4, padding_idx=0, scale=2.5), None, True),
    "embedding-positions": (lambda: PositionalEmbedding(11, 4), None, False),
    "conv-causal": (lambda: CausalConv1d(3, 4, 3), (3, 8), False),
    "conv-weight-std": (lambda: StdConv2d(3, 4, 3, padding=1), (3, 5, 5), False),
    "layernorm-channels-first": (lambda: _randomize_(ChannelsFirstLayerNorm(3)), (3, 4, 4), False),
}


@pytest.mark.parametrize("name", list(_SUBCLASSES))
def test_subclass_overriding_forward_is_verified(name):
    """A subclass of a supported class is captured only when its forward is the stock computation (times a
    constant); otherwise it is reported, never given the stock rule's (wrong) gradient."""
    make, shape, exact = _SUBCLASSES[name]
    model = nn.Sequential(make(), nn.Tanh(), nn.Flatten(1), nn.LazyLinear(2))
    x = torch.randint(0, 11, (4, 3)) if shape is None else torch.randn(4, *shape)
    model(x)  # materialize the lazy head
    if exact:
        cap, batch, ref = _capture_vs_loop(model, x)
        assert cap.report().ok and "0.weight" in batch.params
        tiny.assert_grads_close(batch.per_example_grads(), ref)
        return
    with pytest.warns(UserWarning, match="overrides"):
        cap, batch, ref = _capture_vs_loop(model, x, partial=True)
    assert "overrides" in _unsupported(cap)["0"]
    assert not any(n.startswith("0.") for n in batch.params)
    tiny.assert_grads_close(batch.per_example_grads(), ref, names=["3.weight", "3.bias"])


def _tiny_gemma():
    from transformers import GemmaConfig, GemmaForCausalLM

    cfg = GemmaConfig(vocab_size=tiny.VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=64)
    model = GemmaForCausalLM(cfg).float()
    for module in model.modules():
        if type(module).__name__ == "GemmaRMSNorm":
            _randomize_(module)
    return model


def test_gemma_scaled_tied_embedding_and_norms_match_loop():
    model = _tiny_gemma()
    assert type(model.model.embed_tokens).__name__ == "GemmaTextScaledWordEmbedding"
    assert model.lm_head.weight is model.model.embed_tokens.weight
    rows, ids, mask, labels, pos = _lm_batch([5, 8, 3])
    ref = tiny.reference_grads(model, rows, _lm_single_loss)
    with gradtrace.capture(model, options=CaptureOptions(verify=True)) as cap:
        out = model(input_ids=ids, attention_mask=mask, position_ids=pos)
        tiny.lm_example_loss(out.logits, labels).mean().backward()
    assert cap.report().ok, str(cap.report())
    assert _kinds(cap)["model.norm"] == "rmsnorm(1+w)"
    batch = cap.batches[0]
    assert set(batch.params) == set(tiny.trainable(model))
    tiny.assert_grads_close(batch.per_example_grads(), ref)

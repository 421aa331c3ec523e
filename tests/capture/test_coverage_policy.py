"""Coverage is never silent (issue #31, item 2): every capture reports the share of trainable parameters it captures
per example; one it cannot capture stops the capture with an error naming it and the fix, unless the user opts into
a partial capture -- whose share is then recorded in the store, and shown by ``gradtrace inspect``."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn
from typer.testing import CliRunner

import gradtrace
from gradtrace.capture.coverage import Coverage, CoverageError, recorded_coverage
from gradtrace.cli import app
from gradtrace.options import CaptureOptions


class ConvNet(nn.Module):
    """A capturable conv and head around a grouped ``Conv1d`` (no per-example rule: reported unsupported)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Conv1d(2, 4, 3, padding=1)
        self.grouped = nn.Conv1d(4, 4, 3, padding=1, groups=2)
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.grouped(torch.tanh(self.inp(x)))).mean(-1))


def _numel(model, prefix):
    return sum(p.numel() for n, p in model.named_parameters() if n.startswith(prefix))


def _data(count=6, batch=3, seed=0):
    gen = torch.Generator().manual_seed(seed)
    xs, ys = torch.randn(count, 2, 5, generator=gen), torch.randint(0, 3, (count,), generator=gen)
    return [(xs[i:i + batch], ys[i:i + batch]) for i in range(0, count, batch)]


def test_an_uncapturable_trainable_layer_stops_the_capture_naming_it_and_the_fixes():
    model = ConvNet()
    total = sum(p.numel() for p in model.parameters())
    captured = total - _numel(model, "grouped.")
    with pytest.raises(CoverageError) as caught:
        gradtrace.capture(model)
    message = str(caught.value)
    assert isinstance(caught.value, ValueError)
    assert "grouped.weight, grouped.bias in grouped (Conv1d: grouped convolution (groups=2)" in message
    assert f"({captured:,} of {total:,} elements)" in message
    assert "CaptureOptions(exclude=['grouped'])" in message and "--exclude grouped" in message
    assert "requires_grad=False" in message and "partial=True" in message and "--partial" in message
    assert caught.value.coverage.share == captured / total
    # gradtrace.collect refuses it before any gradient
    with pytest.raises(CoverageError, match=r"grouped\.weight"):
        gradtrace.collect(model, _data())


def test_excluding_it_is_no_error_and_counts_in_the_share_as_excluded(tmp_path):
    model = ConvNet()
    total = sum(p.numel() for p in model.parameters())
    store = gradtrace.collect(model, _data(), store=tmp_path / "s", options=CaptureOptions(exclude=["grouped"]))
    coverage = recorded_coverage(store.manifest)
    assert coverage is not None and not coverage.partial
    assert coverage.share == (total - _numel(model, "grouped.")) / total < 1
    assert {(e.name, e.module, e.reason) for e in coverage.left_out} == {
        ("grouped.weight", "grouped", "excluded"), ("grouped.bias", "grouped", "excluded")}
    assert "left out: grouped (excluded by you)" in coverage.line()
    # a layers= pattern leaves the others out on purpose too
    cap = gradtrace.capture(model, options=CaptureOptions(layers=["head"]))
    assert cap.coverage().share == _numel(model, "head.") / total
    assert {e.reason for e in cap.coverage().left_out} == {"excluded"}
    assert "coverage: " in str(cap.report()) and "excluded by you" in str(cap.report())


def test_partial_capture_records_the_exact_share_in_the_store_and_inspect_shows_it(tmp_path):
    model = ConvNet()
    total = sum(p.numel() for p in model.parameters())
    left = _numel(model, "grouped.")
    with pytest.warns(UserWarning, match="grouped"):
        store = gradtrace.collect(model, _data(), store=tmp_path / "s", options=CaptureOptions(partial=True))
    assert len(store) == 6 and {n for n, _ in store.spec.params} == {"inp.weight", "inp.bias", "head.weight",
                                                                     "head.bias"}
    recorded = json.loads((tmp_path / "s" / "manifest.json").read_text())["config"]["gradtrace"]["coverage"]
    assert recorded["share"] == (total - left) / total
    assert (recorded["captured"], recorded["trainable"]) == (total - left, total)
    assert (recorded["captured_params"], recorded["trainable_params"]) == (4, 6)
    assert recorded["partial"] is True and recorded["left_out_by_reason"] == {"unsupported": 2}
    assert [e["name"] for e in recorded["left_out"]] == ["grouped.weight", "grouped.bias"]
    assert {e["numel"] for e in recorded["left_out"]} == {4 * 2 * 3, 4}
    result = CliRunner().invoke(app, ["inspect", str(tmp_path / "s")], terminal_width=400)
    assert result.exit_code == 0, result.output
    flat = " ".join(result.output.split())
    percent = f"{int((total - left) / total * 1000) / 10:.1f}%"
    assert (f"coverage {percent} of trainable parameters ({total - left:,} of {total:,} elements); left out: "
            "grouped (unsupported) (collected with --partial / partial=True)") in flat
    shown = json.loads(CliRunner().invoke(app, ["inspect", str(tmp_path / "s"), "--json"]).stdout)
    assert shown["coverage"]["share"] == recorded["share"]
    # scores of that store carry it (the report shows it even for scores computed in Python, without a path)
    with pytest.warns(UserWarning, match="grouped"):
        queries = gradtrace.collect(model, _data()[:1], options=CaptureOptions(partial=True))
    scores = gradtrace.Attributor("grad_dot", store).score(queries, topk=2)
    assert scores.meta["coverage"]["share"] == recorded["share"]
    from gradtrace.report.header import training_coverage

    assert training_coverage(scores.meta).percent == percent


class FunctionalUse(nn.Module):
    """``lin``'s parameters applied with ``F.linear``: its forward hooks never see them."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(5, 5)
        self.out = nn.Linear(5, 2)

    def forward(self, x):
        return self.out(torch.tanh(nn.functional.linear(x, self.lin.weight, self.lin.bias)))


def test_functional_use_raises_at_the_first_backward_unless_partial():
    model = FunctionalUse()
    cap = gradtrace.capture(model)  # nothing is known wrong before a backward pass
    assert cap.coverage().share == 1.0
    found = r"lin\.weight, lin\.bias in lin \(it received gradients no hook"
    with pytest.raises(CoverageError, match=found) as caught, cap:
        model(torch.randn(4, 5)).sum().backward()
    assert "(found at backward pass 0)" in str(caught.value) and "exclude=['lin']" in str(caught.value)
    with pytest.warns(UserWarning, match="functional use"), \
            gradtrace.capture(model, options=CaptureOptions(partial=True)) as cap:
        model(torch.randn(4, 5)).sum().backward()
    coverage = cap.coverage()
    assert coverage.share == _numel(model, "out.") / sum(p.numel() for p in model.parameters())
    assert [(e.name, e.reason) for e in coverage.left_out] == [("lin.weight", "functional"), ("lin.bias", "functional")]
    # leaving lin out is the fix: nothing is then missing
    with gradtrace.capture(model, options=CaptureOptions(exclude=["lin"])) as cap:
        model(torch.randn(4, 5)).sum().backward()
    assert [e.reason for e in cap.coverage().left_out] == ["excluded", "excluded"] and len(cap.batches) == 1


class HalfRows(nn.Module):
    """``side`` runs on half of the batch's rows: its rows cannot be matched to examples (found while running)."""

    def __init__(self) -> None:
        super().__init__()
        self.main = nn.Linear(4, 2)
        self.side = nn.Linear(4, 2)

    def forward(self, x):
        return self.main(x) + self.side(x[: x.shape[0] // 2]).sum()


def test_a_call_left_out_while_running_raises_unless_partial():
    model = HalfRows()
    with pytest.raises(CoverageError, match=r"\(found while running\): side\.weight, side\.bias in side \(its input "
                                            r"has 2 rows but the batch has 4"), gradtrace.capture(model):
        model(torch.randn(4, 4)).sum().backward()
    with pytest.warns(UserWarning, match="side is left out"), \
            gradtrace.capture(model, options=CaptureOptions(partial=True)) as cap:
        model(torch.randn(4, 4)).sum().backward()
    assert cap.coverage().share == 10 / 20 and {e.reason for e in cap.coverage().left_out} == {"runtime"}


class SharedPositions(nn.Module):
    """``pos`` is called on one row shared by the batch (GPT-2's position embedding)."""

    def __init__(self) -> None:
        super().__init__()
        self.pos = nn.Linear(4, 4)
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        return self.head(x + self.pos(torch.ones(1, 4)))


def test_broadcast_skip_leaves_the_shared_call_out_as_asked():
    model = SharedPositions()
    with pytest.warns(UserWarning, match="pos is left out"), \
            gradtrace.capture(model, options=CaptureOptions(broadcast="skip")) as cap:
        model(torch.randn(3, 4)).sum().backward()
    coverage = cap.coverage()
    assert [(e.name, e.reason) for e in coverage.left_out] == [("pos.weight", "excluded"), ("pos.bias", "excluded")]
    assert coverage.share == 10 / 30


def test_share_is_one_on_a_fully_captured_model_with_tied_weights_counted_once():
    from tests import tiny

    model = tiny.gpt2(tied=True)
    cap = gradtrace.capture(model)
    coverage = cap.coverage()
    unique = {id(p): p for p in model.parameters()}
    assert coverage.share == 1.0 and not coverage.left_out
    assert coverage.trainable == sum(p.numel() for p in unique.values())
    assert coverage.trainable_params == len(unique) < len(list(model.named_parameters(remove_duplicate=False)))
    assert coverage.line().startswith("100.0% of trainable parameters")
    # frozen parameters are not trainable: not counted
    model.transformer.wte.weight.requires_grad_(False)
    frozen = gradtrace.capture(model).coverage()
    assert frozen.share == 1.0 and frozen.trainable == coverage.trainable - model.transformer.wte.weight.numel()


def test_the_error_names_six_parameters_then_how_many_more_and_a_glob_for_repeated_blocks():
    model = nn.Sequential(*[nn.Sequential(nn.Linear(4, 4), nn.Conv1d(4, 4, 1, groups=2)) for _ in range(5)])
    with pytest.raises(CoverageError) as caught:
        gradtrace.capture(model)
    message = str(caught.value)
    assert "0.1.weight, 0.1.bias in 0.1" in message and "2.1.weight, 2.1.bias in 2.1" in message
    assert "3.1.weight" not in message and "; and 4 more." in message
    assert "CaptureOptions(exclude=['*.1'])" in message and "--exclude *.1" in message
    # the suggested exclusion works, and is exactly the uncapturable modules
    cap = gradtrace.capture(model, options=CaptureOptions(exclude=["*.1"]))
    assert len(cap.handlers) == 5 and {e.reason for e in cap.coverage().left_out} == {"excluded"}


def test_a_store_without_recorded_coverage_still_opens(tmp_path):
    spec = gradtrace.store.GradientSpec(params=[("w", 3)], projection=None,
                                        convention={"reduction": "sum", "example_loss": "sum"})
    writer = gradtrace.store.ShardWriter(tmp_path / "old", spec)
    writer.put(["a"], torch.ones(1, 3))
    writer.close()
    store = gradtrace.GradientStore.open(tmp_path / "old")
    assert len(store) == 1 and recorded_coverage(store.manifest) is None
    result = CliRunner().invoke(app, ["inspect", str(tmp_path / "old")], terminal_width=400)
    assert result.exit_code == 0, result.output
    assert "coverage not recorded" in " ".join(result.output.split())


def test_coverage_round_trips_through_its_recorded_form():
    model = ConvNet()
    coverage = gradtrace.capture(model, options=CaptureOptions(partial=True)).coverage()
    again = Coverage.from_dict(json.loads(json.dumps(coverage.to_dict())))
    assert (again.captured, again.trainable, again.partial, again.left_out) == \
        (coverage.captured, coverage.trainable, True, coverage.left_out)
    assert again.line() == coverage.line()
    capped = Coverage.from_dict(coverage.to_dict(limit=1))
    assert len(capped.left_out) == 1 and capped.left_out_total == 2 and "(2 parameters in all)" in capped.line()

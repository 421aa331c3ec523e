"""``gradtrace.collect_checkpoints``: one collection per checkpoint, each equal to a plain ``collect`` there.

Three checkpoints of a tiny random-init GPT-2 (its weights perturbed), saved as ``torch.save``-d and
``.safetensors`` state dicts and as ``save_pretrained`` directories. Every store must hold exactly the rows a plain
``gradtrace.collect`` at that checkpoint's weights writes (the same code path: ``torch.equal``), and their ensemble
the same scores.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch

import gradtrace
from gradtrace.capture import checkpoints as per_checkpoint
from gradtrace.common.errors import UsageError
from gradtrace.common.provenance import resolve_paths
from gradtrace.options import CaptureOptions, StoreOptions
from gradtrace.store import GradientStore, SpecMismatch, model_fingerprint
from tests.tiny import VOCAB, gpt2

RANK = 4


def _batches(seed: int, count: int = 3, size: int = 4, length: int = 9) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        ids = torch.randint(3, VOCAB, (size, length), generator=gen)
        mask = torch.ones_like(ids)
        mask[0, -3:] = 0  # a padded row
        out.append({"input_ids": ids, "attention_mask": mask})
    return out


def _perturbed(base: torch.nn.Module, seed: int) -> torch.nn.Module:
    model = copy.deepcopy(base)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * torch.randn(param.shape, generator=gen))
    return model


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The base model, three checkpoints (models, state-dict files of both kinds, model directories), data."""
    from safetensors.torch import save_model

    root = tmp_path_factory.mktemp("checkpoints")
    torch.manual_seed(0)
    base = gpt2().eval()
    models = [_perturbed(base, seed) for seed in (1, 2, 3)]
    files, dirs = [], []
    for c, model in enumerate(models):
        step = 100 * (c + 1)
        if c == 1:  # safetensors keeps one of the tied weights (wte / lm_head): loading must accept that
            files.append(root / f"step-{step}.safetensors")
            save_model(model, str(files[-1]))
        else:
            files.append(root / f"step-{step}.pt")
            torch.save(model.state_dict(), files[-1])
        dirs.append(root / f"checkpoint-{step}")
        model.save_pretrained(dirs[-1])
    return {"base": base, "models": models, "files": files, "dirs": dirs, "train": _batches(0),
            "queries": _batches(1, count=1, size=3)}


def _plain(run, tmp_path):
    """Plain ``gradtrace.collect`` at each checkpoint's weights: stores of the training data, query sets."""
    stores, queries = [], []
    for c, model in enumerate(run["models"]):
        projection = gradtrace.LoGra(rank=RANK)
        stores.append(gradtrace.collect(model, run["train"], store=tmp_path / f"plain-{c}",
                                        options=CaptureOptions(projection=projection)))
        queries.append(gradtrace.collect(model, run["queries"], options=CaptureOptions(projection=projection)))
    return stores, queries


def _weights(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def _assert_same_rows(got, want):
    assert list(got.ids) == list(want.ids)
    assert torch.equal(got.read(0, len(got)), want.read(0, len(want)))


@pytest.mark.parametrize("kind", ["state_dict", "model_dir"])
def test_each_store_equals_a_plain_collect_and_the_ensemble_matches(run, tmp_path, kind):
    model = copy.deepcopy(run["base"])
    before = _weights(model)
    if kind == "state_dict":
        checkpoints, names = run["files"], ["step-100", "step-200", "step-300"]
    else:  # as gradtrace.integrations.checkpoints(store) lists them
        checkpoints = [{"step": 100 * (c + 1), "path": str(d)} for c, d in enumerate(run["dirs"])]
        names = ["checkpoint-100", "checkpoint-200", "checkpoint-300"]
    projection = gradtrace.LoGra(rank=RANK)
    stores = gradtrace.collect_checkpoints(checkpoints, iter(run["train"]), model=model, out=tmp_path / "stores",
                                           options=CaptureOptions(projection=projection))
    queries = gradtrace.collect_checkpoints(checkpoints, run["queries"], model=model,
                                            options=CaptureOptions(projection=projection))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # the model's weights restored
    assert [s.root.name for s in stores] == names and all(isinstance(q, gradtrace.GradientSet) for q in queries)
    plain_stores, plain_queries = _plain(run, tmp_path)
    for c in range(3):
        _assert_same_rows(stores[c], plain_stores[c])
        _assert_same_rows(queries[c], plain_queries[c])
        config = resolve_paths(stores[c].manifest["config"], stores[c].root)
        assert config["checkpoint"]["weights"] == model_fingerprint(run["models"][c]) == stores[c].spec.model
        assert config["checkpoint"]["kind"] == kind and config["checkpoint"]["name"] == names[c]
        path = run["files"][c] if kind == "state_dict" else run["dirs"][c]
        assert config["checkpoint"]["path"] == str(path)
        assert config.get("model") == (str(path) if kind == "model_dir" else None)  # what gradtrace score loads
    got = gradtrace.Ensemble("grad_dot", stores).score(queries, topk=5)
    want = gradtrace.Ensemble("grad_dot", plain_stores).score(plain_queries, topk=5)
    assert torch.equal(got.matrix, want.matrix)


def test_resume_keeps_finished_stores_and_finishes_the_interrupted_one(run, tmp_path, monkeypatch):
    calls = []
    real = per_checkpoint.collect

    def interrupted(batches):
        yield batches[0]
        raise KeyboardInterrupt

    def counting(model, data, *args, **kwargs):
        calls.append(kwargs["store"].name)
        if len(calls) == 2 and not kwargs["store_options"].resume:
            data = interrupted(data)
        return real(model, data, *args, **kwargs)

    monkeypatch.setattr(per_checkpoint, "collect", counting)
    model, out = copy.deepcopy(run["base"]), tmp_path / "stores"
    before = _weights(model)
    with pytest.raises(KeyboardInterrupt):
        gradtrace.collect_checkpoints(run["files"], run["train"], model=model, out=out,
                                      options=CaptureOptions(projection=gradtrace.LoGra(rank=RANK)))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    partial = GradientStore.open(out / "step-200", allow_incomplete=True)
    assert not partial.complete and len(partial) == 4 and not (out / "step-300").exists()
    with pytest.raises(UsageError, match=r"already holds? a store: pass store_options=StoreOptions\(resume=True\)"):
        gradtrace.collect_checkpoints(run["files"], run["train"], model=model, out=out,
                                      options=CaptureOptions(projection=gradtrace.LoGra(rank=RANK)))
    with pytest.raises(SpecMismatch, match="cannot resume"):  # a finished store of another projection is refused
        gradtrace.collect_checkpoints(run["files"], run["train"], model=model, out=out,
                                      options=CaptureOptions(projection=gradtrace.LoGra(rank=2)),
                                      store_options=StoreOptions(resume=True))
    calls.clear()
    stores = gradtrace.collect_checkpoints(run["files"], run["train"], model=model, out=out,
                                           options=CaptureOptions(projection=gradtrace.LoGra(rank=RANK)),
                                           store_options=StoreOptions(resume=True))
    assert calls == ["step-200", "step-300"]  # step-100 was complete: kept, not collected again
    plain_stores, _ = _plain(run, tmp_path)
    for store, plain in zip(stores, plain_stores):
        assert store.complete
        _assert_same_rows(store, plain)


def test_bad_input_is_refused_with_the_fix_and_loses_nothing(run, tmp_path):
    model, train = copy.deepcopy(run["base"]), run["train"]
    before = _weights(model)
    cases = [
        ([], {}, r"non-empty list of checkpoints"),
        ([tmp_path / "nope.pt"], {"model": model}, r"checkpoint .*nope\.pt does not exist; give existing"),
        ([run["files"][0]], {}, r"state-dict file .*step-100\.pt is loaded into a model: pass model="),
        ([run["files"][0]], {"model": model, "store_options": StoreOptions(resume=True)},
         r"resume/overwrite apply to stores: pass out=DIR"),
        ([tmp_path], {"model": model}, r"directory without config\.json"),
    ]
    for checkpoints, kwargs, message in cases:
        with pytest.raises(UsageError, match=message):
            gradtrace.collect_checkpoints(checkpoints, train, **kwargs)
    twins = [tmp_path / "a" / "ckpt.pt", tmp_path / "b" / "ckpt.pt"]
    for path in twins:
        path.parent.mkdir()
        torch.save(model.state_dict(), path)
    with pytest.raises(UsageError, match=r"store name 'ckpt' would be used for 2 checkpoints \(.*a/ckpt\.pt, .*b/ckpt"):
        gradtrace.collect_checkpoints(twins, train, model=model, out=tmp_path / "twins")
    # a state dict of another model: the keys named, the store of the checkpoint before it kept, weights restored
    other = tmp_path / "other.pt"
    state = {**model.state_dict(), "extra.weight": torch.zeros(2)}
    del state["transformer.h.1.mlp.c_fc.weight"]
    torch.save(state, other)
    with pytest.raises(UsageError, match=r"does not fit the model: 1 missing \(transformer\.h\.1\.mlp\.c_fc\.weight\); "
                                         r"1 unexpected \(extra\.weight\) keys"):
        gradtrace.collect_checkpoints([run["files"][0], other], train, model=model, out=tmp_path / "out")
    assert GradientStore.open(tmp_path / "out" / "step-100").complete
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert json.loads((tmp_path / "out" / "step-100" / "manifest.json").read_text())["config"]["checkpoint"]["name"] \
        == "step-100"

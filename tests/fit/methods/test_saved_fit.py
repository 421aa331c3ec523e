"""Saved method fits (gradtrace.fit.methods.saved): trak's kernel and trackstar's second moment / preconditioner, saved
and loaded, score as the fitted method (to float32 round-off); a corrupted, edited, mismatched or foreign fit is
refused."""

import json

import pytest
import torch

import gradtrace
from gradtrace.fit.methods import FitError, MissingStage, load_fit, save_fit
from gradtrace.loss.functions import classification_loss
from gradtrace.options import CaptureOptions
from gradtrace.store.spec import SpecMismatch
from tests.fit.methods.test_trackstar import _setup as trackstar_setup
from tests.fit.methods.test_trak import _setup as trak_setup

EPS32 = torch.finfo(torch.float32).eps


def _scores(method, train, query):
    return gradtrace.Attributor(method, train).score(query, matrix=True).matrix


def _assert_same_scores(got, want, method, train, query):
    """Two computations of one score matrix from the same fitted state (a saved and loaded copy, or the same damping
    set two ways): equal up to float32 round-off, whatever the BLAS kernel, CPU or thread count. Each score is one
    float32 product of D prepared terms, ``q'_k g'_k``; another reduction order moves it by at most D eps32 times
    ``sum_k |q'_k g'_k|``, and the float64 query preparation cast to float32 (trackstar: each row's float32 metric
    norm, D terms) by about as much again: the bound is 2 D eps32 sum_k |q'_k g'_k|, elementwise."""
    attr = gradtrace.Attributor(method, train)
    attr.ready()
    prepared = method.prepare_queries(query.read(0, len(query)).to(torch.float32)).double().abs()
    rows = method.prepare_train(train.read(0, len(train)).to(torch.float32)).double().abs()
    bound = 2 * train.spec.dim * EPS32 * (prepared @ rows.t())
    assert bool(((got.double() - want.double()).abs() <= bound).all()), float((got - want).abs().max())


def test_a_saved_trak_kernel_scores_exactly_as_the_fitted_one(tmp_path):
    model, batches, queries, *_ = trak_setup()
    logra = gradtrace.LoGra(rank=2, seed=0)
    train = gradtrace.collect(model, batches, classification_loss, options=CaptureOptions(projection=logra))
    query = gradtrace.collect(model, queries, classification_loss, options=CaptureOptions(projection=logra))
    attr = gradtrace.Attributor("trak", train).fit(model, batches, classification_loss)
    want = attr.score(query, matrix=True).matrix
    assert save_fit(attr, tmp_path / "fit", meta={"by": "test"}) == tmp_path / "fit"
    loaded = load_fit(tmp_path / "fit", "trak")
    assert loaded.reweighted is True and loaded.examples == 30 and loaded.meta == {"by": "test"}
    # the same float64 eigendata (the file holds its bytes) through the same operations: the same scores
    _assert_same_scores(_scores(loaded, train, query), want, attr.method, train, query)
    # damping changed at load, no refit: the same as the fitted kernel with that damping
    attr.method.damping = 0.7
    _assert_same_scores(_scores(load_fit(tmp_path / "fit", damping=0.7), train, query),
                        attr.score(query, matrix=True).matrix, attr.method, train, query)
    absolute = load_fit(tmp_path / "fit", damping=1e-3, damping_mode="absolute")
    assert absolute.lam == 1e-3
    # the fit is bound to its gradients: other projections are refused at scoring
    other = gradtrace.collect(model, batches, classification_loss,
                              options=CaptureOptions(projection=gradtrace.LoGra(rank=2, seed=1)))
    with pytest.raises(SpecMismatch, match="trak: the kernel was fitted for other gradients"):
        gradtrace.Attributor(loaded, other).score(query)


@pytest.mark.parametrize("precondition", [None, "autocorrelation", "autocorrelation-parameter", "kfac"])
def test_a_saved_trackstar_fit_scores_exactly_as_the_fitted_one(tmp_path, precondition):
    model, optimizer, batches, queries, *_ = trackstar_setup(seed=6)
    logra = gradtrace.LoGra(rank=2, seed=4)
    train = gradtrace.collect(model, batches, classification_loss, options=CaptureOptions(projection=logra))
    query = gradtrace.collect(model, queries, classification_loss, options=CaptureOptions(projection=logra))
    structure = "parameter" if precondition == "autocorrelation-parameter" else "joint"
    precondition = "autocorrelation" if structure == "parameter" else precondition
    attr = gradtrace.Attributor("trackstar", train, precondition=precondition, structure=structure)
    attr.fit(model, batches, classification_loss, optimizer=optimizer)
    want = attr.score(query, matrix=True).matrix
    save_fit(attr.method, tmp_path / "fit")
    assert (tmp_path / "fit" / "precondition" / "curvature.json").exists() == (precondition == "kfac")
    loaded = load_fit(tmp_path / "fit", "trackstar")
    # no arithmetic between the two: the safetensors file holds the tensor's bytes
    torch.testing.assert_close(loaded.denominator, attr.method.denominator, rtol=0, atol=0)
    assert loaded.structure == structure and loaded.options() == attr.method.options()
    if precondition == "autocorrelation":
        assert len(loaded.vectors) == (len(train.spec.params) if structure == "parameter" else 1)
        for a, b in zip(loaded.vectors, attr.method.vectors):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    _assert_same_scores(_scores(loaded, train, query), want, attr.method, train, query)
    if precondition is None:
        with pytest.raises(ValueError, match="no preconditioner, so there is no damping"):
            load_fit(tmp_path / "fit", damping=0.5)
        return
    # a damping given at load goes to the preconditioner: equal to setting it on the fitted one
    if precondition == "autocorrelation":
        attr.method.damping = 0.5
    else:
        attr.method.curvature.damping = 0.5
    _assert_same_scores(_scores(load_fit(tmp_path / "fit", damping=0.5), train, query),
                        attr.score(query, matrix=True).matrix, attr.method, train, query)


def test_a_trackstar_fit_whose_preconditioner_was_replaced_is_refused(tmp_path):
    model, optimizer, batches, queries, *_ = trackstar_setup(seed=7)
    train = gradtrace.collect(model, batches, classification_loss)
    attr = gradtrace.Attributor("trackstar", train, precondition="kfac")
    attr.fit(model, batches, classification_loss, optimizer=optimizer)
    save_fit(attr, tmp_path / "fit")
    # another curvature saved over the preconditioner (a later save that stopped before its fit.json)
    other = gradtrace.Attributor("kfac", train, damping=0.3).fit(model, batches[:2], classification_loss)
    other.method.curvature.save(tmp_path / "fit" / "precondition", overwrite=True)
    with pytest.raises(FitError, match="another preconditioner than the fit"):
        load_fit(tmp_path / "fit")


def test_bad_fits_are_refused_with_the_fix(tmp_path):
    model, batches, queries, *_ = trak_setup(1)
    train = gradtrace.collect(model, batches, classification_loss)
    with pytest.raises(MissingStage, match="trak needs its kernel"):
        save_fit(gradtrace.Attributor("trak", train), tmp_path / "unfitted")
    kfac = gradtrace.Attributor("kfac", train).fit(model, batches, classification_loss)
    with pytest.raises(TypeError, match=r"save its curvature: attr\.method\.curvature\.save"):
        save_fit(kfac, tmp_path / "kfac")
    with pytest.raises(TypeError, match="no fitted state to save"):
        save_fit(gradtrace.Attributor("grad_dot", train), tmp_path / "dot")
    kfac.method.curvature.save(tmp_path / "kfac")
    with pytest.raises(FitError, match=r"holds no saved method fit \(a fitted curvature"):
        load_fit(tmp_path / "kfac")
    with pytest.raises(FitError, match=r"no fit\.json"):
        load_fit(tmp_path / "nothing")

    attr = gradtrace.Attributor("trak", train, reweight=False, mode="primal").fit()
    save_fit(attr, tmp_path / "fit")
    with pytest.raises(FitError, match="holds a trak fit, not a trackstar one"):
        load_fit(tmp_path / "fit", "trackstar")
    manifest = tmp_path / "fit" / "fit.json"
    info = json.loads(manifest.read_text())
    tensor_file = tmp_path / "fit" / info["tensors"]["file"]
    data = bytearray(tensor_file.read_bytes())
    data[-3] ^= 0xFF  # one flipped bit in the kernel's eigenvectors
    tensor_file.write_bytes(bytes(data))
    with pytest.raises(FitError, match="corrupted or was replaced"):
        load_fit(tmp_path / "fit")
    save_fit(attr, tmp_path / "fit", overwrite=True)  # saved again: readable again
    load_fit(tmp_path / "fit")
    info = json.loads(manifest.read_text())
    info["damping"] = 5.0  # edited by hand
    manifest.write_text(json.dumps(info))
    with pytest.raises(FitError, match="edited or corrupted"):
        load_fit(tmp_path / "fit")


def test_a_fit_whose_tensors_do_not_match_its_spec_is_refused(tmp_path):
    """A writer bug (or a fit assembled by hand) that passes the checksums still meets the shape checks."""
    from gradtrace.store.artifact import write_artifact

    model, batches, queries, *_ = trak_setup(2)
    train = gradtrace.collect(model, batches, classification_loss)
    attr = gradtrace.Attributor("trak", train, reweight=False, mode="primal").fit()
    fields, tensors = attr.method.fit_state(tmp_path)
    dim = train.spec.dim
    for bad, match in (({**tensors, "values": tensors["values"][:-1]}, rf"values is torch.float64 \({dim - 1},\)"),
                       ({**tensors, "values": tensors["values"].float()}, "expected torch.float64"),
                       ({**tensors, "values": tensors["values"] * float("nan")}, "NaN/inf"),
                       ({**tensors, "extra": tensors["values"].clone()}, "does not use")):
        write_artifact(tmp_path / "bad", "fit", "gradtrace-method-fit", 2, {"method": "trak", **fields, "meta": {}},
                       bad)
        with pytest.raises(FitError, match=match):
            load_fit(tmp_path / "bad")


def test_a_per_parameter_autocorrelation_fit_checks_every_block(tmp_path):
    from gradtrace.store.artifact import write_artifact

    model, optimizer, batches, *_ = trackstar_setup(seed=8)
    train = gradtrace.collect(model, batches, classification_loss)
    attr = gradtrace.Attributor("trackstar", train, precondition="autocorrelation", structure="parameter")
    attr.fit(model, optimizer=optimizer)
    fields, tensors = attr.method.fit_state(tmp_path)
    assert sorted(k for k in tensors if k.startswith("vectors")) == [f"vectors.{b}" for b in range(4)]
    short = tensors["vectors.1"][:-1]
    for bad, match in (({**tensors, "vectors.1": short}, r"vectors\.1 is torch\.float64"),
                       ({k: v for k, v in tensors.items() if k != "vectors.3"}, "lacks its 'vectors.3' tensor"),
                       ({**tensors, "vectors": tensors["vectors.0"]}, "does not use")):
        write_artifact(tmp_path / "bad", "fit", "gradtrace-method-fit", 2,
                       {"method": "trackstar", **fields, "meta": {}}, bad)
        with pytest.raises(FitError, match=match):
            load_fit(tmp_path / "bad")
    write_artifact(tmp_path / "bad", "fit", "gradtrace-method-fit", 2,
                   {"method": "trackstar", **fields, "precondition": None, "meta": {}}, tensors)
    with pytest.raises(FitError, match="records structure='parameter', which this fit cannot have"):
        load_fit(tmp_path / "bad")


def test_a_dual_trak_fit_reads_its_store_and_refuses_another(tmp_path):
    """A dual fit (N < D) keeps the Gram matrix's eigendata and reads the training rows at every scoring: saved, it
    records its store (relative to the fit, and absolute) with the store's fingerprint."""
    import shutil

    model, batches, queries, *_ = trak_setup(3)
    train = gradtrace.collect(model, batches, classification_loss, store=tmp_path / "project" / "store")
    query = gradtrace.collect(model, queries, classification_loss)
    attr = gradtrace.Attributor("trak", train).fit(model, batches, classification_loss)
    assert attr.method.mode_used == "dual" and attr.method.reweighted
    want = attr.score(query, matrix=True).matrix
    save_fit(attr, tmp_path / "project" / "fit")
    assert json.loads((tmp_path / "project" / "fit" / "fit.json").read_text())["rows"]["path"] == "../store"
    loaded = load_fit(tmp_path / "project" / "fit")
    assert loaded.mode_used == "dual" and loaded.row_weights is not None
    _assert_same_scores(_scores(loaded, train, query), want, attr.method, train, query)
    # a copied project (fit and store together) reads its own store; a moved store alone is named, and can be given
    shutil.copytree(tmp_path / "project", tmp_path / "copy")
    shutil.rmtree(tmp_path / "project" / "store")
    _assert_same_scores(_scores(load_fit(tmp_path / "copy" / "fit"), train, query), want, attr.method, train, query)
    with pytest.raises(FitError, match=r"reads the training rows of store .* which is not there.*store=\.\.\."):
        load_fit(tmp_path / "project" / "fit")
    given = load_fit(tmp_path / "project" / "fit", store=tmp_path / "copy" / "store")
    _assert_same_scores(_scores(given, train, query), want, attr.method, train, query)
    # another store (other rows) is refused, and so is a dual fit of rows held in memory
    other = gradtrace.collect(model, batches[:3], classification_loss, store=tmp_path / "other")
    with pytest.raises(FitError, match="is not the one this dual trak fit was made from"):
        load_fit(tmp_path / "copy" / "fit", store=other)
    in_memory = gradtrace.collect(model, batches, classification_loss)
    with pytest.raises(TypeError, match=r"held in memory .* fit it on a GradientStore on disk"):
        save_fit(gradtrace.Attributor("trak", in_memory, reweight=False).fit(), tmp_path / "memory")

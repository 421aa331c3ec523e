"""Ensembles over checkpoints / models: equal to the normalised weighted sum of the members' own scores, the same
top-k, members matched by id, each member fitted at its own weights, and bad input refused with the fix named."""

import copy
import json
import math
import warnings

import pytest
import torch

import gradtrace
from gradtrace.fit.methods.influence import CurvatureWeightsWarning
from gradtrace.loss.functions import classification_loss
from gradtrace.options import CaptureOptions
from gradtrace.score.ensemble import EnsembleError
from gradtrace.store import SpecMismatch
from tests.fit.methods.test_trak import Net

EPS = torch.finfo(torch.float32).eps


def _data(seed=0, n=26):
    generator = torch.Generator().manual_seed(seed)
    x, y = torch.randn(n, 5, generator=generator) * 2, torch.randint(0, 3, (n,), generator=generator)
    ids = [f"ex{i}" for i in range(n)]
    batches = [{"inputs": x[i:i + 8], "labels": y[i:i + 8], "id": ids[i:i + 8]} for i in range(0, n, 8)]
    qx, qy = torch.randn(5, 5, generator=generator), torch.randint(0, 3, (5,), generator=generator)
    queries = [{"inputs": qx, "labels": qy, "id": [f"q{i}" for i in range(5)]}]
    return batches, queries


def _checkpoints(count=3):
    """``count`` models: a random init and perturbations of it (checkpoints of different scale)."""
    torch.manual_seed(0)
    models = [Net()]
    for c in range(1, count):
        model = Net()
        model.load_state_dict(models[0].state_dict())
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(1 + c).add_(torch.randn_like(p) * 0.3)
        models.append(model)
    return models


def _reversed(batches):
    """The same examples, in reverse order (a member whose store holds another row order)."""
    out = []
    for b in reversed(batches):
        out.append({"inputs": b["inputs"].flip(0), "labels": b["labels"].flip(0), "id": list(reversed(b["id"]))})
    return out


def _members(method, projection=None, options=None, count=3):
    """Per member: its model, training gradients (member 1 in reverse row order) and query gradients, and the
    single-model Attributor fitted at its weights."""
    batches, queries = _data()
    models = _checkpoints(count)
    trains, qsets, singles = [], [], []
    for c, model in enumerate(models):
        data = _reversed(batches) if c == 1 else batches
        trains.append(gradtrace.collect(model, data, classification_loss,
                                        options=CaptureOptions(projection=projection)))
        qsets.append(gradtrace.collect(model, queries, classification_loss,
                                       options=CaptureOptions(projection=projection)))
        single = gradtrace.Attributor(method, trains[-1], block_rows=4, **(options or {}))
        singles.append(single.fit(model, batches, classification_loss))
    return models, batches, trains, qsets, singles


def _by_id(matrix, ids, order):
    """Columns of ``matrix`` (training ids ``ids``) in the order ``order``."""
    where = {ident: col for col, ident in enumerate(ids)}
    return matrix[:, [where[i] for i in order]]


def _hand(singles, trains, qsets, weights):
    """The normalised weighted sum in float64 from the single Attributors' matrices, with its float32 error bound.

    Each member's scores carry the GEMM round-off ``gamma_D |q'| |g'|`` (``gamma_D = D eps``, Higham, for the
    prepared query and training vectors, as the rows reach the product in another block layout); the
    combination adds ``C`` float32 roundings of the weighted terms. The normaliser is a float64 mean of the
    same values: its relative error is at most the largest relative element error, covered by the factor 2.
    """
    order = list(trains[0].ids)
    total, bound = 0, 0
    weights = [w / sum(weights) for w in weights]
    for single, train, query, weight in zip(singles, trains, qsets, weights):
        scores = single.score(query, topk=None, matrix=True)
        matrix = _by_id(scores.matrix.double(), scores.train_ids, order)
        factor = weight / float(matrix.abs().mean())
        total = total + factor * matrix
        bound = bound + factor * (_gemm_bound(single, train, query, order) + len(singles) * EPS * matrix.abs())
    return total, 2 * bound


def _gemm_bound(single, train, query, order):
    """``gamma_D |q'_q| |g'_i|``: the float32 round-off bound of every product of prepared vectors (``[Q, N]``)."""
    q = single.method.prepare_queries(query.vectors).double()
    g = _by_id(single.method.prepare_train(train.vectors).double().t(), train.ids, order)
    return train.dim * EPS * q.norm(dim=1)[:, None] * g.norm(dim=0)[None, :]


CASES = [("grad_dot", None, None), ("grad_cos", None, None), ("kfac", None, None), ("ekfac", None, None),
         ("ggn", None, None), ("logra", gradtrace.LoGra(rank=2, seed=1), None),
         ("trak", gradtrace.LoGra(rank=2, seed=1), None), ("kfac", None, {"damping": 0.01}),
         ("arnoldi", None, {"rank": 20}), ("cg", None, None), ("ggn_full", None, None)]


@pytest.mark.parametrize(("method", "projection", "options"), CASES,
                         ids=[f"{m}{'-' + str(o) if o else ''}" for m, _, o in CASES])
def test_ensemble_equals_the_normalised_weighted_sum(method, projection, options):
    models, batches, trains, qsets, singles = _members(method, projection, options)
    weights = [0.5, 0.2, 0.3]
    want, bound = _hand(singles, trains, qsets, weights)
    ensemble = gradtrace.Ensemble(method, trains, weights=[1.0, 0.4, 0.6], block_rows=4, **(options or {}))
    assert isinstance(ensemble, gradtrace.Ensemble)
    ensemble.fit(None, batches, classification_loss, models=models)
    scores = ensemble.score(qsets, topk=None, matrix=True)
    assert scores.train_ids == list(trains[0].ids) and scores.query_ids == list(qsets[0].ids)
    assert scores.meta["ensemble"]["weights"] == pytest.approx(weights)
    gap = (scores.matrix.double() - want).abs()
    worst = int(gap.argmax())
    assert bool((gap <= bound).all()), f"gap {float(gap.flatten()[worst]):.3g} > {float(bound.flatten()[worst]):.3g}"
    # streaming top-k in blocks of 4 rows, no matrix: the top-k of the combined scores
    streamed = gradtrace.Ensemble(method, trains, weights=weights, block_rows=4, **(options or {}))
    streamed.fit(models=models, data=batches, loss_fn=classification_loss)
    kept = streamed.score(qsets, topk=5, matrix=False)
    assert kept.matrix is None
    for largest in (True, False):
        values, index = torch.topk(want, 5, dim=1, largest=largest)
        top = kept.topk(5, largest)
        assert bool(((top.values.double() - values).abs() <= bound.gather(1, index)).all())
        assert top.ids == [[kept.train_ids[j] for j in row] for row in index.tolist()]


@pytest.mark.parametrize("method", ["grad_dot", "kfac", "trak"])
def test_ensemble_self_influence_is_the_normalised_weighted_sum_of_the_members(method):
    """``Ensemble.self_scores``: each member's own self-influence, divided by its mean absolute value, weighted,
    in member 0's id order (member 1's store holds the rows reversed)."""
    projection = gradtrace.LoGra(rank=2, seed=1) if method == "trak" else None
    models, batches, trains, qsets, singles = _members(method, projection)
    ensemble = gradtrace.Ensemble(method, trains, weights=[1.0, 0.4, 0.6], block_rows=4)
    ensemble.fit(None, batches, classification_loss, models=models)
    got = ensemble.self_scores().double()
    order = list(trains[0].ids)
    want, bound, plain_want, plain_bound = 0, 0, 0, 0
    for single, train, weight in zip(singles, trains, [0.5, 0.2, 0.3]):
        where = {ident: row for row, ident in enumerate(train.ids)}
        rows = [where[i] for i in order]
        own = single.self_scores().double()[rows]
        # each self-score q'_i . g'_i is a float32 product of length D, computed in both paths:
        # gamma_D |q'_i| |g'_i| each (Higham), then the float64 combination and one float32 rounding
        q = single.method.prepare_queries(train.vectors).double()[rows]
        g = single.method.prepare_train(train.vectors).double()[rows]
        error = 2 * train.dim * EPS * q.norm(dim=1) * g.norm(dim=1) + EPS * own.abs()
        factor = weight / float(own.abs().mean())
        want, bound = want + factor * own, bound + factor * error
        plain_want, plain_bound = plain_want + own / 3, plain_bound + error / 3
    gap = (got - want).abs()
    assert bool((gap <= 2 * bound).all()), f"{float(gap.max()):.3g} > {float(bound[gap.argmax()]):.3g}"
    plain = gradtrace.Ensemble(method, trains, normalize=False, block_rows=4)
    plain.fit(None, batches, classification_loss, models=models)
    assert bool(((plain.self_scores().double() - plain_want).abs() <= 2 * plain_bound).all())


def test_weights_scale_and_unnormalised_sum():
    models, batches, trains, qsets, singles = _members("grad_dot")
    plain = gradtrace.Ensemble("grad_dot", trains, weights=[2, 0, 2], normalize=False).score(qsets, matrix=True)
    first = singles[0].score(qsets[0], matrix=True).matrix.double()
    last = singles[2].score(qsets[2], matrix=True).matrix.double()
    want = 0.5 * first + 0.5 * last  # weights normalised to sum to 1; member 1 weighs nothing
    order = list(trains[0].ids)
    bound = 0.5 * sum(_gemm_bound(singles[c], trains[c], qsets[c], order) for c in (0, 2))
    bound = 2 * (bound + 3 * EPS * (first.abs() + last.abs()))
    assert bool(((plain.matrix.double() - want).abs() <= bound).all())
    assert plain.meta["ensemble"]["mean_abs"] is None
    # one member: normalised scores are that member's divided by their mean absolute value
    alone = gradtrace.Ensemble("grad_dot", [trains[0]]).score([qsets[0]], matrix=True).matrix.double()
    want = first / first.abs().mean()
    bound = 2 * (_gemm_bound(singles[0], trains[0], qsets[0], order) / first.abs().mean() + 2 * EPS * want.abs())
    assert bool(((alone - want).abs() <= bound).all())


def test_fit_from_checkpoints_equals_fit_from_models(tmp_path):
    from safetensors.torch import save_file

    models, batches, trains, qsets, _ = _members("kfac")
    paths = [tmp_path / "c0.safetensors", tmp_path / "c1.pt", tmp_path / "c2.pt"]
    save_file({k: v.contiguous() for k, v in models[0].state_dict().items()}, paths[0])
    for model, path in zip(models[1:], paths[1:]):
        torch.save(model.state_dict(), path)
    target = Net()
    before = {k: v.clone() for k, v in target.state_dict().items()}
    with warnings.catch_warnings():
        warnings.simplefilter("error", CurvatureWeightsWarning)  # every member fitted at its own weights
        stores = [trains[0], trains[1].save(tmp_path / "member1", shard_rows=7), trains[2]]  # reversed rows
        loaded = gradtrace.Ensemble("kfac", stores).fit(target, batches, classification_loss, checkpoints=paths)
        a = loaded.score(qsets, matrix=True).matrix
    b = gradtrace.Ensemble("kfac", trains).fit(models=models, data=batches, loss_fn=classification_loss)
    torch.testing.assert_close(a, b.score(qsets, matrix=True).matrix, rtol=0, atol=0)
    assert all(torch.equal(before[k], v) for k, v in target.state_dict().items())  # weights restored
    # fitted at one model's weights for every member: the curvature weights warning names it
    with pytest.warns(CurvatureWeightsWarning):
        gradtrace.Ensemble("kfac", trains).fit(models=[models[0]] * 3, data=batches,
                                               loss_fn=classification_loss).score(qsets)


def test_tracin_list_is_still_tracin():
    _, _, trains, qsets, _ = _members("grad_dot", count=2)
    attr = gradtrace.Attributor("tracin", trains[:1] * 2, weights=[1.0, 1.0])
    assert isinstance(attr, gradtrace.Attributor)
    with pytest.raises(EnsembleError, match="already combines several checkpoints"):
        gradtrace.Ensemble("tracin", trains)


def test_bad_input_is_refused_with_the_fix():
    models, batches, trains, qsets, _ = _members("kfac")
    fewer = gradtrace.collect(models[2], batches[:-1], classification_loss)
    with pytest.raises(EnsembleError, match=r"member 1 holds other examples .* 2 missing \(e.g. \['ex24', 'ex25'\]"):
        gradtrace.Ensemble("grad_dot", [trains[0], fewer])
    projected = gradtrace.collect(models[1], batches, classification_loss,
                                  options=CaptureOptions(projection=gradtrace.LoGra(rank=2)))
    with pytest.raises(SpecMismatch, match=r"member 1's training gradients vs member 0's .*different projections"):
        gradtrace.Ensemble("grad_dot", [trains[0], projected])
    ens = gradtrace.Ensemble("kfac", trains)
    with pytest.raises(EnsembleError, match="2 models for 3 members"):
        ens.fit(models=models[:2], data=batches, loss_fn=classification_loss)
    with pytest.raises(EnsembleError, match="4 checkpoints for 3 members"):
        ens.fit(models[0], batches, classification_loss, checkpoints=[m.state_dict() for m in models + models[:1]])
    with pytest.raises(EnsembleError, match=r"one model for 3 members: .*models=\[\.\.\.\] or checkpoints="):
        ens.fit(models[0], batches, classification_loss)
    with pytest.raises(EnsembleError, match="are loaded into a model"):
        ens.fit(data=batches, loss_fn=classification_loss, checkpoints=[m.state_dict() for m in models])
    ens.fit(models=models, data=iter(batches), loss_fn=classification_loss)  # a one-pass iterator serves all
    with pytest.raises(EnsembleError, match="2 query set\\(s\\) for 3 members"):
        ens.score(qsets[:2])
    with pytest.raises(EnsembleError, match="1 query set\\(s\\) for 3 members"):
        ens.score(qsets[0])
    renamed = [{**_data()[1][0], "id": [f"z{i}" for i in range(5)]}]
    other = gradtrace.collect(models[2], renamed, classification_loss)
    with pytest.raises(EnsembleError, match="query set 2 holds other examples"):
        ens.score([qsets[0], qsets[1], other])
    for weights, message in (([1, 2], "2 weights for 3 members"), ([1, -1, 1], "finite and >= 0, got -1.0"),
                             ([1, math.nan, 1], "finite and >= 0, got nan"), ([0, 0, 0], "all zero")):
        with pytest.raises(EnsembleError, match=message):
            gradtrace.Ensemble("grad_dot", trains, weights=weights)
    with pytest.raises(EnsembleError, match="needs a list of training gradients"):
        gradtrace.Ensemble("grad_dot", trains[0])
    zero = gradtrace.GradientSet(torch.zeros_like(trains[2].vectors), list(trains[2].ids), trains[2].spec)
    with pytest.raises(EnsembleError, match="member 2's scores are all zero"):
        gradtrace.Ensemble("grad_dot", [trains[0], trains[1], zero]).score(qsets)


def _adam_run(count=3):
    """Checkpoints of one Adam run (3 steps apart) with the optimizer's state at each: models, state dicts."""
    batches, _ = _data()
    x, y = torch.cat([b["inputs"] for b in batches]), torch.cat([b["labels"] for b in batches])
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05, betas=(0.8, 0.95))
    models, states = [], []
    for _ in range(count):
        for _ in range(3):
            optimizer.zero_grad()
            classification_loss(model, {"inputs": x, "labels": y}).mean().backward()
            optimizer.step()
        models.append(copy.deepcopy(model))
        states.append(copy.deepcopy(optimizer.state_dict()))
    return models, states


def _trainer_directories(root, models, states):
    """Trainer-style ``checkpoint-N`` directories (``model.safetensors`` + ``optimizer.pt``), 3 steps apart."""
    from safetensors.torch import save_file

    dirs = []
    for c, (model, state) in enumerate(zip(models, states)):
        folder = root / f"checkpoint-{3 * (c + 1)}"
        folder.mkdir()
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, folder / "model.safetensors")
        torch.save(state, folder / "optimizer.pt")
        dirs.append(folder)
    return dirs


def test_trackstar_ensemble_takes_each_members_adam_state(tmp_path):

    models, states = _adam_run()
    batches, queries = _data()
    trains = [gradtrace.collect(m, _reversed(batches) if c == 1 else batches, classification_loss)
              for c, m in enumerate(models)]
    qsets = [gradtrace.collect(m, queries, classification_loss) for m in models]
    singles = [gradtrace.Attributor("trackstar", t, block_rows=4).fit(m, optimizer=s)
               for t, m, s in zip(trains, models, states)]
    # each member's state differs: scoring member 2 with member 0's state gives other scores -- by far more than
    # round-off, which is at most dim * eps per cosine of unit rows on either side (here 6.8e-6; the gap is ~0.5)
    other = gradtrace.Attributor("trackstar", trains[2]).fit(models[2], optimizer=states[0])
    gap = (other.score(qsets[2], matrix=True).matrix - singles[2].score(qsets[2], matrix=True).matrix).abs().max()
    assert float(gap) > 100 * 2 * trains[2].dim * EPS
    want, bound = _hand(singles, trains, qsets, [1, 1, 1])
    ensemble = gradtrace.Ensemble("trackstar", trains, block_rows=4)
    ensemble.fit(models=models, member_options=[{"optimizer": s} for s in states])
    got = ensemble.score(qsets, topk=None, matrix=True).matrix.double()
    assert bool(((got - want).abs() <= bound).all())
    # Trainer checkpoint directories (model.safetensors + optimizer.pt; one as an integrations entry): each
    # member reads its own directory's optimizer state: the same numbers, within the same float32 bound
    dirs = _trainer_directories(tmp_path, models, states)
    target = Net()
    from_dirs = gradtrace.Ensemble("trackstar", trains, block_rows=4).fit(
        target, checkpoints=[dirs[0], {"path": str(dirs[1]), "step": 6}, str(dirs[2])])
    from_dirs_scores = from_dirs.score(qsets, topk=None, matrix=True).matrix.double()
    assert bool(((from_dirs_scores - want).abs() <= bound).all())
    # one optimizer for several members is refused, with the fix
    with pytest.raises(EnsembleError, match=r"trackstar: optimizer= holds the state of one model's weights, so one "
                                            r"value cannot serve 3 members: .*member_options=\[\{'optimizer'"):
        gradtrace.Ensemble("trackstar", trains).fit(models=models, optimizer=states[0])
    with pytest.raises(EnsembleError, match="2 member_options for 3 members"):
        gradtrace.Ensemble("trackstar", trains).fit(models=models,
                                                    member_options=[{"optimizer": s} for s in states[:2]])
    with pytest.raises(EnsembleError, match="a list of dicts, one per member"):
        gradtrace.Ensemble("trackstar", trains).fit(models=models, member_options={"optimizer": states[0]})
    with pytest.raises(EnsembleError, match="eps= is given for every member and in member_options"):
        gradtrace.Ensemble("grad_dot", trains).fit(models=models, eps=1e-8, member_options=[{"eps": 1e-8}] * 3)
    (dirs[1] / "optimizer.pt").unlink()
    with pytest.raises(FileNotFoundError, match=r"no optimizer state at .*checkpoint-6/optimizer\.pt"):
        gradtrace.Ensemble("trackstar", trains).fit(target, checkpoints=dirs)


def test_checkpoint_directories_and_their_bad_forms(tmp_path):
    from safetensors.torch import save_file

    from gradtrace.common.checkpoints import read_state_dict
    from gradtrace.common.errors import UsageError

    state = {k: v.clone() for k, v in Net().state_dict().items()}
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    names = sorted(state)
    halves = {"model-00001-of-00002.safetensors": names[:2], "model-00002-of-00002.safetensors": names[2:]}
    for file, keys in halves.items():
        save_file({k: state[k] for k in keys}, sharded / file)
    index = {"weight_map": {k: file for file, keys in halves.items() for k in keys}}
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    got = read_state_dict(sharded)
    assert sorted(got) == names and all(torch.equal(got[k], state[k]) for k in names)
    binary = tmp_path / "bin"
    binary.mkdir()
    torch.save(state, binary / "pytorch_model.bin")
    assert all(torch.equal(read_state_dict({"path": str(binary)})[k], state[k]) for k in names)
    (tmp_path / "empty").mkdir()
    with pytest.raises(UsageError, match=r"empty holds no model weights .*model\.safetensors"):
        read_state_dict(tmp_path / "empty")
    (sharded / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(UsageError, match=r"lists shard model-00002-of-00002\.safetensors, which is missing"):
        read_state_dict(sharded)
    with pytest.raises(UsageError, match=r"a checkpoint is a state dict, .* got int"):
        read_state_dict(3)
    with pytest.raises(UsageError, match=r"checkpoint entry \{'step': 5, 'path': None\} has no path"):
        read_state_dict({"step": 5, "path": None})
    torch.save({"weights": state, "note": object.__new__(Net)}, binary / "pytorch_model.bin")  # not tensors only
    with pytest.raises(UsageError, match=r"refusing to load .*pytorch_model\.bin: it holds pickled Python objects"):
        read_state_dict(binary)


def test_attributor_refuses_a_list_for_a_single_model_method_naming_ensemble():
    """One call, one meaning: a list of stores for a method that scores one model is an Ensemble, asked for by
    name; the Attributor refuses it with that advice rather than returning another type."""
    trains = _members("grad_dot")[2]
    with pytest.raises(ValueError, match=r"grad_dot scores one model: .*gradtrace\.Ensemble\('grad_dot'"):
        gradtrace.Attributor("grad_dot", trains)
    with pytest.raises(ValueError, match="Attributor takes one method"):
        gradtrace.Attributor(["grad_dot", "grad_cos"], trains)
    assert type(gradtrace.Attributor("tracin", trains[:1] * 2, weights=[1.0, 1.0])) is gradtrace.Attributor

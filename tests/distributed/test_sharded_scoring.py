"""Scoring a store split across 2 gloo ranks equals single-process scoring.

Stores are written here with several writer ranks and uneven shares (5 + 2 rows; 7 rows by one writer, so
that one scoring rank has no rows under the ``"writer"`` split; three writers, so that a scoring rank gets
non-contiguous rows). Every case is scored once on both ranks with ``score_sharded`` and once in this
process with ``Attributor.score``: the top-k, the bottom-k and (when asked) the matrix agree, on every rank.
Bad inputs -- ranks with other queries, a rank whose reads fail -- raise on every rank instead of hanging.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import gradtrace
from gradtrace.options import StoreOptions
from gradtrace.store import GradientSpec, ShardWriter
from tests.distributed import jobs
from tests.distributed.launch import run_ranks

DIM = 6
SPEC = GradientSpec(params=[("w", 4), ("b", 2)], projection=None,
                    convention={"reduction": "mean", "example_loss": "sum"}, model={"arch": "x"})


def _write(path: Path, rows_per_writer: list[int], seed: int, first_id: int = 0) -> Path:
    gen = torch.Generator().manual_seed(seed)
    world, next_id = len(rows_per_writer), first_id
    for writer_rank, count in enumerate(rows_per_writer):
        with ShardWriter(path, SPEC, StoreOptions(shard_rows=2), rank=writer_rank, world_size=world) as writer:
            if count:
                vectors = torch.randn(count, DIM, generator=gen) * torch.logspace(-1, 1, count).unsqueeze(1)
                writer.put([f"t{next_id + i}" for i in range(count)], vectors)
        next_id += count
    return path


@pytest.fixture(scope="module")
def stores(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("sharded")
    paths = {
        "a": _write(root / "a", [5, 2], seed=0),            # two writers, uneven
        "a2": _write(root / "a2", [5, 2], seed=1),          # same ids, other vectors: a second checkpoint
        "b": _write(root / "b", [7], seed=2),               # one writer: the 2nd scoring rank gets no rows
        "c": _write(root / "c", [3, 2, 4], seed=3),         # three writers: rank 0 scores writers 0 and 2
        "q": _write(root / "q", [3], seed=4, first_id=100),
        "q2": _write(root / "q2", [3], seed=5, first_id=100),
        "q_short": _write(root / "q_short", [2], seed=4, first_id=100),
    }
    return {k: str(v) for k, v in paths.items()}


def _cases(s: dict[str, str]) -> list[dict]:
    return [
        {"name": "dot-balanced-uneven", "method": "grad_dot", "train": [s["a"]], "queries": [s["q"]], "topk": 3,
         "matrix": True},
        {"name": "cos-writer-k-above-share", "method": "grad_cos", "train": [s["a"]], "queries": [s["q"]],
         "topk": 5, "split": "writer", "block_rows": 2},
        {"name": "dot-writer-rank-without-rows", "method": "grad_dot", "train": [s["b"]], "queries": [s["q"]],
         "topk": 3, "matrix": True, "split": "writer"},
        {"name": "dot-writer-noncontiguous-all-rows", "method": "grad_dot", "train": [s["c"]],
         "queries": [s["q"]], "topk": 9, "matrix": True, "split": "writer", "block_rows": 2},
        {"name": "dot-no-matrix-unless-asked", "method": "grad_dot", "train": [s["a"]], "queries": [s["q"]],
         "topk": 2, "matrix": "auto", "matrix_bytes": 16},
        {"name": "tracin-two-checkpoints", "method": "tracin", "train": [s["a"], s["a2"]],
         "queries": [s["q"], s["q2"]], "topk": 4, "matrix": True, "method_options": {"weights": [0.5, 0.25]}},
        {"name": "bad-queries-differ", "method": "grad_dot", "train": [s["a"]], "queries": [s["q"]], "topk": 3,
         "queries_of_rank": [s["q"], s["q_short"]]},
        {"name": "bad-reads-fail-on-rank-1", "method": "grad_dot", "train": [s["a"]], "queries": [s["q"]],
         "topk": 3, "fail_on_rank": 1},
    ]


def _single_process(case: dict):
    train = [gradtrace.GradientStore.open(p) for p in case["train"]]
    queries = [gradtrace.GradientStore.open(p) for p in case["queries"]]
    attributor = gradtrace.Attributor(case["method"], train if len(train) > 1 else train[0],
                                      matrix_bytes=case.get("matrix_bytes", 2**30), **case.get("method_options", {}))
    return attributor.score(queries if len(queries) > 1 else queries[0], topk=case["topk"],
                            matrix=case.get("matrix", "auto"))


@pytest.fixture(scope="module")
def sharded(stores):
    cases = _cases(stores)
    results = run_ranks(jobs.sharded_scores, cases, timeout=60)
    return {case["name"]: (case, [r[i] for r in results]) for i, case in enumerate(cases)}


@pytest.mark.parametrize("name", ["dot-balanced-uneven", "cos-writer-k-above-share", "dot-writer-rank-without-rows",
                                  "dot-writer-noncontiguous-all-rows", "dot-no-matrix-unless-asked",
                                  "tracin-two-checkpoints"])
def test_sharded_scores_equal_single_process(sharded, name):
    case, per_rank = sharded[name]
    want = _single_process(case)
    for scores in per_rank:
        assert not isinstance(scores, str), scores
        assert scores.train_ids == want.train_ids and scores.query_ids == want.query_ids
        for got, ref in ((scores.top, want.top), (scores.bottom, want.bottom)):
            torch.testing.assert_close(got[0], ref[0], rtol=1e-5, atol=1e-7)  # other GEMM shapes: last bits
            assert torch.equal(got[1], ref[1])
        if want.matrix is not None:
            torch.testing.assert_close(scores.matrix, want.matrix, rtol=1e-5, atol=1e-7)
        else:
            assert scores.matrix is None
        assert scores.topk(2).ids == want.topk(2).ids
        dist_meta = scores.meta["distributed"]
        assert dist_meta["world_size"] == 2 and sum(dist_meta["rows"]) == len(want.train_ids)
    assert torch.equal(per_rank[0].top[1], per_rank[1].top[1])


def test_sharded_split_shares(sharded):
    assert all(s.matrix is None for s in sharded["dot-no-matrix-unless-asked"][1])  # too big for matrix_bytes
    assert sharded["dot-balanced-uneven"][1][0].meta["distributed"]["rows"] == [3, 4]
    assert sharded["cos-writer-k-above-share"][1][0].meta["distributed"]["rows"] == [5, 2]
    assert sharded["dot-writer-rank-without-rows"][1][0].meta["distributed"]["rows"] == [7, 0]
    assert sharded["dot-writer-noncontiguous-all-rows"][1][0].meta["distributed"]["rows"] == [7, 2]


def test_sharded_bad_input_fails_on_every_rank(sharded):
    _, per_rank = sharded["bad-queries-differ"]
    for message in per_rank:
        assert message.startswith("RankMismatch: gradtrace: the 2 ranks disagree on the inputs of sharded scoring")
        assert "rank 1: queries" in message
    _, per_rank = sharded["bad-reads-fail-on-rank-1"]
    assert per_rank[1] == "OSError: disk read error (test)"
    assert per_rank[0].startswith("RankFailure: gradtrace: scoring this rank's training rows failed on 1 of 2 ranks "
                                  "(rank 1: OSError: disk read error (test))")


def test_rank_rows_splits():
    from gradtrace.distributed import RowSubset, rank_rows

    class Rows:
        def __init__(self, n):
            self.ids = [str(i) for i in range(n)]
            self.spec = SPEC

        def __len__(self):
            return len(self.ids)

        def read(self, start, stop, device=None):
            return torch.arange(start, stop, dtype=torch.float32).unsqueeze(1).expand(-1, DIM)

    assert rank_rows(Rows(7), 2) == [[(0, 3)], [(3, 7)]]
    assert rank_rows(Rows(1), 3) == [[(0, 0)], [(0, 0)], [(0, 1)]]
    view = RowSubset(Rows(10), [(0, 2), (5, 8)])
    assert len(view) == 5 and view.ids == ["0", "1", "5", "6", "7"]
    assert view.read(1, 4)[:, 0].tolist() == [1.0, 5.0, 6.0]
    assert view.global_index().tolist() == [0, 1, 5, 6, 7]
    with pytest.raises(ValueError, match="only a gradient store records"):
        rank_rows(Rows(3), 2, "writer")

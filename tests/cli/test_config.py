"""Config files: YAML/TOML, precedence (command line > section > shared keys > defaults), validation, replay."""

from __future__ import annotations

import yaml

import gradtrace
from tests.cli.conftest import invoke


def _resolved(directory, command="collect"):
    return yaml.safe_load((directory / f"gradtrace-{command}.yaml").read_text())


def test_yaml_values_and_command_line_precedence(ws, runner, fresh):
    config = fresh / "run.yaml"
    config.write_text(yaml.safe_dump({"rank": 3, "batch-size": 4, "seed": 7, "dtype": "bfloat16",
                                      "out": str(fresh / "from-file")}))
    invoke(runner, "collect", ws.model, ws.train, "--config", config, "--rank", 2, "--no-progress")
    resolved = _resolved(fresh / "from-file")
    assert resolved["rank"] == 2  # the command line wins
    assert resolved["batch_size"] == 4 and resolved["seed"] == 7 and resolved["dtype"] == "bfloat16"  # the file
    assert resolved["id_field"] == "id"  # the default
    spec = gradtrace.GradientStore.open(fresh / "from-file").spec
    assert spec.projection["rank_rows"] == 2 and spec.projection["seed"] == 7 and spec.dtype == "bfloat16"


def test_toml_with_sections_and_arguments(ws, runner, fresh):
    config = fresh / "project.toml"
    config.write_text(f'model = "{ws.model}"\nbatch_size = 6\nrank = 5\nmethod = "grad_cos"\n\n'
                      f'[collect]\ndata = "{ws.train}"\nout = "{fresh / "s"}"\nrank = 3\nprogress = false\n\n'
                      f'[score]\ntopk = 2\n')
    invoke(runner, "collect", "--config", config)  # arguments from the file too
    resolved = _resolved(fresh / "s")
    assert resolved["rank"] == 3 and resolved["batch_size"] == 6 and resolved["data"] == str(ws.train)
    # the same file configures score: shared keys it knows (batch_size, method), its section; rank is ignored
    invoke(runner, "score", fresh / "s", ws.queries, "--config", config, "--out", fresh / "sc", "--no-progress")
    scored = _resolved(fresh / "sc", "score")
    assert scored["method"] == "grad_cos" and scored["topk"] == 2 and scored["batch_size"] == 6
    assert scored["model"] == [str(ws.model)]


def test_resolved_config_replays_the_run(ws, runner, store, fresh):
    replay = fresh / "replay.yaml"
    resolved = _resolved(store)
    resolved["out"] = str(fresh / "again")
    for key in ("model", "data"):  # saved relative to the store's folder where they lie beside it; moved: absolute
        resolved[key] = str((store / resolved[key]).resolve())
    replay.write_text(yaml.safe_dump(resolved))
    invoke(runner, "collect", "--config", replay)
    a, b = gradtrace.GradientStore.open(store), gradtrace.GradientStore.open(fresh / "again")
    assert a.ids == b.ids and a.spec.to_dict() == b.spec.to_dict()
    assert (a.read(0, len(a)) - b.read(0, len(b))).abs().max() < 1e-5
    # ... and the file a command wrote cannot configure another command
    result = invoke(runner, "score", store, ws.queries, "--config", store / "gradtrace-collect.yaml", code=2)
    assert "resolved configuration of `gradtrace collect`" in result.output


def test_score_store_list_in_config_spills_into_checkpoints(ws, runner, store, fresh):
    """``store: [a, b]`` in a config file means ``STORE=a --store b`` (tracin's checkpoints)."""
    config = fresh / "tracin.yaml"
    config.write_text(yaml.safe_dump({"method": "tracin", "store": [str(store), str(store)], "queries": str(ws.queries),
                                      "model": [str(ws.model), str(ws.model)], "lr": [0.5, 0.25],
                                      "out": str(fresh / "sc"), "progress": False}))
    invoke(runner, "score", "--config", config)
    resolved = _resolved(fresh / "sc", "score")
    assert resolved["store"] == str(store) and resolved["checkpoint_stores"] == [str(store)]
    assert resolved["lr"] == [0.5, 0.25]


def test_unknown_key_is_an_error_with_a_suggestion(ws, runner, fresh):
    config = fresh / "typo.yaml"
    config.write_text("rnak: 4\n")
    result = invoke(runner, "collect", ws.model, ws.train, "--out", fresh / "s", "--config", config, code=2)
    assert "'rnak'" in result.output and "did you mean 'rank'" in result.output
    config.write_text("collect:\n  topk: 4\n")  # known to score, but not in collect's own section
    result = invoke(runner, "collect", ws.model, ws.train, "--out", fresh / "s", "--config", config, code=2)
    assert "'topk' is not an option of `gradtrace collect`" in " ".join(result.output.split())


def test_bad_config_files(ws, runner, fresh):
    base = ["collect", ws.model, ws.train, "--out", fresh / "s", "--config"]
    result = invoke(runner, *base, fresh / "missing.yaml", code=2)
    assert "does not exist" in result.output
    (fresh / "bad.yaml").write_text("rank: [1, 2\n")
    assert "not valid YAML" in invoke(runner, *base, fresh / "bad.yaml", code=2).output
    (fresh / "bad.toml").write_text("rank = \n")
    assert "not valid TOML" in invoke(runner, *base, fresh / "bad.toml", code=2).output
    (fresh / "list.yaml").write_text("- 1\n- 2\n")
    assert "mapping" in invoke(runner, *base, fresh / "list.yaml", code=2).output
    (fresh / "value.yaml").write_text("dtype: float64\n")  # values are validated like command-line ones
    assert "float64" in invoke(runner, *base, fresh / "value.yaml", code=2).output

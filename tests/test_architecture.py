"""The import graph of ``gradtrace`` has no cycles and points downwards only (issue #16).

The graph is built from the source with ``ast``: every ``import`` and ``from ... import`` of a gradtrace module,
at module level or inside functions (lazy imports count: they run sooner or later), except those under
``if TYPE_CHECKING:``. Importing ``a.b.c`` from outside the package ``a.b`` also runs ``a/b/__init__.py`` first,
so such an import is an edge to the package too. The allowed direction is the layer table of
``docs/architecture.md``, repeated in :data:`LAYERS`.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "gradtrace"

# lowest first; a module may import its own layer and the layers below it (docs/architecture.md says why)
LAYERS: list[set[str]] = [
    {"common", "loss", "version"},  # the floor: imports nothing from gradtrace above it
    {"grad", "projection", "options"},  # gradient containers and ops; LoGra and the sketches; typed options
    {"data"},  # data in: files -> tokenized batches (read with options.data), the one id rule, the bundled corpus
    {"store"},  # rows of gradients on disk: spec, layout, shard writer, reader, artifacts
    {"distributed"},  # ranks: process group, agreement between ranks (on stores and captures)
    {"capture"},  # hooks -> GradientBatch -> rows (capture/sink: a store or memory); collect over a dataset, at
    # each of C checkpoints (capture/checkpoints.py)
    {"fit.curvature"},  # the fit stage, part 1: K-FAC / EK-FAC / dense Fisher fitted from captured factors; PCA
    {"fit", "fit.methods"},  # part 2: attribution methods (their fits, preconditioning, scoring math); the stage's
    # package gradtrace/fit/__init__.py names both
    {"report"},  # HTML report of any Scores-like object
    {"score"},  # blocked scoring engine, Scores, ensembles, pairs, index, sharded scoring
    {"train", "integrations", "eval", "demo", "plan", "replay"},  # applications; plan: pre-flight of collect,
    # fit, score; replay: recorded runs and their metagradients
    {"cli", ""},  # entry points: the command line and the package facade gradtrace/__init__.py
]

# Public names kept where they were first exported although their code now lives in a higher layer: each is
# resolved by a module ``__getattr__`` in the package's ``__init__`` on first use (so importing the package runs
# nothing above it); ``test_reexports_are_lazy_getattr_only`` checks that every entry is exactly that.
REEXPORTS: dict[tuple[str, str], str] = {
    ("gradtrace.store", "gradtrace.capture.sink"): "gradtrace.store.StoreWriter, the capture callback that writes a "
                                                   "store (it sits in capture/sink, above store)",
    ("gradtrace.distributed", "gradtrace.score.sharded"): "gradtrace.distributed.score_sharded / rank_rows / "
                                                         "RowSubset (sharded scoring is scoring: score/sharded.py)",
    ("gradtrace.distributed", "gradtrace.score"): "the score package that importing gradtrace.score.sharded runs",
}

MAX_LINES = 500


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _resolve(name: str) -> str:
    """The longest prefix of dotted ``name`` that is a gradtrace module."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    hidden: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            hidden.update(id(inner) for inner in ast.walk(node))
    return hidden


def _imported(module: str, path: Path) -> Iterator[tuple[str, int]]:
    """``(imported gradtrace module, line)`` for each import in ``module``'s source."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    hidden = _type_checking_nodes(tree)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if id(node) in hidden:
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "gradtrace":
                    yield _resolve(alias.name), node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if source.split(".")[0] != "gradtrace":
                continue
            for alias in node.names:
                full = f"{source}.{alias.name}"
                yield (full if full in MODULES else _resolve(source)), node.lineno


def _packages_run(module: str, target: str) -> list[str]:
    """The package ``__init__`` modules that importing ``target`` from ``module`` runs besides ``target``: those
    above ``target`` that do not contain ``module`` (the root package has always run)."""
    parts = target.split(".")
    outer = [".".join(parts[:i]) for i in range(2, len(parts))]
    return [p for p in outer if not (module == p or module.startswith(p + "."))]


def import_graph() -> dict[str, dict[str, int]]:
    """``{module: {imported module: line}}`` over the gradtrace modules, pending exceptions left out."""
    graph: dict[str, dict[str, int]] = {m: {} for m in MODULES}
    for module, path in MODULES.items():
        for target, line in _imported(module, path):
            if target == module or (module, target) in REEXPORTS:
                continue
            for node in [target, *_packages_run(module, target)]:
                graph[module].setdefault(node, line)
    return graph


def _cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(graph[start]))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(graph[child])))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def _unit(module: str) -> str:
    """The entry of :data:`LAYERS` that places ``module``: its sub-package where one is listed (``fit.curvature``),
    else its top-level package (``""`` for the facade)."""
    parts = module.split(".")[1:]
    listed = set().union(*LAYERS)
    two = ".".join(parts[:2])
    return two if len(parts) >= 2 and two in listed else (parts[0] if parts else "")


def _layer(module: str) -> int:
    unit = _unit(module)
    for level, members in enumerate(LAYERS):
        if unit in members:
            return level
    raise AssertionError(f"{module}: its package {unit!r} has no layer; add it to LAYERS and docs/architecture.md")


def test_the_graph_builder_sees_lazy_and_relative_imports():
    graph = import_graph()
    assert "gradtrace.grad.ops" in graph["gradtrace.grad.batch"]  # lazy, relative, inside methods
    assert "gradtrace.projection.base" in graph["gradtrace.projection.logra"]
    assert "gradtrace.distributed" in graph["gradtrace.cli.score"]  # a package imported lazily
    assert "gradtrace.common" in graph["gradtrace.capture.collector"]  # the package a submodule import runs


def test_no_import_cycle():
    cycles = _cycles(import_graph())
    assert not cycles, "import cycles inside gradtrace:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_imports_point_down_the_layers():
    upward = [f"{module} (layer {_layer(module)}) imports {target} (layer {_layer(target)}) at line {line}"
              for module, targets in import_graph().items() for target, line in targets.items()
              if _layer(target) > _layer(module)]
    assert not upward, "upward imports (see docs/architecture.md):\n" + "\n".join(sorted(upward))


def test_every_package_has_a_layer():
    for module in MODULES:
        _layer(module)


def test_the_documented_table_is_the_tested_one():
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    for members in LAYERS:
        for unit in members - {""}:
            assert f"`{unit}" in text, f"docs/architecture.md does not place {unit}"


def test_reexports_are_lazy_getattr_only():
    for module, target in REEXPORTS:
        path = MODULES[module]
        assert path.name == "__init__.py", f"{module}: re-exports belong in a package __init__"
        tree = ast.parse(path.read_text(encoding="utf-8"))
        getattr_nodes = {id(n) for f in tree.body if isinstance(f, ast.FunctionDef) and f.name == "__getattr__"
                         for n in ast.walk(f)}
        lines = [line for t, line in _imported(module, path) if t == target or t.startswith(target + ".")]
        imports = [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom)) and n.lineno in lines]
        assert imports and all(id(n) in getattr_nodes for n in imports), \
            f"{module} imports {target} outside its module __getattr__"


def _private_imports() -> list[tuple[str, str, str]]:
    """``(module, source module, name)`` for each ``_private`` name a gradtrace module imports from gradtrace."""
    found = []
    for module, path in MODULES.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.ImportFrom):
                continue
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            source = ".".join(base + ([node.module] if node.module else []))
            found += [(module, source, alias.name) for alias in node.names
                      if alias.name.startswith("_") and not alias.name.startswith("__")]
    return found


def test_no_private_name_is_imported_across_packages():
    unit = _unit
    private = _private_imports()
    assert ("gradtrace.score.ensemble", "gradtrace.score.engine", "_check_block") in private  # within score: fine
    across = [f"{module} imports {name} from {source}" for module, source, name in private
              if unit(module) != unit(source)]
    assert not across, "private names imported across packages (make them public):\n" + "\n".join(across)


def test_no_module_over_500_lines():
    long = {name: n for name, path in MODULES.items()
            if (n := len(path.read_text(encoding="utf-8").splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"


def test_moved_public_names_stay_where_they_were_exported():
    import gradtrace
    import gradtrace.distributed
    import gradtrace.fit.curvature
    import gradtrace.grad
    import gradtrace.loss.functions

    assert gradtrace.Loss is gradtrace.options.Loss is gradtrace.options.loss.Loss
    assert gradtrace.distributed.score_sharded.__module__ == "gradtrace.score.sharded"
    assert gradtrace.distributed.rank_and_world() == (0, 1)  # no process group in the test process
    assert gradtrace.__version__ == gradtrace.version.__version__
    assert callable(gradtrace.LoGra.pca)
    assert gradtrace.fit.curvature.pca_logra.__module__ == "gradtrace.fit.curvature.pca"

"""The package's layering, read from its import statements (those inside functions included): no two modules import
each other, directly or in a circle; the packages import downwards in LAYERS but for the arrows named in UPWARD; and
eval/ imports nothing from train/ (its decoding methods are eval/methods.py's, nothing registers itself)."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
PACKAGES = ("conf", "runtime", "data", "models", "train", "eval", "cli")
# Each package may import those before it: configuration; running a stage (folders, hashes, progress, logging); the
# models; the data and teacher stage; evaluation; training (which reports eval's metrics while it trains); the
# command line (a package's __main__ is a command too).
LAYERS = ("conf", "runtime", "models", "data", "eval", "train", "cli")
# The arrows that still run up, each for its reason.
UPWARD = {
    ("runtime", "eval"): "the eval stage's config hash covers the components its methods use (eval/methods.py)",
    ("models", "data"): "atomic file writes (data/files.py) when a model saves itself",
}


def import_graph() -> dict[str, set[str]]:
    modules = {f"{p}.{f.stem}" if f.stem != "__init__" else p: f for p in PACKAGES for f in (ROOT / p).glob("*.py")}
    graph = {m: set() for m in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("dflash_pipeline."):
                base = node.module.removeprefix("dflash_pipeline.")
                for alias in node.names:  # `from dflash_pipeline.conf import catalogue` names a module
                    target = f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                    if target in modules and target != name:
                        graph[name].add(target)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    target = alias.name.removeprefix("dflash_pipeline.")
                    if target in modules and target != name:
                        graph[name].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while True:
                w = stack.pop()
                on.discard(w)
                part.append(w)
                if w == v:
                    break
            if len(part) > 1:
                found.append(sorted(part))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle_between_modules():
    assert cycles(import_graph()) == []


def test_the_check_sees_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_eval_imports_nothing_from_train():
    graph = import_graph()
    wrong = {m: sorted(t for t in targets if t.startswith("train")) for m, targets in graph.items()
             if m.startswith("eval")}
    assert not {m: t for m, t in wrong.items() if t}


def test_the_method_protocol_imports_nothing_above_models_and_data():
    assert all(t.split(".")[0] in ("models", "data") for t in import_graph()["eval.protocol"])


def layer(module: str) -> str:
    return "cli" if module.endswith("__main__") else module.split(".")[0]


def test_packages_import_downwards_but_for_the_named_arrows():
    graph = import_graph()
    up = {}
    for module, targets in graph.items():
        for t in targets:
            if LAYERS.index(layer(t)) > LAYERS.index(layer(module)):
                up.setdefault((layer(module), layer(t)), []).append(f"{module} -> {t}")
    assert set(up) <= set(UPWARD), {k: v for k, v in up.items() if k not in UPWARD}


def test_conf_holds_configuration_only():
    """conf/ is the schema, the YAML and the catalogue of config groups: it imports no stage, model or runtime code."""
    graph = import_graph()
    assert {t for m, targets in graph.items() if m.startswith("conf") for t in targets if layer(t) != "conf"} == set()


@pytest.mark.slow
def test_the_eval_stage_loads_no_training_code_at_run_time():
    """Not only the import lines: the eval stage and its method catalogue, read through, load nothing of train/."""
    import subprocess
    import sys

    code = ("import sys, dflash_pipeline.eval.stage as stage; from dflash_pipeline.eval import methods; "
            "methods.evaluated_names(methods.METHODS, [4]); [m.components() for m in methods.METHODS.values()]; "
            "print([m for m in sys.modules if m.startswith('dflash_pipeline.train')])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"

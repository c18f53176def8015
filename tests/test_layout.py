"""The package's layering, read from its import statements (those inside functions included): no two modules import
each other, directly or in a circle; the packages import downwards in LAYERS but for the arrows named in UPWARD; and
eval/ imports nothing from train/ (its decoding methods are eval/methods.py's, nothing registers itself)."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from dflash_pipeline.conf.catalogue import COMPONENTS

ROOT = Path(__file__).parents[1]
PACKAGES = ("conf", "runtime", "data", "models", "train", "eval", "cli")
# Each package may import those before it: configuration; running a stage (folders, hashes, progress, logging); the
# models; the data and teacher stage; evaluation; training (which reports eval's metrics while it trains); the
# command line (a package's __main__ is a command too).
LAYERS = ("conf", "runtime", "models", "data", "eval", "train", "cli")
# The arrows that still run up, each for its reason: none since the stage hash is given the eval's components
# (eval/stage.py eval_hash) and the atomic writes moved to runtime/files.py.
UPWARD: dict[tuple[str, str], str] = {}


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


# Where stages write and read is runtime/stages.py's alone (its docstring states the precedence); bench_peers lays out
# the peers' runs beside ours (its own runs name eval.out_dir on their command lines).
PATH_OWNER, PATH_EXEMPT = "runtime/stages.py", {"scripts/bench_peers.py"}
STAGE_KEYS = {"out_dir", "data_dir", "drafter_dir", "spool"}
SECTIONS = {"teacher", "trainer", "eval", "producer", *COMPONENTS}  # config sections holding such keys
STAGE_NAMES = {"teacher", "train", "eval", "export"}


def stage_path_rules(source: str) -> list[str]:
    """Where a module rules a stage path itself: reads a section's out_dir / data_dir / drafter_dir key, or joins a
    stage folder's name (`folder / "export"`)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in STAGE_KEYS and isinstance(node.value, ast.Attribute) \
                and node.value.attr in SECTIONS:
            found.append(f"line {node.lineno}: .{node.value.attr}.{node.attr}")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get" \
                and node.args and isinstance(node.args[0], ast.Constant) and node.args[0].value in STAGE_KEYS:
            found.append(f"line {node.lineno}: .get({node.args[0].value!r})")
        elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div) and isinstance(node.right, ast.Constant) \
                and node.right.value in STAGE_NAMES:
            found.append(f"line {node.lineno}: / {node.right.value!r}")
    return found


def test_every_module_asks_runtime_stages_for_stage_folders():
    files = [f for p in (*PACKAGES, "scripts") for f in sorted((ROOT / p).rglob("*.py"))]
    rules = {str(f.relative_to(ROOT)): stage_path_rules(f.read_text()) for f in files}
    assert rules[PATH_OWNER], "the check no longer sees runtime/stages.py's own rules"
    assert {f: r for f, r in rules.items() if r and f != PATH_OWNER and f not in PATH_EXEMPT} == {}


def test_the_path_check_sees_a_rule_of_its_own():
    assert len(stage_path_rules('a = cfg.trainer.data_dir or run / cfg.teacher.out_dir\nb = out / "export"\n'
                                'c = own.get("drafter_dir")')) == 4


def test_the_house_drawn_in_the_docs_is_the_one_the_imports_give():
    graph, edges = import_graph(), {}
    for module, targets in graph.items():
        for t in targets:
            if layer(t) != layer(module):
                edges.setdefault(layer(module), set()).add(layer(t))
    order = LAYERS[::-1]
    drawn = [f"    {p} -> {', '.join(sorted(edges[p], key=order.index))}" for p in order if edges.get(p)]
    text = (ROOT / "docs" / "README.md").read_text()
    assert "\n".join(drawn) in text, "\n".join(drawn)

"""The rooms of docs/architecture.md, checked on the source: who may import whom, no import
cycles, no oversized modules. Reads the files with ``ast``; imports nothing of the package."""
from __future__ import annotations

import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "autosp_lm")

# room -> rooms (and modules) it must not import, lazily or not
FORBIDDEN = {
    "models": ["compiler", "parallel", "strategies", "training", "data", "arguments", "checkpoint_flags",
               "torch.distributed"],
    "compiler": ["models", "strategies", "training", "data", "arguments", "checkpoint_flags"],
    "parallel": ["compiler", "strategies", "training", "data", "arguments", "checkpoint_flags"],
    "data": ["models", "compiler", "parallel", "strategies", "training", "arguments", "checkpoint_flags"],
    "strategies": ["training", "data", "arguments", "checkpoint_flags"],
    "training": ["compiler", "arguments", "checkpoint_flags"],
}
# bench/ (the benchmark's and the GPU check's logic) sits above the rooms: it may import any of
# them (tools/ and tests/ excepted), and none of them imports it
FORBIDDEN["bench"] = []
for _room in ("models", "compiler", "parallel", "data", "strategies", "training"):
    FORBIDDEN[_room].append("bench")
# parallel/ reaches into models only through the attention entry point and the shared loss
ALLOWED = {"parallel": {"models.attention", "models.loss"}}
MAX_LINES = 500


def _modules():
    for dirpath, _, files in os.walk(PACKAGE):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                rel = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                yield (rel[:-len(".__init__")] if rel.endswith(".__init__") else rel), path


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> list[str]:
    if node.level == 0:
        base = node.module or ""
    else:
        parts = module.split(".")
        if not is_package:
            parts = parts[:-1]
        parts = parts[:len(parts) - (node.level - 1)]
        base = ".".join(parts + ([node.module] if node.module else []))
    if node.module is None:  # from . import a, b
        return [f"{base}.{a.name}" for a in node.names]
    return [base] + [f"{base}.{a.name}" for a in node.names]


def _imports(module: str, path: str, top_level_only: bool) -> set[str]:
    tree = ast.parse(open(path).read())
    nodes = ast.walk(tree) if not top_level_only else _top_level(tree.body)
    out = set()
    is_package = path.endswith("__init__.py")
    for node in nodes:
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            out |= set(_resolve(module, is_package, node))
    return out


def _top_level(body):
    for node in body:
        yield node
        if isinstance(node, (ast.Try, ast.If)):
            for part in (node.body, getattr(node, "orelse", []), getattr(node, "finalbody", [])):
                yield from _top_level(part)
            for h in getattr(node, "handlers", []):
                yield from _top_level(h.body)


MODULES = dict(_modules())


def _known(name: str) -> str:
    """The package module an imported name refers to ('' for outside modules)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name


@pytest.mark.parametrize("room", sorted(FORBIDDEN))
def test_rooms_keep_to_themselves(room):
    bad = []
    for module, path in MODULES.items():
        if not module.startswith(f"autosp_lm.{room}"):
            continue
        for name in _imports(module, path, top_level_only=False):
            if name.startswith("tools") or name.startswith("tests"):
                bad.append(f"{module} imports {name}")
            for other in FORBIDDEN[room]:
                target = other if other.startswith("torch") else f"autosp_lm.{other}"
                if (name == target or name.startswith(target + ".")) and not any(
                        name.startswith(f"autosp_lm.{ok}") for ok in ALLOWED.get(room, ())):
                    bad.append(f"{module} imports {name}")
    assert not bad, "\n".join(sorted(set(bad)))


def test_no_import_cycles():
    """Module-level imports form no cycle (imports inside functions are lazy by design)."""
    graph = {}
    for module, path in MODULES.items():
        deps = {_known(n) for n in _imports(module, path, top_level_only=True)}
        graph[module] = {d for d in deps if d and d != module
                         and not module.startswith(d + ".")}  # a package's own __init__
    state, stack, cycles = {}, [], []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for d in sorted(graph.get(m, ())):
            if state.get(d) == 1:
                cycles.append(stack[stack.index(d):] + [d])
            elif d not in state:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)


def test_no_oversized_modules():
    big = {m: n for m, p in MODULES.items() if (n := sum(1 for _ in open(p))) > MAX_LINES}
    assert not big, big


def test_every_pass_says_what_it_expects_rewrites_and_guarantees():
    passes = [m for m in MODULES if m.startswith("autosp_lm.compiler.passes.")
              and not m.endswith("sac_graph")]
    assert len(passes) >= 6
    for m in passes:
        doc = (ast.get_docstring(ast.parse(open(MODULES[m]).read())) or "").lower()
        for word in ("expects", "rewrites", "afterwards"):
            assert word in doc, f"{m}: docstring lacks '{word}'"

"""The rooms of docs/architecture.md, checked on the source: who may import whom, that imports
run down the floors and form no cycle, that no module imports another's private names, and that
no module is oversized. Imports inside functions (lazy ones) count like the others: hiding an
import in a function does not remove the dependency. Reads the files with ``ast``; imports
nothing of the package."""
from __future__ import annotations

import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = "autosp_lm"
# the command line and the run's configuration (autosp_lm/config): the top floor, but for its
# pure-argparse plumbing (config.cli), which the tools and the benchmark share: the ground floor
ENTRY = ["config"]
GROUND = "config.cli"

# room -> rooms (and modules) it must not import, lazily or not
FORBIDDEN = {
    "models": ["compiler", "parallel", "strategies", "training", "data", "planner", "bench",
               *ENTRY, "torch.distributed"],
    "compiler": ["models", "strategies", "training", "data", "planner", "bench", *ENTRY],
    "parallel": ["compiler", "strategies", "training", "data", "planner", "bench", *ENTRY],
    "data": ["models", "compiler", "parallel", "strategies", "training", "planner", "bench",
             *ENTRY],
    "strategies": ["training", "data", "planner", "bench", *ENTRY],
    "training": ["compiler", "planner", "bench", *ENTRY],
    # the planner traces models and strategies with the compiler (and validates with training's
    # step): it sits above them all, below pretrain's flags
    "planner": ["bench", *ENTRY],
    # bench/ (the benchmark's and the GPU check's logic) measures every strategy and compares
    # with the planner: it sits above them all, and nothing of the package imports it
    "bench": [*ENTRY],
    GROUND: ["models", "compiler", "parallel", "data", "strategies", "training", "planner",
             "bench", "config.arguments", "config.run_config", "torch"],
}
# parallel/ reaches into models only through the attention entry point and the shared loss
ALLOWED = {"parallel": {"models.attention", "models.loss"}}
# the floors, bottom first: an import may stay on its floor or go down, never up
FLOORS = [
    [GROUND, "models", "data"],
    ["parallel"],
    ["compiler"],
    ["strategies"],
    ["training"],
    ["planner"],
    ["bench"],
    ENTRY,
]
MAX_LINES = 500


def modules_of(root: str, package: str) -> dict:
    """``{dotted module name: path}`` of every ``.py`` file of ``root/package``."""
    out = {}
    for dirpath, _, files in os.walk(os.path.join(root, package)):
        for f in sorted(files):
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                rel = os.path.relpath(path, root)[:-3].replace(os.sep, ".")
                out[rel[:-len(".__init__")] if rel.endswith(".__init__") else rel] = path
    return out


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> list[str]:
    """The module ``from X import a, b`` names, then ``X.a``, ``X.b`` (modules or not)."""
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


def _imports(module: str, path: str) -> set[str]:
    """Every name ``module`` imports, at module level or inside functions and classes."""
    out = set()
    is_package = path.endswith("__init__.py")
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            out |= set(_resolve(module, is_package, node))
    return out


def _known(name: str, modules: dict) -> str:
    """The package module an imported name refers to ('' for outside modules)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name


def import_graph(modules: dict) -> dict:
    """``{module: {package modules it imports}}``, lazy imports included. A module's own parent
    packages are left out (``from . import x`` names the package only to reach ``x``)."""
    graph = {}
    for module, path in modules.items():
        deps = {_known(n, modules) for n in _imports(module, path)}
        graph[module] = {d for d in deps if d and d != module and not module.startswith(d + ".")}
    return graph


def find_cycles(graph: dict) -> list[list[str]]:
    """The strongly connected components of ``graph`` with more than one module, sorted (each
    holds at least one cycle)."""
    index, low, on_stack, stack, out = {}, {}, set(), [], []

    def visit(v):  # Tarjan; the package's graph is shallow enough for recursion
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def private_imports(modules: dict) -> list[str]:
    """Private names (``_x``, not dunders) one module of the package takes from another: by
    ``from m import _x``, or as ``m._x`` of an imported module ``m``."""
    def private(name):
        return name.startswith("_") and not name.startswith("__")

    bad = []
    for module, path in modules.items():
        tree = ast.parse(open(path).read())
        is_package = path.endswith("__init__.py")
        bound = {}  # local name -> package module it is bound to
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                names = _resolve(module, is_package, node)
                source = names[0] if node.module is not None else None
                for alias, full in zip(node.names, names[-len(node.names):]):
                    if full in modules:
                        bound[alias.asname or alias.name] = full
                    elif source in modules and source != module and private(alias.name):
                        bad.append(f"{module} imports {alias.name} from {source}")
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name in modules and alias.asname:
                        bound[alias.asname] = alias.name
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                    and private(node.attr) and bound.get(node.value.id, module) != module:
                bad.append(f"{module} uses {bound[node.value.id]}.{node.attr}")
    return sorted(set(bad))


def room_of(module: str) -> str:
    parts = module.split(".")
    if ".".join(parts[1:3]) == GROUND or module == f"{PACKAGE}.{GROUND.rpartition('.')[0]}":
        return GROUND  # (the package's __init__ imports nothing: the ground floor too)
    return parts[1] if len(parts) > 1 else module


def _ground(name: str) -> bool:
    """Whether an imported name is the ground-floor plumbing (or its package, whose
    ``__init__`` imports nothing: test_the_config_package_init_imports_nothing)."""
    ground = f"{PACKAGE}.{GROUND}"
    return name == ground.rpartition(".")[0] or name == ground or name.startswith(ground + ".")


MODULES = modules_of(ROOT, PACKAGE)
GRAPH = import_graph(MODULES)


@pytest.mark.parametrize("room", sorted(FORBIDDEN))
def test_rooms_keep_to_themselves(room):
    bad = []
    for module, path in MODULES.items():
        if not module.startswith(f"{PACKAGE}.{room}"):
            continue
        for name in _imports(module, path):
            if name.startswith("tools") or name.startswith("tests"):
                bad.append(f"{module} imports {name}")
            for other in FORBIDDEN[room]:
                target = other if other.startswith("torch") else f"{PACKAGE}.{other}"
                if (name == target or name.startswith(target + ".")) and not any(
                        name.startswith(f"{PACKAGE}.{ok}") for ok in ALLOWED.get(room, ())) \
                        and not _ground(name):
                    bad.append(f"{module} imports {name}")
    assert not bad, "\n".join(sorted(set(bad)))


def test_the_config_package_init_imports_nothing():
    """Importing ``autosp_lm.config.cli`` runs the package's ``__init__``: it must stay free."""
    init = f"{PACKAGE}.{GROUND.rpartition('.')[0]}"
    assert not _imports(init, MODULES[init])


def test_every_room_is_on_a_floor():
    rooms = {room_of(m) for m in MODULES if m != PACKAGE}
    placed = {r for floor in FLOORS for r in floor}
    assert rooms <= placed, f"put {sorted(rooms - placed)} on a floor of FLOORS"


def test_no_import_runs_up_a_floor():
    floor = {r: i for i, rooms in enumerate(FLOORS) for r in rooms}
    bad = [f"{a} (floor {floor[room_of(a)]}) imports {b} (floor {floor[room_of(b)]})"
           for a, deps in GRAPH.items() for b in deps
           if room_of(a) in floor and room_of(b) in floor
           and floor[room_of(b)] > floor[room_of(a)]]
    assert not bad, "\n".join(sorted(bad))


def test_no_import_cycles():
    """No cycle among the package's modules, imports inside functions included."""
    cycles = find_cycles(GRAPH)
    assert not cycles, "\n".join(
        "cycle among " + ", ".join(c) + ": " + "; ".join(
            f"{a} -> {b}" for a in c for b in sorted(GRAPH[a] & set(c))) for c in cycles)


def test_no_private_names_across_modules():
    """A name with a leading underscore stays in its module: what others need is public."""
    bad = private_imports(MODULES)
    assert not bad, "\n".join(bad)


def _write_package(tmp_path, files: dict) -> dict:
    for rel, text in files.items():
        path = tmp_path / "pkg" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return modules_of(str(tmp_path), "pkg")


def test_the_checks_see_lazy_cycles_and_private_names(tmp_path):
    """The checker itself: a cycle closed by an import inside a function, and private names
    taken from another module (by import or as an attribute), are found; a module's own
    private names, dunders and imports of the parent package are not."""
    modules = _write_package(tmp_path, {
        "__init__.py": "",
        "a.py": "from .b import helper\n",
        "b.py": "def helper():\n    from . import a  # lazy: still a cycle\n    return a\n",
        "c.py": "from .a import _hidden\n_own = 1\n",
        "d.py": "from . import a\nfrom .sub import x\nVALUE = a._hidden + x.__name__.__len__()\n",
        "sub/__init__.py": "",
        "sub/x.py": "from .. import sub\nfrom . import y\n__all__ = ['y']\n",
        "sub/y.py": "",
    })
    graph = import_graph(modules)
    assert find_cycles(graph) == [["pkg.a", "pkg.b"]]
    assert graph["pkg.sub.x"] == {"pkg.sub.y"}  # the parent package is not an edge
    assert private_imports(modules) == ["pkg.c imports _hidden from pkg.a",
                                        "pkg.d uses pkg.a._hidden"]
    del graph["pkg.b"]
    assert find_cycles(graph) == []


def test_no_oversized_modules():
    big = {m: n for m, p in MODULES.items() if (n := sum(1 for _ in open(p))) > MAX_LINES}
    assert not big, big


def test_every_pass_says_what_it_expects_rewrites_and_guarantees():
    passes = [m for m in MODULES if m.startswith("autosp_lm.compiler.passes.")
              and not m.endswith(("sac_graph", "sac_cost"))]
    assert len(passes) >= 6
    for m in passes:
        doc = (ast.get_docstring(ast.parse(open(MODULES[m]).read())) or "").lower()
        for word in ("expects", "rewrites", "afterwards"):
            assert word in doc, f"{m}: docstring lacks '{word}'"

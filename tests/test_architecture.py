"""The layering of the code, read from the source with `ast` (nothing is imported): every import
points down the layer order `LAYERS`, no import cycle between modules, models/ free of training/
and DeepSpeed, training/errors.py a leaf, and no function under training/, data/ or benchmarks/
longer than a screen (docs/architecture.md).

Every import counts: at module level and inside functions, `import x` and `from x import y`.
`from a.b import c` imports the module `a.b.c` if there is one, else `a.b`; a name resolves to its
longest prefix that is one of our modules, and a package is its `__init__.py`."""

from __future__ import annotations

import ast
import re
from collections.abc import Container, Iterable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("training", "models", "data", "launch", "benchmarks")
MAX_FUNCTION_LINES = 80


# ------------------------------------------------------------------------------ the import graph
def find_modules(root: Path, packages: Iterable[str] = PACKAGES) -> dict[str, Path]:
    """{dotted module name: its file} for every .py under the packages (a package is its
    __init__.py)."""
    out = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def imported_names(tree: ast.AST, module: str, is_package: bool) -> list[tuple[str, int]]:
    """(dotted name, line) of every import anywhere in `tree` (module level, functions, classes).
    `from a import b` gives `a.b`: resolving it to our longest module prefix makes it the module
    a.b if there is one, else a. Relative imports are made absolute."""
    package = module if is_package else module.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the module's package, one level up per extra dot
                parts = package.split(".") if package else []
                base = parts[: len(parts) - (node.level - 1)]
                base += node.module.split(".") if node.module else []
                source = ".".join(base)
            else:
                source = node.module
            for alias in node.names:
                name = f"{source}.{alias.name}" if source else alias.name
                out.append((name, node.lineno))
    return out


def resolve(name: str, modules: Container[str]) -> str | None:
    """The longest prefix of `name` that is one of `modules` (None: not one of ours)."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        candidate = ".".join(parts[:n])
        if candidate in modules:
            return candidate
    return None


def module_imports(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The modules of ours that `module` imports (`from a.b import c`: a.b.c if that is a module,
    else a.b)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    targets = {
        resolve(name, modules) for name, _ in imported_names(tree, module, _is_package(path))
    }
    return targets - {None, module}


def _is_package(path: Path) -> bool:
    return path.name == "__init__.py"


def import_graph(root: Path = REPO, packages: Iterable[str] = PACKAGES) -> dict[str, set[str]]:
    modules = find_modules(root, packages)
    return {m: module_imports(m, p, modules) for m, p in modules.items()}


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle [a, b, ..., a] through each strongly connected component that has one
    (Tarjan's algorithm, iterative), in a stable order."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    nodes = sorted(set(graph) | {t for ts in graph.values() for t in ts})
    for start in nodes:
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, ()))))]
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
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1 or node in graph.get(node, ()):
                    components.append(sorted(component))
    return [_cycle_in(sorted(c), graph) for c in sorted(components)]


def _cycle_in(component: list[str], graph: dict[str, set[str]]) -> list[str]:
    """The shortest path from the component's first module back to itself, inside it."""
    first, members = component[0], set(component)
    came_from: dict[str, str] = {}
    frontier = [first]
    while frontier:
        nxt = []
        for node in frontier:
            for child in sorted(graph.get(node, ())):
                if child not in members:
                    continue
                if child == first:  # walk back from `node` to `first`
                    path = [node]
                    while path[-1] != first:
                        path.append(came_from[path[-1]])
                    return [*reversed(path), first]
                if child not in came_from:
                    came_from[child] = node
                    nxt.append(child)
        frontier = nxt
    raise AssertionError(f"no cycle in component {component}")  # cannot happen


# ------------------------------------------------------------------------------ the layer order
# The layers, bottom to top: a module imports only from its own layer or one below it, never up.
# Layers in one row sit side by side: neither imports the other. A layer is one or more names
# (space-separated); a name is that module and everything under it, and `p.*` is the package p's
# __init__.py and the modules directly in p (not its subpackages). A module is in the layer of
# its longest matching name. docs/architecture.md draws this order; keep the two alike.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("models", "data"),  # below all of training/
    ("training.errors",),
    ("training.settings", "training.runtime"),
    ("training.memory",),
    ("training.engines",),
    ("training.objectives",),  # what a micro-batch's loss is: the loop and the entry point call it
    ("training.checkpoints",),
    ("training.loop",),
    ("training.evaluation",),  # lm-evaluation-harness on exports: above checkpoints/
    # the entry points: train.py, startup.py, run_exit.py, the command shims, ...; and preflight,
    # a module or a package training/preflight/ with submodules
    ("training.* training.preflight",),
    ("launch",),  # the launchers' helpers (the doctor): any layer
    ("benchmarks",),  # measurements of all of it: any layer, and nothing imports them
)

# Imports let through against the order, as (importer, imported), each with a comment saying why
# and when it goes: none today.
KNOWN_VIOLATIONS: set[tuple[str, str]] = set()


def _matches(pattern: str, module: str) -> int:
    """How specific `pattern`'s match of `module` is (its length in parts), 0 for no match."""
    if pattern.endswith(".*"):
        package = pattern[:-2]
        inside = module == package or module.rpartition(".")[0] == package
        return len(package.split(".")) if inside else 0
    inside = module == pattern or module.startswith(pattern + ".")
    return len(pattern.split(".")) if inside else 0


def layer_of(module: str, layers=LAYERS) -> tuple[int, str] | None:
    """(row in `layers`, bottom 0; the name it matched) of the module; None: in no layer. A row's
    entry may hold several names (space-separated) that make one layer, not side by side."""
    best, found = 0, None
    for row, entries in enumerate(layers):
        for entry in entries:
            for pattern in entry.split():
                n = _matches(pattern, module)
                if n > best:
                    best, found = n, (row, entry)
    return found


def layer_violations(
    graph: dict[str, set[str]], layers=LAYERS, known: Container[tuple[str, str]] = ()
) -> list[str]:
    """'module -> imported (layer X imports layer Y above it)' for every import that is not
    down or within its layer, and 'module (in no layer)' for a module `layers` does not place."""
    found = []
    for module in sorted(graph):
        mine = layer_of(module, layers)
        if mine is None:
            found.append(f"{module} (in no layer: add its package to LAYERS)")
            continue
        for target in sorted(graph[module]):
            theirs = layer_of(target, layers)
            if theirs is None or theirs == mine or (module, target) in known:
                continue
            if theirs[0] > mine[0]:
                where = "above it"
            elif theirs[0] == mine[0]:
                where = "beside it"
            else:
                continue
            found.append(
                f"{module} -> {target} (layer {mine[1]} imports layer {theirs[1]} {where})"
            )
    return found


# ------------------------------------------------------------------------------ the checks
def test_the_cycle_finder_finds_a_planted_cycle():
    acyclic = {"a": {"b", "c"}, "b": {"c"}, "c": set(), "d": {"a"}}
    assert find_cycles(acyclic) == []
    planted = {**acyclic, "c": {"d"}}  # a -> c -> d -> a, and a -> b -> c -> d -> a
    assert find_cycles(planted) == [["a", "c", "d", "a"]]
    two = {"x": {"y"}, "y": {"x"}, "p": {"q"}, "q": {"r"}, "r": {"p"}, "s": {"s"}}
    assert find_cycles(two) == [["p", "q", "r", "p"], ["s", "s"], ["x", "y", "x"]]


def test_imports_are_read_as_python_resolves_them(tmp_path):
    """A tiny package tree: module- and function-level imports, `from a.b import c` as a.b.c when
    that is a module and as a.b when c is a name in it, relative imports, packages as their
    __init__.py; and a cycle planted through a function-level import is found."""
    files = {
        "pkg/__init__.py": "from pkg.sub import helper\n",
        "pkg/sub/__init__.py": "def helper():\n    pass\n",
        "pkg/sub/leaf.py": "import os\nfrom pkg.sub import helper\n",
        "pkg/a.py": "from pkg.sub import leaf\nfrom . import b\n",
        "pkg/b.py": "def f():\n    from .sub.leaf import x\n    import pkg.a.nothing\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    graph = import_graph(tmp_path, ["pkg"])
    assert graph == {
        "pkg": {"pkg.sub"},
        "pkg.sub": set(),
        "pkg.sub.leaf": {"pkg.sub"},
        "pkg.a": {"pkg.sub.leaf", "pkg.b"},
        "pkg.b": {"pkg.sub.leaf", "pkg.a"},
    }
    assert find_cycles(graph) == [["pkg.a", "pkg.b", "pkg.a"]]


def test_no_import_cycles():
    graph = import_graph()
    assert {"training.errors", "training.train", "models", "data", "launch.doctor"} <= set(graph)
    assert sum(map(len, graph.values())) > 100  # the walk really read the imports
    cycles = find_cycles(graph)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_every_import_points_down_the_layers():
    graph = import_graph()
    placed = {m: layer_of(m) for m in graph}
    assert placed["training.train"] == placed["training.preflight"] == placed["training"]
    assert placed["training.runtime.safe_load"][1] == "training.runtime"
    assert sum(map(len, graph.values())) > 100  # the walk really read the imports
    found = layer_violations(graph, known=KNOWN_VIOLATIONS)
    assert not found, "imports against the layer order (LAYERS):\n" + "\n".join(found)


def test_the_layer_check_sees_a_planted_violation(tmp_path):
    """A tiny tree in the real layers: imports down, within a layer and into a preflight
    package pass; one up, one between side-by-side layers, one from models/ into data/ and a
    module in no layer are each named; a known violation is let through."""
    files = {
        "training/__init__.py": "",
        "training/errors.py": "",
        "training/settings/__init__.py": "",
        "training/settings/flags.py": "from training import errors\n",
        "training/runtime/distributed.py": "def f():\n    from training.settings import flags\n",
        "training/engines/base.py": "from training.runtime import distributed\n",
        "training/engines/ds.py": "from training.engines import base\nimport training.loop.loop\n",
        "training/loop/loop.py": "from training.engines import base\n",
        "training/preflight/__init__.py": "from training.preflight import checks\n",
        "training/preflight/checks.py": "from training.loop import loop\nimport models.llama\n",
        "training/train.py": "from training import preflight\nfrom training.preflight import checks\n",
        "training/extra/thing.py": "",
        "models/llama.py": "import data.reader\n",
        "data/reader.py": "import numpy\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    graph = import_graph(tmp_path, ["training", "models", "data"])
    assert layer_of("training.preflight.checks") == layer_of("training.train")
    assert layer_of("training.preflight") == layer_of("training")
    assert layer_violations(graph) == [
        "models.llama -> data.reader (layer models imports layer data beside it)",
        "training.engines.ds -> training.loop.loop "
        "(layer training.engines imports layer training.loop above it)",
        "training.extra.thing (in no layer: add its package to LAYERS)",
        "training.runtime.distributed -> training.settings.flags "
        "(layer training.runtime imports layer training.settings beside it)",
    ]
    known = {("models.llama", "data.reader")}
    assert layer_violations(graph, known=known)[0].startswith("training.engines.ds")


FORBIDDEN_IN_MODELS = ("training", "deepspeed", "transformers.integrations.deepspeed")


def _forbidden(name: str) -> bool:
    return name.split(".")[-1] == "HfDeepSpeedConfig" or any(
        name == f or name.startswith(f + ".") for f in FORBIDDEN_IN_MODELS
    )


def test_models_import_neither_training_nor_deepspeed():
    """models/ is the model alone: usable with stock transformers, without DeepSpeed installed."""
    found = []
    modules = {m: p for m, p in find_modules(REPO).items() if m.split(".")[0] == "models"}
    assert "models.llama" in modules
    for module, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        names = imported_names(tree, module, _is_package(path))
        names += _literal_dynamic_imports(tree)
        rel = path.relative_to(REPO)
        found += [f"{rel}:{line}: {name}" for name, line in names if name and _forbidden(name)]
    assert not found, "models/ imports training or DeepSpeed:\n" + "\n".join(sorted(set(found)))


def test_the_models_check_knows_what_is_forbidden():
    for name in ("training", "training.errors", "deepspeed", "deepspeed.zero.Init"):
        assert _forbidden(name), name
    assert _forbidden("transformers.integrations.deepspeed.HfDeepSpeedConfig")
    assert _forbidden("transformers.integrations.HfDeepSpeedConfig")
    for name in ("torch", "transformers", "transformers.integrations.sdpa", "deepspeedish"):
        assert not _forbidden(name), name
    tree = ast.parse("def f():\n    import importlib\n    importlib.import_module('deepspeed')\n")
    assert _literal_dynamic_imports(tree) == [("deepspeed", 3)]


def _literal_dynamic_imports(tree: ast.AST) -> list[tuple[str, int]]:
    """importlib.import_module("x") and __import__("x") with a literal name."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
            if name in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                out.append((node.args[0].value, node.lineno))
    return out


def test_errors_is_a_leaf():
    path = REPO / "training" / "errors.py"
    names = imported_names(ast.parse(path.read_text()), "training.errors", False)
    ours = sorted({n for n, _ in names if n and n.split(".")[0] in PACKAGES})
    assert not ours, f"training/errors.py imports {ours}"


def long_functions(root: Path, limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """'path:line name (n lines)' of every function or method under `root` longer than `limit`
    lines, def line to last line (nested ones too)."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > limit:
                    where = f"{path.relative_to(root.parent)}:{node.lineno}"
                    found.append(f"{where} {node.name} ({n} lines)")
    return found


def test_no_function_in_training_data_or_benchmarks_is_longer_than_80_lines():
    found = [
        f for folder in ("training", "data", "benchmarks") for f in long_functions(REPO / folder)
    ]
    assert not found, f"longer than {MAX_FUNCTION_LINES} lines:\n" + "\n".join(found)


def test_the_length_check_sees_a_long_function(tmp_path):
    body = "".join(f"        x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES - 1))
    (tmp_path / "long.py").write_text(
        f"def ok():\n{body}\nclass C:\n    def too_long(self):\n{body}        pass\n"
    )
    name = tmp_path.name
    line, n = MAX_FUNCTION_LINES + 3, MAX_FUNCTION_LINES + 1
    assert long_functions(tmp_path) == [f"{name}/long.py:{line} too_long ({n} lines)"]


# ------------------------------------------------------------------ behaviour comes from settings
# Below training/preflight/ nothing reads the environment to choose what runs: every such
# choice is a setting (training/settings/run_config.py) resolved once in preflight (docs/settings.md).
# What may be read is plumbing: where the launcher put this rank, and the settings of the
# libraries and tools we drive, read as they themselves would.
PLUMBING_VARS = {
    # the launcher's layout of the ranks (torchrun, DeepSpeed's launcher, SLURM via them)
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "LOCAL_SIZE", "MASTER_ADDR",
    "MASTER_PORT", "OMP_NUM_THREADS",
    "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT",
    "ACCELERATE_DEEPSPEED_CONFIG_FILE",  # what accelerate launch hands over
    # torch.load's own safety switches, set and restored around a load
    "TORCH_FORCE_WEIGHTS_ONLY_LOAD", "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD",
    # libraries' and tools' own settings, as they read them
    "WANDB_DIR", "TOKENIZERS_PARALLELISM", "HF_HUB_OFFLINE", "HF_ENDPOINT", "XDG_CACHE_HOME",
    "CXX", "TORCH_EXTENSIONS_DIR",
}  # fmt: skip
# Reads whose key is computed, each for a reason: (module, why).
COMPUTED_ENV_READS = {
    "training.runtime.safe_load": "saves and restores torch's two weights-only switches",
    "training.runtime.nccl_env": "records the NCCL library variables a run starts with",
}


def _is_entry_point(module: str) -> bool:
    """train.py and its siblings directly in training/, and the preflight package."""
    parts = module.split(".")
    return parts[0] == "training" and (len(parts) == 2 or parts[1:2] == ["preflight"])


def env_reads(tree: ast.AST) -> list[tuple[str, int]]:
    """(variable, line) of every read or write of os.environ / os.getenv in `tree`, through
    `env = os.environ` aliases too; a key that is not a literal or a module-level string constant
    is "<computed>"."""
    constants = {
        t.id: node.value.value
        for node in getattr(tree, "body", [])
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
        for t in node.targets
        if isinstance(t, ast.Name) and isinstance(node.value.value, str)
    }

    def is_environ(node) -> bool:
        return (
            isinstance(node, ast.Attribute)
            and node.attr == "environ"
            and isinstance(node.value, ast.Name)
            and node.value.id == "os"
        )

    aliases = {
        t.id
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign) and is_environ(node.value)
        for t in node.targets
        if isinstance(t, ast.Name)
    }

    def environ(node) -> bool:
        return is_environ(node) or (isinstance(node, ast.Name) and node.id in aliases)

    def key(node) -> str:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return node.value
        if isinstance(node, ast.Name) and node.id in constants:
            return constants[node.id]
        return "<computed>"

    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript) and environ(node.value):
            found.append((key(node.slice), node.lineno))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args:
            f = node.func
            on_environ = environ(f.value) and f.attr in ("get", "setdefault", "pop")
            getenv = f.attr == "getenv" and isinstance(f.value, ast.Name) and f.value.id == "os"
            if on_environ or getenv:
                found.append((key(node.args[0]), node.lineno))
        elif isinstance(node, ast.Compare) and any(environ(c) for c in node.comparators):
            found.append((key(node.left), node.lineno))
    return found


def test_the_env_reader_sees_every_shape_of_read():
    tree = ast.parse(
        "import os\nNAME = 'B'\n"
        "def f(k):\n    env = os.environ\n    env.get('A')\n    os.environ[NAME]\n"
        "    os.getenv('C', '1')\n    return 'D' in env, os.environ.get(k)\n"
    )
    assert sorted(env_reads(tree)) == [("<computed>", 8), ("A", 5), ("B", 6), ("C", 7), ("D", 8)]


def test_nothing_below_preflight_reads_the_environment_to_choose_behaviour():
    """Every os.environ read outside train.py, its siblings and training/preflight/ is launcher
    or library plumbing, and no code there names a ZEROSTACK_ variable."""
    found = []
    for module, path in find_modules(REPO, ("training", "models", "data")).items():
        if _is_entry_point(module):
            continue
        text = path.read_text()
        rel = path.relative_to(REPO)
        found += [f"{rel}: names a ZEROSTACK_ variable" for _ in [0] if "ZEROSTACK_" in text]
        for name, line in env_reads(ast.parse(text, filename=str(path))):
            computed_ok = name == "<computed>" and module in COMPUTED_ENV_READS
            if name not in PLUMBING_VARS and not computed_ok:
                found.append(f"{rel}:{line}: reads ${name}")
    assert not found, (
        "behaviour read from the environment below preflight (make it a flag in "
        "training/settings/run_config.py, resolved in training/preflight/):\n" + "\n".join(found)
    )


def test_every_flag_is_in_the_settings_reference():
    """docs/settings.md lists every flag of the trainer (the reference a user reads)."""
    from training.settings.run_config import settings

    text = (REPO / "docs" / "settings.md").read_text()
    missing = [s.flag for s in settings() if not s.hidden and f"`{s.flag}" not in text]
    assert not missing, f"flags missing from docs/settings.md: {missing}"


# A file's name says its one job: no two modules of the product share one (a package's
# __init__.py and __main__.py, and each package's own errors.py, excepted).
SHARED_NAMES = {"__init__.py", "__main__.py", "errors.py"}


def duplicate_names(paths: list[Path]) -> dict[str, list[str]]:
    by_name: dict[str, list[str]] = {}
    for p in paths:
        if p.name not in SHARED_NAMES:
            by_name.setdefault(p.name, []).append(str(p))
    return {n: sorted(ps) for n, ps in by_name.items() if len(ps) > 1}


def test_module_names_are_unique_across_the_tree():
    roots = ("training", "models", "data", "launch", "benchmarks")
    paths = [p.relative_to(REPO) for r in roots for p in (REPO / r).rglob("*.py")]
    assert not duplicate_names(paths), duplicate_names(paths)
    assert duplicate_names([Path("a/resume.py"), Path("b/resume.py")]) == {
        "resume.py": ["a/resume.py", "b/resume.py"]
    }


# ------------------------------------------------------------------ the diagram in the docs
DIAGRAM_FOLDERS = {"entry points": "training", "benchmarks/": "benchmarks", "launch/": "launch"}
DIAGRAM_PARTIAL = {"benchmarks"}  # drawn with "...": only what it names must exist


def diagram_listing(text: str) -> dict[str, list[str]]:
    """{folder from the repo root: the names drawn on its line(s)} from the layer diagram of
    docs/architecture.md. A line that starts in the first column opens a folder (training's
    layers are named relative to training/); an indented line goes on with the open one, and
    `preflight/` inside the entry points opens training/preflight."""
    block = text.split("## The layers", 1)[1].split("```")[1]
    listing: dict[str, list[str]] = {}
    folder = None
    for line in block.splitlines():
        if not line.strip() or line.lstrip().startswith("- -") or line.strip() == "beside":
            continue
        names = line.split()
        if not line.startswith(" "):
            head = "entry points" if line.startswith("entry points") else names[0]
            names = names[2:] if head == "entry points" else names[1:]
            if head.endswith(".py"):  # a file of training/ on a line of its own
                folder, names = "training", [head]
            elif head in DIAGRAM_FOLDERS:
                folder = DIAGRAM_FOLDERS[head]
            elif head in ("models/", "data/"):
                folder = head.rstrip("/")
            else:
                folder = "training/" + head.rstrip("/")
        for name in names:
            if name == "...":
                break
            if name == "preflight/" and folder == "training":
                folder = "training/preflight"
                continue
            listing.setdefault(folder, []).append(name)
    return listing


def diagram_mismatches(root: Path, listing: dict[str, list[str]]) -> list[str]:
    """What the diagram draws that is not there, and the modules it leaves out (every .py but
    __init__.py of a folder it draws in full, and every package inside)."""
    wrong = []
    for folder, names in listing.items():
        for name in names:
            if not list((root / folder).glob(name.rstrip("/"))):
                wrong.append(f"{folder}/{name} is drawn but does not exist")
        if folder in DIAGRAM_PARTIAL:
            continue
        drawn = {n.rstrip("/").split("/")[0] for n in names}
        for path in sorted((root / folder).iterdir()):
            is_module = path.suffix == ".py" and path.name != "__init__.py"
            is_package = path.is_dir() and (path / "__init__.py").exists()
            listed_apart = f"{folder}/{path.name}" in listing
            if (is_module or is_package) and path.name not in drawn and not listed_apart:
                wrong.append(f"{folder}/{path.name} is not drawn")
    return wrong


def test_the_layer_diagram_draws_every_module_and_only_real_ones():
    text = (REPO / "docs" / "architecture.md").read_text()
    assert not diagram_mismatches(REPO, diagram_listing(text))
    table = set(re.findall(r"^\| `([\w/]+\.py)`", text, flags=re.M))
    assert table and not [p for p in table if not (REPO / "training" / p).exists()]


def test_the_diagram_check_sees_a_missing_and_an_undrawn_module(tmp_path):
    for name in ("a.py", "b.py", "__init__.py"):
        (tmp_path / "training" / "loop").mkdir(parents=True, exist_ok=True)
        (tmp_path / "training" / "loop" / name).write_text("")
    text = "## The layers\n\n```\nloop/          a.py  gone.py\n```\n"
    assert diagram_mismatches(tmp_path, diagram_listing(text)) == [
        "training/loop/gone.py is drawn but does not exist",
        "training/loop/b.py is not drawn",
    ]

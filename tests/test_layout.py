"""The package's shape, as docs/design.md promises it: stages without cycles, small files,
one copy of each shared piece, public seams between modules.

The 500-line cap holds for bench/*.py too. The import graph counts imports inside functions too. Such imports are allowed only for heavy
optional engines (vLLM, transformers and its tokenizers, datasets, Ray, NeMo AutoModel, Triton)
and for the module that needs Triton.

Private names (a leading underscore) stay in their module: no module of eagle_fast/ or kernels/
imports another's (`from m import _x`), imports a private module from outside its package
(`kernels._cpu` belongs to `kernels`), or reads or sets one through a module or a name it
imported (`m._x`, `Class._x`), or through any other object (`obj._x`) where `_x` is defined only
in other modules of ours. Not caught: `getattr(obj, "_x")`; `obj._x` where this module also
defines a `_x` of its own; a subclass reading its base class's `self._x`; third parties' private
names; tests and benchmarks (not scanned).

`extract`'s settings are resolved once: `ExtractConfig` is named only by the CLI, the plan module
that owns it (`pipeline/plan.py`: its `resolve` makes the `ExtractPlan` every later stage takes)
and the public API, which exports it by name; only the plan module's functions take one.
Not caught: an object of the class reached without its name (`type(x)`, `getattr`).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HEAVY = {"vllm", "transformers", "tokenizers", "datasets", "pyarrow", "ray", "nemo_automodel", "triton"}
LAZY_MODULES = {"eagle_fast.kernels.lm_head_triton": "needs triton, an optional engine"}
MAX_LINES = 500
# The stages in data-flow order (docs/design.md). A module may import its own stage and the
# stages before it, never one after it.
STAGES = [
    ("foundation", ("eagle_fast", "eagle_fast.errors", "eagle_fast.dtypes", "eagle_fast.files", "eagle_fast.hub",
                    "eagle_fast.memory", "eagle_fast.tiny", "eagle_fast.data")),
    ("inputs", ("eagle_fast.chat", "eagle_fast.sources", "eagle_fast.mixing", "eagle_fast.records", "eagle_fast.inputs")),
    ("kernels", ("eagle_fast.kernels",)),
    ("supervision", ("eagle_fast.supervision",)),
    ("target", ("eagle_fast.checkpoint", "eagle_fast.head_rules", "eagle_fast.head", "eagle_fast.runners")),
    ("store", ("eagle_fast.store",)),
    ("vocab", ("eagle_fast.vocab",)),
    ("pipeline", ("eagle_fast.pipeline",)),
    ("serve", ("eagle_fast.serve",)),
    ("loop", ("eagle_fast.loop",)),
    ("cli", ("eagle_fast.quiet", "eagle_fast.demo", "eagle_fast.cli_args", "eagle_fast.cli_loop", "eagle_fast.cli", "eagle_fast.__main__")),
]
# The modules `ExtractConfig` reaches, and the one whose functions take it (see the docstring).
CONFIG_NAMED_BY = {"eagle_fast.cli", "eagle_fast.pipeline.plan", "eagle_fast"}
CONFIG_TAKEN_BY = {"eagle_fast.pipeline.plan"}
MAX_CONFIG_FILES = 5


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted((ROOT / "eagle_fast").rglob("*.py")) + sorted((ROOT / "kernels").glob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[0] == "kernels":
            parts = ["eagle_fast", "kernels", *parts[1:]]
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _imports(name: str, path: Path):
    """(target module or external top-level name, inside a function?, line) for each import."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    in_function = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                   for n in ast.walk(f)}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            candidates = [f"{module}.{a.name}" for a in node.names] + [module]
        elif isinstance(node, ast.Import):
            candidates = [a.name for a in node.names]
        else:
            continue
        for target in candidates:
            while target and target not in MODULES and "." in target:
                target = target.rsplit(".", 1)[0]
            if target in MODULES or not target.startswith("eagle_fast"):
                if target != name:
                    yield target, id(node) in in_function, node.lineno
                break


def _stage(module: str) -> int:
    best = None
    for i, (_, prefixes) in enumerate(STAGES):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and (best is None or len(p) > best[1]):
                best = (i, len(p))
    assert best is not None, f"{module} belongs to no stage: add it to STAGES and docs/design.md"
    return best[0]


def test_import_graph_has_no_cycle():
    edges = {m: {t for t, _, _ in _imports(m, p) if t in MODULES} for m, p in MODULES.items()}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for t in sorted(edges[m]):
            assert state.get(t) != 1, f"import cycle: {' -> '.join(stack[stack.index(t):] + [t])}"
            if t not in state:
                visit(t)
        stack.pop()
        state[m] = 2

    for m in sorted(MODULES):
        if m not in state:
            visit(m)


def test_imports_point_along_the_data_flow():
    bad = []
    for m, p in MODULES.items():
        for t, _, line in _imports(m, p):
            if t in MODULES and _stage(t) > _stage(m) and m != "eagle_fast":
                bad.append(f"{p.relative_to(ROOT)}:{line}: {STAGES[_stage(m)][0]} imports "
                           f"{STAGES[_stage(t)][0]} ({t})")
    assert not bad, "\n".join(bad)


def test_imports_inside_functions_are_only_for_heavy_engines():
    bad = []
    for m, p in MODULES.items():
        for t, inside, line in _imports(m, p):
            if inside and t.split(".")[0] not in HEAVY and t not in LAZY_MODULES:
                bad.append(f"{p.relative_to(ROOT)}:{line}: import of {t} inside a function")
    assert not bad, "\n".join(bad)


def test_no_source_file_is_over_500_lines():
    """The package's modules and the benchmarks' (bench/*.py) alike."""
    files = [*MODULES.values(), *sorted((ROOT / "bench").glob("*.py"))]
    long = {str(p.relative_to(ROOT)): n for p in files if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, long


def _package_sources() -> str:
    return "\n".join(p.read_text() for p in MODULES.values())


def test_shared_pieces_exist_once():
    src = _package_sources()
    assert len(re.findall(r"^class UserError\b", src, re.MULTILINE)) == 1
    assert len(re.findall(r'"BF16"', src)) == 1, "safetensors dtype codes outside eagle_fast/dtypes.py"
    assert len(re.findall(r'"bfloat16": torch\.bfloat16', src)) == 1, "a second dtype-name table"
    assert src.count('"model.safetensors.index.json"') == 1, "a second checkpoint-tensor walker"


# -- private names stay in their module -----------------------------------------------------------
def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _outside_private_module(module: str, importer: str) -> bool:
    """Whether `module` has a private part that `importer` is outside of (a private module
    belongs to its package: `eagle_fast.kernels._cpu` to `eagle_fast.kernels`)."""
    parts = module.split(".")
    for i, part in enumerate(parts):
        package = ".".join(parts[:i])
        if _is_private(part) and importer != package and not importer.startswith(package + "."):
            return True
    return False


def _defined(tree: ast.AST) -> set[str]:
    """Private names a module defines: functions, classes, assigned names, arguments, imported
    aliases, and attributes it sets on self / cls."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            out.add(node.id)
        elif isinstance(node, ast.arg):
            out.add(node.arg)
        elif isinstance(node, ast.alias):
            out.add(node.asname or node.name.split(".")[0])
        elif (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
              and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
            out.add(node.attr)
    return {n for n in out if _is_private(n)}


def _private_crossings(name: str, is_package: bool, tree: ast.AST, elsewhere: set[str]):
    """(line, what) for each private name of another module that module `name` imports, reads
    or sets; `elsewhere`: the private names our other modules define."""
    package = name if is_package else name.rsplit(".", 1)[0]
    here = _defined(tree)
    bound: dict[str, str] = {}  # local name -> the module of ours it came from
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            if module in MODULES and _outside_private_module(module, name):
                yield node.lineno, f"imports from the private module {module}"
            for a in node.names:
                full = f"{module}.{a.name}"
                if full in MODULES:  # a submodule
                    if _outside_private_module(full, name):
                        yield node.lineno, f"imports the private module {full}"
                    bound[a.asname or a.name] = full
                elif module in MODULES:
                    if _is_private(a.name) and module != name:
                        yield node.lineno, f"imports {a.name} from {module}"
                    bound[a.asname or a.name] = module
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name in MODULES:
                    if _outside_private_module(a.name, name):
                        yield node.lineno, f"imports the private module {a.name}"
                    bound[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and _is_private(node.attr)):
            continue
        owner = node.value.id if isinstance(node.value, ast.Name) else None
        verb = "sets" if isinstance(node.ctx, ast.Store) else "reads"
        if owner in bound and bound[owner] != name:
            yield node.lineno, f"{verb} {owner}.{node.attr} ({bound[owner]})"
        elif owner not in ("self", "cls") and node.attr in elsewhere and node.attr not in here:
            yield node.lineno, f"{verb} {ast.unparse(node)}, a private name of another module"


def test_no_private_name_crosses_a_module_boundary():
    trees = {m: ast.parse(p.read_text()) for m, p in MODULES.items()}
    defined = {m: _defined(t) for m, t in trees.items()}
    bad = []
    for m, tree in trees.items():
        elsewhere = set().union(*(d for other, d in defined.items() if other != m))
        for line, what in _private_crossings(m, MODULES[m].name == "__init__.py", tree, elsewhere):
            bad.append(f"{MODULES[m].relative_to(ROOT)}:{line}: {what}")
    assert not bad, "make the name public in the module that owns it:\n" + "\n".join(bad)


def test_the_private_name_check_sees_each_kind_of_crossing():
    """The check above, on a module that crosses each way it claims to catch, and on one that
    keeps to its own names and the public ones."""
    crossing = ast.parse(
        "from eagle_fast.pipeline.config import fmt_secs, _hidden\n"
        "from eagle_fast.kernels import _cpu\n"
        "from eagle_fast.kernels._common import HeadOutput\n"
        "from eagle_fast.store import layouts\n"
        "from eagle_fast.runners.base import RunnerBase\n"
        "def f(head):\n"
        "    layouts._private_table\n"
        "    RunnerBase._scatter(1)\n"
        "    head._embed_weight = 1\n"
    )
    got = {what for _, what in _private_crossings("eagle_fast.serve.app", False, crossing, {"_embed_weight"})}
    assert got == {
        "imports _hidden from eagle_fast.pipeline.config",
        "imports the private module eagle_fast.kernels._cpu",
        "imports from the private module eagle_fast.kernels._common",
        "reads layouts._private_table (eagle_fast.store.layouts)",
        "reads RunnerBase._scatter (eagle_fast.runners.base)",
        "sets head._embed_weight, a private name of another module",
    }, got
    own = ast.parse(
        "from ._common import HeadOutput\n"  # a private module, from inside its package
        "class K:\n"
        "    def f(self, other):\n"
        "        self._x = other._x\n"  # its own private name, on another instance
    )
    assert list(_private_crossings("eagle_fast.kernels.reference", False, own, {"_x"})) == []


# -- extract's settings reach the plan module, which resolves them once --------------------------
def _config_uses(tree: ast.AST, name: str = "ExtractConfig") -> tuple[bool, bool]:
    """(whether the module names `name`: imports it, or reads it as a name, an attribute or a
    string, the public API's lazy export; whether one of its functions takes a `name` parameter)."""
    named = taken = False
    for node in ast.walk(tree):
        named |= ((isinstance(node, ast.alias) and (node.asname or node.name).split(".")[-1] == name)
                  or (isinstance(node, ast.Name) and node.id == name)
                  or (isinstance(node, ast.Attribute) and node.attr == name)
                  or (isinstance(node, ast.Constant) and node.value == name))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            a = node.args
            for arg in [*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg]:
                if arg is not None and arg.annotation is not None and name in ast.unparse(arg.annotation):
                    taken = True
    return named, taken


def test_extract_config_reaches_only_the_cli_the_plan_and_the_public_api():
    uses = {m: _config_uses(ast.parse(p.read_text())) for m, p in MODULES.items()}
    named = {m for m, (n, _) in uses.items() if n}
    taken = {m for m, (_, t) in uses.items() if t}
    assert named <= CONFIG_NAMED_BY, f"ExtractConfig named outside the CLI, the plan and the API: {named - CONFIG_NAMED_BY}"
    assert taken <= CONFIG_TAKEN_BY, f"functions outside the plan module take an ExtractConfig: {taken - CONFIG_TAKEN_BY}"
    assert len(named | taken) <= MAX_CONFIG_FILES, sorted(named | taken)
    import eagle_fast

    assert eagle_fast.ExtractConfig.__module__ == "eagle_fast.pipeline.plan"


def test_the_config_check_sees_each_kind_of_use():
    """The check above, on a module that names the config each way it claims to catch."""
    cases = {
        "from eagle_fast.pipeline.plan import ExtractConfig\n": (True, False),
        "import eagle_fast\nx = eagle_fast.ExtractConfig\n": (True, False),
        "_LAZY = {'ExtractConfig': 'eagle_fast.pipeline.plan'}\n": (True, False),
        "def run(cfg: 'ExtractConfig | None', *, other: int) -> None: ...\n": (False, True),
        "def run(plan: ExtractPlan) -> None: ...\n": (False, False),
    }
    for src, want in cases.items():
        assert _config_uses(ast.parse(src)) == want, src

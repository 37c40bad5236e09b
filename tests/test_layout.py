"""The package's shape, as ARCHITECTURE.md promises it: stages without cycles, small files,
one copy of each shared piece.

The import graph counts imports inside functions too. Such imports are allowed only for heavy
optional engines (vLLM, transformers and its tokenizers, datasets, Ray, NeMo AutoModel, Triton)
and for the module that needs Triton.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HEAVY = {"vllm", "transformers", "tokenizers", "datasets", "ray", "nemo_automodel", "triton"}
LAZY_MODULES = {"eagle_fast.kernels.lm_head_triton": "needs triton, an optional engine"}
MAX_LINES = 500
# The stages in data-flow order (ARCHITECTURE.md). A module may import its own stage and the
# stages before it, never one after it.
STAGES = [
    ("foundation", ("eagle_fast", "eagle_fast.errors", "eagle_fast.dtypes", "eagle_fast.files",
                    "eagle_fast.memory", "eagle_fast.tiny", "eagle_fast.data")),
    ("inputs", ("eagle_fast.inputs",)),
    ("kernels", ("eagle_fast.kernels",)),
    ("supervision", ("eagle_fast.supervision",)),
    ("target", ("eagle_fast.checkpoint", "eagle_fast.head", "eagle_fast.runners")),
    ("store", ("eagle_fast.store",)),
    ("vocab", ("eagle_fast.vocab",)),
    ("pipeline", ("eagle_fast.pipeline",)),
    ("serve", ("eagle_fast.serve",)),
    ("cli", ("eagle_fast.demo", "eagle_fast.cli", "eagle_fast.__main__")),
]


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
    assert best is not None, f"{module} belongs to no stage: add it to STAGES and ARCHITECTURE.md"
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
    long = {str(p.relative_to(ROOT)): n for p in MODULES.values()
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, long


def _package_sources() -> str:
    return "\n".join(p.read_text() for p in MODULES.values())


def test_shared_pieces_exist_once():
    src = _package_sources()
    assert len(re.findall(r"^class UserError\b", src, re.MULTILINE)) == 1
    assert len(re.findall(r'"BF16"', src)) == 1, "safetensors dtype codes outside eagle_fast/dtypes.py"
    assert len(re.findall(r'"bfloat16": torch\.bfloat16', src)) == 1, "a second dtype-name table"
    assert src.count('"model.safetensors.index.json"') == 1, "a second checkpoint-tensor walker"

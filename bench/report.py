"""Turn bench/results/*.json into bench/RESULTS.md and its subject pages (tables), and
bench/results/lm_head-*.png (plots).

What it does
    Reads every results file the benchmarks wrote (lm_head-cpu.json, lm_head-cuda.json,
    runner-cpu.json, pipeline-cpu.json, cpu_ops-cpu.json, serve-cpu.json, ray-cpu.json,
    host_path-cpu.json, storage-cpu.json, accept-cpu.json, keep_mass-cpu.json, floors-cpu.json,
    draft_types-cpu.json; whichever exist) and writes
    (bench_accept draws its own accept-cpu.png):
      - bench/RESULTS.md: bench/SUMMARY.md verbatim (hand-curated rows across machines), then a
        table of the subject pages and the other machines' pages;
      - bench/RESULTS-<subject>.md, one per subject in SUBJECTS: what it measures and on which
        machines, then per results file where/when it was measured, the targets as PASS/FAIL and
        its tables (the head's GPU page also carries results/lm_head_static-sm90.md,
        bench_lm_head_static.py's table with the reading of it);
      - bench/results/lm_head-<device>.png: time and peak extra memory vs vocabulary size, one
        line per provider, one column per output mode (matplotlib, Agg backend).
    Any other results folder (`--results DIR --page DIR/RESULTS.md`: a machine of its own, a GPU
    run) gets one page holding every section, in the same order.

Design
    Pure post-processing: no benchmark is re-run, so `python bench/report.py` refreshes the
    pages after results are added by hand (e.g. a GPU run's JSON from gpu_check.sh). Every ratio
    printed is between numbers from the same file, i.e. the same run. `render` is a pure function
    of the results folder (tests compare it with the committed pages); `build` draws the plots,
    renders and writes. This file orders the pages; the sections live by subject: report_head.py
    (head op, floor, plot, CPU building blocks), report_system.py (runner, pipeline, serve, Ray),
    report_data.py (storage, acceptance), report_keep_mass.py (keep-mass fidelity), all made of
    report_text.py's pieces. bench_host_path.py and its like render their own section into their
    JSON.

Limits
    Without matplotlib the plots are skipped with a message (the GPU image may lack it); the
    Markdown is always written. Needs the standard library only (storage's table also needs
    safetensors, and says so when it is missing). A subject page whose results files are all
    gone is not written, and an old copy of it is not deleted.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from report_data import accept_section, datagen_section, storage_section
from report_head import cpu_ops_section, floors_section, lm_head_section, plot_lm_head
from report_keep_mass import section as keep_mass_section
from report_system import pipeline_section, ray_section, runner_section, serve_section
from report_text import table

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
PAGE = HERE / "RESULTS.md"

# The subject pages, in order: name (the page is RESULTS-<name>.md beside RESULTS.md), title,
# what the page measures (its first line, and its row on the main page).
SUBJECTS = {
    "head-gpu": ("The head op on a GPU",
                 ("The Triton head (`eagle_fast.kernels.lm_head`) on CUDA, timed once `bench/gpu_check.sh` has run, "
                 "and its sm_90 binaries counted without a GPU.")),
    "head-cpu": ("The head op on a CPU",
                 ("The PyTorch head against the seed's fp32 path, plain torch and the bare GEMM of each shape, over "
                 "real vocabularies; the CPU building blocks it rests on.")),
    "runner": ("The runner",
               ("`VLLMTargetRunner` against the seed's method on one batch (throughput, peak memory, the head's "
               "share), and the head run inside the engine's worker against the file path.")),
    "extract": ("Extraction and data generation",
                ("`eagle-fast extract` per engine and storage option, its host path and engine overlap, Ray's "
                "workers, the chat masks, the engine check, and `regenerate` against a bare vLLM generate.")),
    "serve": ("Serving",
              ("`eagle-fast serve` against training in process and against NeMo's own server: tokens/s, server "
              "memory, CPU per request, the wire.")),
    "storage": ("Storage and keep-mass",
                ("Bytes per token of every storage option and what the compact ones lose (KL, top-1, mass kept), "
                "and `--keep-mass P` on targets as flat as a real LLM's.")),
    "acceptance": ("Acceptance",
                   ("What drafts trained on eagle_fast data accept against one trained on NeMo's own logits, with "
                   "NeMo's, speculators' and SpecForge's training steps and served by vLLM; speculators' own data "
                   "generation beside ours.")),
}


def subject_page(page: Path, name: str) -> Path:
    return page.with_name(f"{page.stem}-{name}.md")


def machine(env: dict) -> str:
    """The machine a results file names: device, and on a CPU its ISA."""
    dev = env.get("device_name", env.get("device"))
    return f"{dev}, {env.get('cpu_isa', 'ISA not recorded')}" if env.get("device") == "cpu" else dev


def measured_on(files: dict[str, dict]) -> str:
    """`**machine**: `file`, `file`; ...` over the results files a page renders."""
    by = {}
    for file, env in files.items():
        by.setdefault(machine(env), []).append(f"`{file}`")
    return "; ".join(f"**{m}**: {', '.join(fs)}" for m, fs in by.items()) or "no results file"


def sections(results: Path, page_dir: Path) -> dict[str, tuple[list[str], dict[str, dict]]]:
    """Per subject: its sections' lines, and the environment of each results file they render."""
    out = {name: ([], {}) for name in SUBJECTS}
    files = {p.stem: p for p in sorted(results.glob("*.json"))}

    def link(path: Path) -> str | None:  # image links are relative to the page
        return os.path.relpath(path, page_dir) if path.exists() else None

    def add(subject: str, lines: list[str], name: str | None = None) -> None:
        out[subject][0].extend(lines)
        if name:
            out[subject][1][files[name].name] = json.loads(files[name].read_text())["environment"]

    def load(name: str) -> dict:
        return json.loads(files[name].read_text())

    if "lm_head-cuda" not in files:
        add("head-gpu", ["## Head op, GPU", "", ("Not measured yet: no CUDA machine has run `bench/gpu_check.sh` "
            "(it writes `bench/results/lm_head-cuda.json`; then run `python bench/report.py`)."), ""])
    static = results / "lm_head_static-sm90.md"  # bench_lm_head_static.py's table and its reading
    if static.exists():
        add("head-gpu", [static.read_text().rstrip(), ""], "lm_head_static-sm90" if "lm_head_static-sm90" in files else None)
    for name, subject in (("lm_head-cuda", "head-gpu"), ("lm_head-cpu", "head-cpu")):
        if name in files:
            add(subject, lm_head_section(load(name), link(results / f"{name}.png")), name)
    capped = results / "avx2-capped" / "RESULTS.md"
    if capped.exists() and results.resolve() != capped.parent.resolve():
        add("head-cpu", [(f"The floor cases as an AVX2-only CPU runs them (`make bench-avx2`: torch, "
                          f"oneDNN and MKL capped to AVX2 on this machine): [{os.path.relpath(capped, page_dir)}]"
                          f"({os.path.relpath(capped, page_dir)})."), ""])
    renderers = (("cpu_ops-cpu", "head-cpu", cpu_ops_section), ("floors-cpu", "head-cpu", floors_section),
                 ("runner-cpu", "runner", runner_section),
                 ("pipeline-cpu", "extract", pipeline_section), ("serve-cpu", "serve", serve_section),
                 ("ray-cpu", "extract", ray_section))
    for name, subject, render_section in renderers:
        if name in files:
            add(subject, render_section(load(name)), name)
    for name, subject in (("head_in_worker-cpu", "runner"), ("host_path-cpu", "extract"), ("masks-cpu", "extract"),
                          ("engine_check-cpu", "extract"), ("regenerate-cpu", "extract"),
                          ("engine_accept-cpu", "acceptance"), ("draft_types-cpu", "acceptance")):  # their own section
        if name in files:
            add(subject, load(name)["markdown"] + [""], name)
    add("storage", storage_section(load("storage-cpu") if "storage-cpu" in files else None),
        "storage-cpu" if "storage-cpu" in files else None)
    if "keep_mass-cpu" in files:
        add("storage", keep_mass_section(load("keep_mass-cpu")), "keep_mass-cpu")
    if "accept-cpu" in files:
        add("acceptance", accept_section(load("accept-cpu"), link(results / "accept-cpu.png")), "accept-cpu")
    if "accept_trainers-cpu" in files:
        add("acceptance", accept_section(load("accept_trainers-cpu")), "accept_trainers-cpu")
    if "speculators_datagen-cpu" in files:
        add("acceptance", datagen_section(load("speculators_datagen-cpu")), "speculators_datagen-cpu")
    return out


def render(results: Path = RESULTS, page: Path = PAGE) -> dict[Path, str]:
    """The text of every page for `results`, by path: the main page and its subject pages for
    bench/results/, one page for any other folder. Writes nothing."""
    page, results = Path(page), Path(results)
    page_dir, results_dir = page.resolve().parent, results.resolve()
    readme = os.path.relpath(HERE / "README.md", page_dir)
    intro = [(f"Generated by `bench/report.py` from the JSON files in `{os.path.relpath(results_dir, HERE.parent)}/`; "
              f"do not edit by hand. How each number is measured: [bench/README.md]({readme}). CPU numbers come "
              "from a shared 2-core machine: only ratios within one run are claims; absolute times are only "
              "meaningful from a GPU."), ""]
    by_subject = sections(results, page_dir)
    if results_dir != RESULTS.resolve():  # a machine's own folder, a GPU run: one page
        text = ["# Benchmark results", "", *intro] + [line for lines, _ in by_subject.values() for line in lines]
        return {page: "\n".join(text).rstrip() + "\n"}
    pages, rows = {}, []
    for name, (lines, files) in by_subject.items():
        if not lines:
            continue
        title, what = SUBJECTS[name]
        path = subject_page(page, name)
        head = [f"# {title}", "", f"{what} Measured on {measured_on(files)}.", "",
                f"One page of [the benchmark results]({page.name}), which opens with the summary across machines. {intro[0]}", ""]
        pages[path] = "\n".join(head + lines).rstrip() + "\n"
        rows.append([f"[{title}]({path.name})", what, measured_on(files)])
    main = ["# Benchmark results", "", *intro]
    summary = HERE / "SUMMARY.md"  # hand-curated rows across machines: the main page only
    if summary.exists():
        main += [summary.read_text().rstrip(), ""]
    main += ["## The pages", "", "Every results file in full, one page per subject:", ""]
    main += table(["page", "what it measures", "measured on"], rows)
    others = sorted(p for p in results.glob("*/RESULTS.md"))
    if others:
        main += ["Machines with a folder of their own, each on one page:", ""]
        main += table(["page", "measured on"], [
            [f"[{os.path.relpath(p, page_dir)}]({os.path.relpath(p, page_dir)})",
             measured_on({f.name: json.loads(f.read_text())["environment"] for f in sorted(p.parent.glob("*.json"))})]
            for p in others])
    return {page: "\n".join(main).rstrip() + "\n", **pages}


def build(results: Path = RESULTS, page: Path = PAGE) -> str:
    """Draw the head's plots into `results`, then write `page` (and its subject pages); returns
    the text of `page`."""
    results = Path(results)
    for name in ("lm_head-cuda", "lm_head-cpu"):
        if (results / f"{name}.json").exists():
            plot_lm_head(json.loads((results / f"{name}.json").read_text()), results / f"{name}.png")
    pages = render(results, page)
    for path, text in pages.items():
        path.write_text(text)
    return pages[Path(page)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--results", type=Path, default=RESULTS)
    ap.add_argument("--page", type=Path, default=PAGE)
    a = ap.parse_args(argv)
    build(a.results, a.page)
    print(f"wrote {a.page} and its subject pages" if a.results.resolve() == RESULTS.resolve() else f"wrote {a.page}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

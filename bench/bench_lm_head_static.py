"""Static report of the Triton head on Hopper: what the sm_90 binaries say, with no GPU.

What it does
    Compiles `lm_head_fwd_kernel` for sm_90 (triton's `ASTSource` route, `_triton_aot.compile_for`,
    the launcher's own block sizes), and the persistent, TMA-fed `lm_head_persistent_kernel` for
    the modes it covers (`compile_persistent_for`, rows named persistent-*, 132 programs), at the real shape N=8192, H=4096, V=151,936 with a 32,000-id
    draft vocabulary, disassembles each cubin with the `cuobjdump` in the triton wheel, and
    records per variant: registers and spill bytes (ptxas log of the real compile), shared
    memory, the wgmma shape, whether the operands arrive by TMA (UTMALDG) or cp.async, the grid
    (CTAs and waves on 132 SMs), and the epilogue's SASS
    instructions per logit on draft tiles and on the other tiles. Writes JSON (`--json FILE`) and
    prints a markdown table.

How the epilogue is delimited in the SASS
    The main loop is the backward branch whose body holds the HGMMA (wgmma) instructions, or
    for fp32 weights (FFMA, no tensor cores) the largest loop. The epilogue is everything after
    that branch up to the last EXIT: the wgmma drain, scale / softcap, every reduction and
    store. It is cut into basic blocks at BRA targets and fall-throughs; a loop inside it (the
    top-k extraction rounds) is one block counted `trips` times (8 in a first pass,
    min(k, BLOCK_V) = 64 in the exact re-run), and a guard that jumps over a loop is not a path
    (n_rounds >= 1). The kernel branches on the tile: scale 1 or not, the ragged last tile, a
    draft tile, the last (mixed) draft tile. In the persistent kernel the main loop is the
    innermost HGMMA loop (the K loop) and the epilogue ends at the back-edge of the tile loop
    around it; its shortest path with more stores is the flush of a row block's running
    statistics (once per row block and lane), so its draft tiles are the shortest path with
    more stores than that one. Other tiles = the SHORTEST path from the
    epilogue's start to an EXIT; draft tiles = the shortest path with more global stores than
    that one (a full draft tile); the longest path (the mixed or ragged tile) is kept too.
    Divided by the logits one thread holds (BLOCK_N * BLOCK_V / (32 * num_warps)), that is
    `epilogue_sass_per_logit`. Static counts: issue slots, not cycles.
    `--baseline REV` runs the same analysis on the kernels of git revision REV.

Limits
    Needs triton (3.6-3.9) with its bundled ptxas and cuobjdump; ~15 s of one core per kernel.
    No GPU ran these kernels: the projection in bench/RESULTS-head-gpu.md is arithmetic on these counts.

Usage
    python bench/bench_lm_head_static.py --baseline 7d69297 \
        --json bench/results/lm_head_static-sm90.json
    python bench/bench_lm_head_static.py --all        # every variant the AOT test compiles
    python bench/bench_lm_head_static.py --only persistent-bf16-draft --merge \
        --json bench/results/lm_head_static-sm90.json   # redo some rows, keep the others
    python bench/bench_lm_head_static.py --blocks 128,256,64,12,8,3 --merge --json ...
        # the persistent modes on blocks the launcher does not choose (rows NAME@128x256-8w-3s)
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import io
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import asdict, replace
from pathlib import Path

import triton
from eagle_fast.kernels import _triton_aot as aot
from eagle_fast.kernels._triton_config import Config, Variant

N, H, V, VD, K = 8192, 4096, 151_936, 32_000, 64  # the issue's shape (Qwen3-8B, 32k draft)
SMS = 132  # H100 / H200 SXM
# The projection's machine: the H200 dense bf16 GEMM rate the projections assume (docs/gpu.md;
# no GPU run here measured it), its boost clock, and 4 warp schedulers per SM issuing one
# instruction per cycle each.
GEMM_TFLOPS, CLOCK_GHZ, ISSUE_PER_CYCLE = 790.0, 1.98, 4
FIRST_PASS_ROUNDS, EXACT_ROUNDS = 8, 64  # top-k loop trips (`_TOPK_ROUNDS`; min(k, BLOCK_V))
ROOT = Path(__file__).resolve().parents[1]

# The modes users run (bf16 weights), named as in tests/test_lm_head_aot.py.
CORE = {
    "bf16-argmax-nolse": Variant(lse=False),
    "bf16-lse-argmax": Variant(),
    "bf16-draft-argmax-nolse": Variant(draft=True, lse=False),
    "bf16-draft": Variant(draft=True),
    "bf16-topk": Variant(topk=True),
    "bf16-topk-rerun": Variant(topk=True, tile_list=True),
    "bf16-draft_topk": Variant(draft_topk=True, lse=False),
    "bf16-draft_topk-rerun": Variant(draft_topk=True, lse=False, tile_list=True),
    "bf16-draft_topk-draft": Variant(draft_topk=True, draft=True, lse=False),
    "bf16-softcap": Variant(softcap=True),
    "bf16-draft-softcap-argmax-nolse": Variant(draft=True, softcap=True, lse=False),
    "bf16-logits": Variant(logits=True, out="bf16"),
    "bf16-logprobs": Variant(logprobs=True),
}
# The persistent kernel's modes (absent from revisions before it: --baseline).
PERSISTENT = {"persistent-" + n: v for n, v in getattr(aot, "PERSISTENT_VARIANTS", {}).items()
              if not n.startswith("fp16")}  # fmt: skip

_INSTR = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Za-z0-9_.]*)([^;]*);")


def _bin(name: str) -> str:
    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name)


def parse_sass(sass: str) -> list[tuple[int, str, str, str]]:
    """[(address, predicate, opcode, operands)] of a cuobjdump -sass listing."""
    found = _INSTR.findall(sass)
    return [(int(a, 16), (p or "").strip(), op, rest.strip()) for a, p, op, rest in found]


def _target(operands: str) -> int | None:
    m = re.match(r"`?\(?(0x[0-9a-f]+)", operands.strip())
    return int(m.group(1), 16) if m else None


def epilogue_paths(instrs, trips: int, persistent: bool = False) -> dict:
    """Instruction counts of the paths through the epilogue (module header): the shortest, the
    shortest with more global stores than that one (a draft tile's), and the longest. In the
    `persistent` kernel the epilogue runs from the K loop (the innermost HGMMA loop) to the
    back-edge of the tile loop around it."""
    addr = [a for a, *_ in instrs]
    index = {a: i for i, a in enumerate(addr)}

    def target(i):
        op, rest = instrs[i][2], instrs[i][3]
        t = _target(rest) if op.startswith("BRA") else None
        return index.get(t) if t is not None else None

    loops = [(target(i), i) for i in range(len(instrs)) if (target(i) or len(instrs)) <= i]
    hgmma = [(a, b) for a, b in loops if any(instrs[j][2].startswith("HGMMA") for j in range(a, b))]
    main = max(hgmma, key=lambda ab: ab[1]) if hgmma else max(loops, key=lambda ab: ab[1] - ab[0])
    if not persistent:
        exits = [i for i, (_, p, op, _) in enumerate(instrs) if op == "EXIT" and not p]
        start, end = main[1] + 1, exits[-1]
    else:
        main = min(hgmma, key=lambda ab: ab[1] - ab[0])
        tile_loop = min(((a, b) for a, b in loops if a < main[0] and b > main[1]),
                        key=lambda ab: ab[1] - ab[0])  # fmt: skip
        start, end = main[1] + 1, tile_loop[1]
    inner = [(a, b) for a, b in loops if start <= a and b <= end]  # top-k rounds (not nested)
    in_loop = {i: (a, b) for a, b in inner for i in range(a, b + 1)}
    # blocks: a loop is one block of (body x trips); elsewhere BRA targets and fall-throughs
    leaders = {start}
    for i in range(start, end + 1):
        op = instrs[i][2]
        if (op.startswith("BRA") or op == "EXIT") and i not in in_loop:
            leaders.add(i + 1)
            if target(i) is not None and start <= target(i) <= end:
                leaders.add(target(i))
    for a, b in inner:
        leaders |= {a, b + 1}
    leaders = sorted(x for x in leaders if x <= end and (x not in in_loop or in_loop[x][0] == x))
    nxt = dict(zip(leaders, [*leaders[1:], end + 1]))

    def successors(b):
        hi = nxt[b]
        _, p, op, _ = instrs[hi - 1]
        if b in in_loop:  # its exits, and the fall-through after a predicated back-edge
            out = {target(i) for i in range(b, hi) if target(i) is not None and target(i) >= hi}
            return out | ({hi} if p else set())
        out = set()
        t = target(hi - 1)
        # a loop guard (a jump over a loop that starts right after it) is not a path:
        # n_rounds >= 1, every loop runs
        if t is not None and t >= hi and not any(hi <= a <= hi + 64 and t > z for a, z in inner):
            out.add(t)
        if not (op.startswith("BRA") or op == "EXIT") or p:
            out.add(hi)
        return {s for s in out if s <= end}

    # paths[b]: {global stores on the path: (shortest, longest)} from block b to an EXIT
    paths: dict[int, dict[int, tuple[int, int]]] = {}
    for b in reversed(leaders):
        hi = nxt[b]
        w = trips if b in in_loop else 1
        n = (hi - b) * w
        stores = w * sum(instrs[i][2].startswith("STG") for i in range(b, hi))
        last = instrs[hi - 1]
        done = last[2] == "EXIT" or hi - 1 == end  # an exit, or the tile loop's back-edge
        here: dict[int, tuple[int, int]] = {stores: (n, n)} if done else {}
        for s_ in successors(b):
            for c, (short, long) in paths.get(s_, {}).items():
                old = here.get(c + stores, (10**9, 0))
                here[c + stores] = (min(old[0], n + short), max(old[1], n + long))
        paths[b] = here
    ends = paths[start]
    base = min(ends, key=lambda c: ends[c][0])  # the stores of the shortest path
    # a persistent draft tile stores more than the flush of the running statistics, the
    # shortest path with more stores than the shortest
    flush = min((c for c in ends if c > base), key=lambda c: ends[c][0], default=base)
    more = [v[0] for c, v in ends.items() if c > (flush if persistent else base)]
    return {
        "epilogue_start": f"0x{addr[start]:x}",
        "epilogue_instructions": end + 1 - start,
        "epilogue_loops": len(inner),
        "path_min": ends[base][0],
        "path_min_more_stores": min(more) if more else None,
        "path_max": max(v[1] for v in ends.values()),
    }


def analyse(name: str, variant: Variant, target, blocks: Config | None = None) -> dict:
    """Compile one variant for sm_90 (the persistent kernel for persistent-* names, with
    `blocks` instead of the launcher's if given) and read its binary."""
    persistent = name.startswith("persistent-")
    with tempfile.TemporaryDirectory() as cache:
        os.environ["TRITON_CACHE_DIR"] = cache  # a fresh cache: ptxas runs and logs
        os.environ["TRITON_DUMP_PTXAS_LOG"] = "1"
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            if persistent:
                kernel, cfg, progs = aot.compile_persistent_for(target, variant, N, V, H, SMS, cfg=blocks)
            else:
                kernel, cfg = aot.compile_for(target, variant, n_rows=N, V=V, H=H)
        cubin = Path(cache) / "kernel.cubin"
        cubin.write_bytes(kernel.asm["cubin"])
        sass = subprocess.run([_bin("cuobjdump"), "-sass", str(cubin)], capture_output=True,
                              text=True, check=True).stdout  # fmt: skip
    log = buf.getvalue()
    regs = int(re.findall(r"Used (\d+) registers", log)[-1])
    st, ld = map(int, re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)[-1])
    instrs = parse_sass(sass)
    trips = EXACT_ROUNDS if variant.tile_list else FIRST_PASS_ROUNDS
    paths = epilogue_paths(instrs, trips, persistent)
    per_thread = cfg.BLOCK_N * cfg.BLOCK_V // (32 * cfg.num_warps)
    tiles = -(-V // cfg.BLOCK_V)
    ctas = progs if persistent else -(-N // cfg.BLOCK_N) * tiles
    wgmma = sorted({op for _, _, op, _ in instrs if op.startswith("HGMMA")})
    drafty = variant.draft or variant.draft_topk

    def per(n):
        return None if n is None else round(n / per_thread, 2)

    return {
        "name": name,
        "variant": asdict(variant),
        "config": {
            k: getattr(cfg, k)
            for k in ("BLOCK_N", "BLOCK_V", "BLOCK_H", "GROUP_SIZE", "num_warps", "num_stages")
        },
        "registers": regs,
        "spill_bytes": st + ld,
        "shared_bytes": kernel.metadata.shared,
        "wgmma": wgmma,
        "tma_loads": sum(op.startswith("UTMALDG") for _, _, op, _ in instrs),
        "persistent": persistent,
        "ctas": ctas,
        "waves": round(ctas / SMS, 1),
        "draft_tiles": -(-VD // cfg.BLOCK_V) if drafty else 0,
        "vocab_tiles": tiles,
        "logits_per_thread": per_thread,
        "loop_trips": trips,
        **paths,
        "epilogue_sass_per_logit": {
            "draft_tiles": per(paths["path_min_more_stores"]) if drafty else None,
            "other_tiles": per(paths["path_min"]),
            "longest_path": per(paths["path_max"]),
        },
    }


def environment() -> dict:
    git = ["git", "rev-parse", "HEAD"]
    sha = subprocess.run(git, cwd=ROOT, capture_output=True, text=True, check=False).stdout.strip()
    return {
        "device": "sm_90",
        "device_name": "NVIDIA Hopper sm_90 (compiled ahead of time, not run)",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "git_sha": sha,
        "triton": triton.__version__,
        "shape": {"N": N, "H": H, "V": V, "draft_vocab": VD, "k": K},
    }


def project(row: dict) -> dict:
    """What the counts imply, per vocab tile on one SM: the tile's GEMM at the measured bf16
    rate, and the epilogue's instructions issued at 4 per cycle (a lower bound: latency, the
    pipeline fill a non-persistent tile pays and the wave tail are not in it), weighted over
    the draft and the other tiles."""
    c, e = row["config"], row["epilogue_sass_per_logit"]
    gemm_us = 2 * c["BLOCK_N"] * c["BLOCK_V"] * H / (GEMM_TFLOPS * 1e12 / SMS) * 1e6
    warps_logits = c["num_warps"] * row["logits_per_thread"]  # instructions per SASS/logit

    def us(per_logit):
        cycles = None if per_logit is None else warps_logits * per_logit / ISSUE_PER_CYCLE
        return None if cycles is None else cycles / CLOCK_GHZ / 1e3

    td, t = row["draft_tiles"], row["vocab_tiles"]
    draft_us, other_us = us(e["draft_tiles"]), us(e["other_tiles"])
    mean = ((draft_us or 0) * td + other_us * (t - td)) / t
    return {
        "gemm_us_per_tile": round(gemm_us, 2),
        "epilogue_us_per_tile": {
            "draft_tiles": draft_us and round(draft_us, 2),
            "other_tiles": round(other_us, 2),
        },
        "epilogue_over_gemm": round(mean / gemm_us, 3),
    }


def table(rows: list[dict]) -> str:
    head = ("| variant | block (N x V, warps, stages) | regs | spill B | smem KB | loads "
            "| CTAs (waves) | SASS/logit draft tiles | SASS/logit other tiles "
            "| epilogue / GEMM (issue-bound) |\n|---|---|---|---|---|---|---|---|---|---|")  # fmt: skip
    lines = [head]
    for r in rows:
        c, e = r["config"], r["epilogue_sass_per_logit"]
        d = "-" if e["draft_tiles"] is None else f"{e['draft_tiles']:.1f}"
        lines.append(
            f"| {r['name']} | {c['BLOCK_N']}x{c['BLOCK_V']}, {c['num_warps']}, {c['num_stages']} "
            f"| {r['registers']} | {r['spill_bytes']} | {r['shared_bytes'] // 1024} "
            f"| {'TMA' if r.get('tma_loads') else 'cp.async'} "
            f"| {r['ctas']} ({'persistent' if r.get('persistent') else r['waves']}) "
            f"| {d} | {e['other_tiles']:.1f} "
            f"| +{100 * r['projection']['epilogue_over_gemm']:.1f} % |"
        )
    return "\n".join(lines)


# Runs this script against another revision's kernels: `eagle_fast.kernels` mapped onto them.
_BASELINE_BOOT = """
import importlib.util, runpy, sys
import eagle_fast
d, script, *args = sys.argv[1:]
spec = importlib.util.spec_from_file_location(
    "eagle_fast.kernels", d + "/__init__.py", submodule_search_locations=[d])
mod = importlib.util.module_from_spec(spec)
sys.modules["eagle_fast.kernels"] = eagle_fast.kernels = mod
spec.loader.exec_module(mod)
sys.argv = [script, *args]
runpy.run_path(script, run_name="__main__")
"""


def baseline(rev: str, names: list[str]) -> dict:
    """The same report for the kernels at git revision `rev` (a subprocess)."""
    with tempfile.TemporaryDirectory() as tmp:
        archive = subprocess.run(["git", "archive", rev, "kernels"], cwd=ROOT, capture_output=True,
                                 check=True).stdout  # fmt: skip
        subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
        out = Path(tmp) / "baseline.json"
        cmd = [sys.executable, "-c", _BASELINE_BOOT, str(Path(tmp) / "kernels"), __file__,
               "--json", str(out), "--only", *names]  # fmt: skip
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        rows = json.loads(out.read_text())["results"]
    sha = subprocess.run(["git", "rev-parse", rev], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout.strip()  # fmt: skip
    return {"git_sha": sha, "results": rows}


def merge_rows(old: dict, new: dict) -> dict:
    """`old` report with the rows `new` made replaced (or added), its other rows, environment
    and baseline kept; `updates` records where and when each replacement was made."""
    made = {r["name"]: r for r in new["results"]}
    kept = [made.pop(r["name"], r) for r in old["results"]]
    update = {**new["environment"], "rows": [r["name"] for r in new["results"]]}
    return {**old, "results": kept + list(made.values()),
            "updates": [*old.get("updates", []), update]}  # fmt: skip


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--all", action="store_true", help="every variant the AOT test compiles")
    ap.add_argument("--only", nargs="*", default=None, help="variant names to compile")
    ap.add_argument("--baseline", metavar="REV", help="also report the kernels at git REV")
    ap.add_argument("--blocks", metavar="BN,BV,BH,GROUP,WARPS,STAGES",
                    help="persistent rows only, with these blocks (rows named NAME@BNxBV-Ww-Ss)")
    ap.add_argument("--merge", action="store_true",
                    help="replace only this run's rows in the --json file, keep its others")  # fmt: skip
    args = ap.parse_args(argv)
    from triton.backends.compiler import GPUTarget

    variants = {**(dict(aot.aot_variants()) if args.all else CORE), **PERSISTENT}
    blocks = Config(*map(int, args.blocks.split(","))) if args.blocks else None
    if blocks:  # a config the launcher does not choose: only the persistent rows, renamed
        tag = f"@{blocks.BLOCK_N}x{blocks.BLOCK_V}-{blocks.num_warps}w-{blocks.num_stages}s"
        variants = {n + tag: v for n, v in PERSISTENT.items()}
        args.only = args.only and [n + tag for n in args.only]
    if args.only:
        variants = {n: v for n, v in variants.items() if n in args.only}
    target = GPUTarget("cuda", 90, 32)
    rows, seen = [], {}
    for name, variant in variants.items():
        key = (name.startswith("persistent-"), replace(variant, out=variant.out if variant.logits else "fp32"))
        if key in seen:
            continue
        rows.append(analyse(name, variant, target, blocks))
        rows[-1]["projection"] = project(rows[-1])
        seen[key] = name
        print(f"{name}: {rows[-1]['registers']} regs, {rows[-1]['spill_bytes']} B spilled, "
              f"{rows[-1]['epilogue_sass_per_logit']}", file=sys.stderr, flush=True)  # fmt: skip
    print(table(rows))
    report = {"environment": environment(), "results": rows}
    if args.baseline:
        report["baseline"] = baseline(args.baseline, [r["name"] for r in rows])
        base = report["baseline"]
        print(f"\nbaseline {base['git_sha'][:10]}:\n" + table(base["results"]))
    if args.json and args.merge and args.json.exists():
        report = merge_rows(json.loads(args.json.read_text()), report)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Mask changes: how many supervised tokens the full-rendering mask rule changes on the demo data.

What it does
    Tokenises the bundled demo chats (`eagle_fast/data/demo_chat.jsonl`) with the demo's tokenizer
    twice per template, once with this checkout's `inputs.tokenize_record` (masks from the full
    rendering, `chat.encode_chat`) and once with the package at `--ref` (git archive, run in a
    subprocess: masks from renderings of each conversation's prefixes), and counts the tokens
    whose loss flag differs and the conversations they lie in. Templates: the demo's own (it has
    `{% generation %}` markers, which both rules follow) and vLLM's Qwen3-style template
    (`template_minicpmv45.jinja`, no markers: the case the old rule got wrong).
    Each changed token is counted as "after the end" (the template's whitespace after an end
    token, which the old rule supervised as part of the turn's rendering) or "in the turn" (a
    span shifted by a turn that renders differently once later turns exist).
    The targets checked: with markers nothing changes; without them, a single-turn conversation
    changes only after the end token.

Limits
    The demo's tokenizer is a tiny BPE (no `<think>` token); the counts are of its tokens.
    Needs the repository's history (`--ref`).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import _harness as H

NAME = "masks"  # results: masks-cpu.json
REF = "cbd179b"  # the last commit whose chat masks came from prefix renderings
REPO = Path(__file__).resolve().parents[1]
QWEN3_STYLE = ("vllm", "transformers_utils", "chat_templates", "template_minicpmv45.jinja")
OPTIONS = [H.option("--ref", default=REF, help=f"the commit to compare with (default {REF})")]

# Masks of every line of DATA, by the eagle_fast first on sys.path (the one at --ref).
_OLD = r"""
import json, sys
from eagle_fast.inputs import load_tokenizer, tokenize_record
from eagle_fast.records import read_records
tok = load_tokenizer(sys.argv[1])
if sys.argv[3]:
    tok.chat_template = open(sys.argv[3]).read()
records, _ = read_records(sys.argv[2])
print(json.dumps([tokenize_record(r, tok, sys.argv[2]) for r in records]))
"""


def _masks_at(ref: str, tok_dir: Path, data: Path, template: Path | None, work: Path) -> list:
    src = work / f"src-{ref}"
    if not src.exists():
        H.package_at(ref, src)
    proc = subprocess.run([sys.executable, "-c", _OLD, str(tok_dir), str(data), str(template or "")],
                          capture_output=True, text=True, check=True, cwd=work,
                          env={"PYTHONPATH": str(src), "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"})
    return json.loads(proc.stdout)


def run(args) -> dict:
    from eagle_fast.chat import ChatFormat
    from eagle_fast.inputs import load_tokenizer, tokenize_record
    from eagle_fast.records import read_records
    from eagle_fast.tiny import _data_path, build_tokenizer

    site = Path(next(p for p in sys.path if p.endswith("site-packages")))
    data = _data_path()
    records, _ = read_records(data)
    out = {"ref": args.ref, "data": str(data.relative_to(REPO)), "records": {}}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        tok_dir = work / "tok"
        build_tokenizer(tok_dir)
        tok = load_tokenizer(str(tok_dir))
        for name, template in (("demo (generation markers)", None), ("qwen3-style (vLLM)", site.joinpath(*QWEN3_STYLE))):
            chat = ChatFormat.from_args(str(template) if template else None)
            new = [tokenize_record(r, tok, str(data), chat) for r in records]
            old = _masks_at(args.ref, tok_dir, data, template, work)
            ends = set(tok.all_special_ids)
            changed = []  # (record, tokens after an end token, tokens in the turn)
            for r, (ids, m_new), (ids_old, m_old) in zip(records, new, old):
                diff = [t for t in range(len(ids)) if ids == ids_old and m_new[t] != m_old[t]]
                after = [t for t in diff if t and ids[t - 1] in ends and not tok.decode([ids[t]]).strip()]
                if diff:
                    changed.append((r, len(after), len(diff) - len(after)))
            out["records"][name] = {
                "samples": len(records), "tokens": sum(len(ids) for ids, _ in new),
                "supervised_now": sum(sum(m) for _, m in new), "supervised_before": sum(sum(m) for _, m in old),
                "ids_differ": sum(a[0] != b[0] for a, b in zip(new, old)),
                "tokens_changed": sum(a + b for _, a, b in changed), "samples_changed": len(changed),
                "changed_after_end": sum(a for _, a, _ in changed), "changed_in_turn": sum(b for _, _, b in changed),
                "samples_changed_in_turn": sum(1 for _, _, b in changed if b),
                "single_turn_changed_in_turn": sum(1 for r, _, b in changed
                                                   if b and sum(m["role"] == "assistant" for m in r.value) < 2),
            }
    out["environment"] = H.environment("cpu")
    out["markdown"] = _markdown(out)
    return out


def _markdown(results: dict) -> list[str]:
    rows = ["## Chat masks: what the full-rendering rule changes on the demo data", "",
            (f"`python bench/bench_masks.py`: the {results['data']} chats tokenised by this checkout and by "
            f"`{results['ref']}` (masks from prefix renderings), with the demo's tokenizer."), "",
            ("| template | tokens | supervised before -> now | flags changed | after an end token | in turns "
            "(conversations) |"), "|---|---|---|---|---|---|"]
    for name, r in results["records"].items():
        rows.append(f"| {name} | {r['tokens']:,} | {r['supervised_before']:,} -> {r['supervised_now']:,} | "
                    f"{r['tokens_changed']:,} | {r['changed_after_end']:,} | {r['changed_in_turn']:,} "
                    f"({r['samples_changed_in_turn']}) |")
    return rows


def verdicts(results: dict) -> H.Verdicts:
    v = H.Verdicts()
    for name, r in results["records"].items():
        detail = (f"{r['tokens_changed']:,} of {r['tokens']:,} tokens change their flag in {r['samples_changed']} "
                  f"of {r['samples']} conversations ({r['changed_after_end']:,} after an end token, "
                  f"{r['changed_in_turn']:,} in turns, in {r['samples_changed_in_turn']} conversations); "
                  f"supervised {r['supervised_before']:,} -> {r['supervised_now']:,}")
        if "markers" in name:
            v.check(f"masks: {name}: no token changes", r["tokens_changed"] == 0 and r["ids_differ"] == 0, detail)
        else:
            v.check(f"masks: {name}: a single-turn conversation changes only after its end token",
                    r["single_turn_changed_in_turn"] == 0 and r["ids_differ"] == 0, detail)
    return v


def summary(results: dict) -> str:
    return json.dumps(results["records"], indent=1)


test_masks = H.pytest_case(__name__)

if __name__ == "__main__":
    sys.exit(H.main(sys.modules[__name__]))

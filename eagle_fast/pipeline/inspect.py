"""`eagle-fast inspect`: a human summary of a dataset directory (what, how big, how done), and
`--show-mask N`: one sample's tokens with the supervised ones marked, from a dataset (as
stored) or from a data file before any extraction (as `extract` would tokenise that line)."""

from __future__ import annotations

from pathlib import Path

from eagle_fast.chat import ChatFormat
from eagle_fast.errors import UserError
from eagle_fast.inputs import load_tokenizer, tokenize_record
from eagle_fast.pipeline.config import fmt_bytes
from eagle_fast.records import read_records
from eagle_fast.store import make_layout, spec_from_manifest
from eagle_fast.store.dataset import Eagle3Dataset
from eagle_fast.store.manifest import (
    MANIFEST_NAME,
    eagle_section,
    list_part_manifests,
    load_json,
    part_slice,
    read_manifest,
    record_dirs,
)
from eagle_fast.store.sizes import field_sizes, size_table

# ---------------------------------------------------------------------------- inspect


def inspect_text(directory: str) -> str:
    root = Path(directory)
    parts = list_part_manifests(root) if root.is_dir() else []
    if root.is_dir() and not (root / MANIFEST_NAME).exists() and parts:
        lines = [f"{root}: per-node parts, not merged yet"]
        for index, count, path in parts:
            m = eagle_section(load_json(path))
            owned = len(part_slice(m["num_shards"], (index, count)))
            lines.append(f"  part {index}/{count}: {len(m['shards'])}/{owned} shards"
                         + (" complete" if m.get("complete") else ""))
        lines.append(f"run `eagle-fast merge {root}` when every part is complete")
        return "\n".join(lines)
    m = read_manifest(root)
    done = m["shards"]
    tokens = sum(r["tokens"] for r in done)
    nbytes = sum(f["bytes"] for r in done for f in r["files"])
    if m["layout"] == "multi":
        return _multi_text(root, m, tokens, nbytes)
    sup = m["supervision"]
    lines = [
        f"dataset     {root}",
        f"layout      {m['layout']} (eagle-fast {m['tool_version']}, format v{m['format_version']})",
        (f"model       {m['model']['id']} ({', '.join(m['model']['architectures']) or '?'}; "
         f"{m['model']['num_hidden_layers']} layers, hidden {m['model']['hidden_size']}, "
         f"vocab {m['model']['vocab_size']:,})"),
        *([f"hub         {m['model']['hub']['id']} at commit {m['model']['hub']['commit']}"
           + (f" (--revision {m['model']['hub']['revision']})" if m["model"]["hub"].get("revision") else "")]
          if m["model"].get("hub") else []),
        f"engine      {m['settings']['engine']}, dtype {m['settings']['dtype']}, aux layers {m['aux_layer_ids']}",
        *[f"draft type  {t['draft_type']}: layers {t['layer_ids']} (vLLM ids {t['vllm_layer_ids']})"
          + (f", the final state {t['final']}-norm" if t["final"] != "none" else "")
          + (f" (id {t['post_norm_ids'][0]}: the final norm's output)" if t.get("post_norm_ids") else "")
          + f"; read by {t['reader']}"
          for rec in m.get("draft_types", []) for t in rec["draft_types"]],
        "aux dtype   " + ("fp8 (float8_e4m3fn, one fp32 scale per token)" if m["settings"].get("aux_dtype") == "fp8"
                          else f"{m['settings']['dtype']} (the target dtype)"),
        f"supervision {sup['kind']}" + (f", k={sup['k']}" if sup["k"] else "")
        + (f", draft vocab {sup['draft_vocab_size']:,}" if sup["draft_vocab_size"] else ""),
        (f"data        {m['data']['path']} ({m['data']['lines']:,} lines; {m['data']['truncated']} truncated, "
         f"{m['data']['skipped']} skipped at max_len {m['settings']['max_len']})"),
        f"samples     {m['num_samples']:,} ({m['num_tokens']:,} tokens), {len(done)}/{m['num_shards']} shards "
        + ("complete" if m.get("complete") else "[INCOMPLETE: re-run the extract command to resume]"),
        f"on disk     {fmt_bytes(nbytes)}, {nbytes / max(tokens, 1):,.0f} bytes/token",
        "fields      " + ", ".join(f"{k} {v['dtype']}[{', '.join(map(str, v['shape']))}]"
                                  for k, v in m["fields"].items()),
    ]
    spec = spec_from_manifest(m)
    sizes = field_sizes(make_layout(spec))
    lines += size_table(sizes, tokens, sum(r["samples"] for r in done), spec.max_len)
    if m.get("complete"):
        ds = Eagle3Dataset(directory)
        lengths = [ds.length(i) for i in range(len(ds))]
        lines.append(f"lengths     min {min(lengths)}, mean {sum(lengths) / len(lengths):.1f}, max {max(lengths)}")
        if spec.keep_mass:
            mean_k, capped, n = ds.keep_mass_stats()
            kept_bytes = sum(f.nbytes / spec.k * mean_k for f in sizes if f.per == "kept")
            lines.append(f"keep mass   {spec.keep_mass}: mean k {mean_k:.2f} of at most {spec.k}; "
                         f"{capped:,} of {n:,} tokens hit the cap ({100 * capped / max(n, 1):.1f} %); "
                         f"the kept ids and log-probs take {kept_bytes:,.1f} bytes/token here")
    for r in m.get("runs", [])[-3:]:
        lines.append(f"run         {r['samples']:,} samples on {r['engine']} at {r['tokens_per_second'] or 0:,.0f} "
                     f"tokens/s (build {r['build_seconds']:.1f} s)")
        for check in ([r["engine_check"]] if "engine_check" in r else r.get("engine_checks", [])):
            lines.append("  engine    " + engine_check_text(check))
    return "\n".join(lines)


def _multi_text(root: Path, m: dict, tokens: int, nbytes: int) -> str:
    """A dataset of several records (one capture): the capture, then each record as a dataset of its own."""
    cap = m["capture"]
    lines = [f"dataset     {root}: {len(m['parts'])} records from one capture",
             f"capture     layers {cap['layer_ids']} (vLLM ids {cap['vllm_layer_ids']}) and {cap['final']}",
             f"samples     {m['num_samples']:,} ({m['num_tokens']:,} tokens), {len(m['shards'])}/{m['num_shards']} shards "
             + ("complete" if m.get("complete") else "[INCOMPLETE: re-run the extract command to resume]"),
             f"on disk     {fmt_bytes(nbytes)}, {nbytes / max(tokens, 1):,.0f} bytes/token in all"]
    for rec in m["draft_types"]:
        types = ", ".join(f"{t['draft_type']} {t['layer_ids']}" + (f" + final {t['final']}-norm" if t["final"] != "none"
                                                                  else "") for t in rec["draft_types"])
        lines.append(f"record      {rec['dir']}/ ({rec['format']}): {types}")
    for part in m["parts"]:
        lines += ["", inspect_text(str(root / part["dir"]))]
    return "\n".join(lines)


def engine_check_text(check: dict) -> str:
    """One line for a run's engine check (`pipeline.engine_setup.engine_check`'s figures)."""
    if "skipped" in check:
        return f"check skipped: {check['skipped']}"
    return (f"check passed: captures vs vLLM's prompt log-probs, max |diff| {check['max_abs_err']:.2g} "
            f"(tolerance {check['tolerance']:.2g}) over {check['positions']:,} positions of "
            f"{check['sequences']} sequences, top-1 agreement {100 * check['top1_agreement']:.1f} %, "
            f"{check['seconds']:.2f} s")


# ---------------------------------------------------------------------------- show-mask

OPEN, CLOSE = "[[", "]]"


def marked_text(tok, ids: list[int], mask: list[int]) -> str:
    """The tokens decoded as text, each run of supervised tokens between [[ and ]]."""
    out, i = [], 0
    while i < len(ids):
        j = i
        while j < len(ids) and bool(mask[j]) == bool(mask[i]):
            j += 1
        text = tok.decode(ids[i:j], skip_special_tokens=False, clean_up_tokenization_spaces=False)
        out.append(f"{OPEN}{text}{CLOSE}" if mask[i] else text)
        i = j
    return "".join(out)


def show_mask_text(target: str, index: int, model: str | None = None, chat: ChatFormat | None = None) -> str:
    """Sample `index` of a dataset directory, or line `index` of a data file (tokenised with
    `model` and `chat` as `extract` would), with its supervised tokens between [[ and ]]."""
    path = Path(target)
    if path.is_dir():
        if chat is not None and chat != ChatFormat():
            raise UserError("--chat-template and --chat-template-kwargs apply to a data file, not to a "
                            "dataset (its masks are stored)", "drop them, or pass the data file")
        path = Path(record_dirs(path)[0])  # several records: the first's (their masks are the same)
        m = read_manifest(path)
        ds = Eagle3Dataset(path, allow_incomplete=True)
        if not 0 <= index < len(ds):
            raise UserError(f"{path} has samples 0 to {len(ds) - 1} written, not {index}",
                            f"pass --show-mask 0 .. {len(ds) - 1}")
        sample = ds.sample_plan(index)
        tok = load_tokenizer(model or m["model"]["id"])
        ids, mask, where = sample.input_ids, sample.loss_mask, f"sample {index} (data line {sample.line})"
    else:
        if model is None:
            raise UserError("--show-mask on a data file needs the model whose tokenizer renders it",
                            "add --model DIR")
        records, _ = read_records(path)
        rec = next((r for r in records if r.line == index), None)
        if rec is None:
            raise UserError(f"{path} has lines 1 to {len(records)}, not {index}",
                            f"pass --show-mask 1 .. {len(records)} (a line number)")
        tok = load_tokenizer(model)
        ids, mask = tokenize_record(rec, tok, str(path), chat)
        where = f"{path}:{index}"
    head = (f"{where}: {len(ids)} tokens, {sum(map(bool, mask))} supervised (between {OPEN} and {CLOSE})")
    return head + "\n" + marked_text(tok, ids, mask)

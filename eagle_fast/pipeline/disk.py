"""The disk an extraction needs, known before the run: `extract --dry-run`, the space check, and
a clear error when the disk fills anyway.

- `disk_plan(p)`: from the resolved plan alone (model config, tokenizer, inputs, layout; no
  engine, no weights read): samples, tokens, bytes per token by field, the bytes the pending
  shards will write (tensor data from the layout's declared fields, `store.sizes`, plus each
  file's header allowance and the files beside the shards), what the seed's full fp32 logits
  would take, the capture staging of one engine call, and the free space of `--out` and of the
  capture directory. With `--keep-mass` the per-token k varies, so the figure is a bound (every
  token at the cap k) and says so.
- `check_space(p)`: a run whose pending bytes exceed the free space of `--out` is refused
  before any engine starts, naming both figures and the ways out (`--no-space-check` skips it).
- `disk_full(exc, p, committed)`: the UserError a full disk mid-run becomes: the file, the bytes
  still to write, the fix; committed shards stay valid and the rerun resumes.
Limits: free space is read once, up front; another writer can still fill the disk (hence
`disk_full`). Filesystem block rounding is not counted (a few KiB per file).
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from eagle_fast.errors import UserError
from eagle_fast.mixing import mix_lines
from eagle_fast.pipeline.config import ExtractPlan, fmt_bytes
from eagle_fast.runners.base import capture_plan
from eagle_fast.store import make_layout
from eagle_fast.store.layouts import Layout
from eagle_fast.store.multi import MultiLayout
from eagle_fast.store.sizes import bytes_per_token, field_sizes, tensor_bytes

# A safetensors header: its length word, the metadata, then ~one JSON entry per tensor (name,
# dtype, shape, offsets), space-padded to 8 bytes; these allowances hold the real ones here.
HEADER_BASE, HEADER_PER_TENSOR = 128, 96
MANIFEST_BYTES = 16 << 10  # the manifest and the small files beside the shards
FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
SPACE_FIX = ("free space on that filesystem, pass another --out, store less per token (--aux-dtype fp8, "
             "--supervision draft-topk --keep-mass 0.99), or split the run (--shard I/N on several "
             "machines); --no-space-check runs anyway")


@dataclass
class DiskPlan:
    samples: int
    tokens: int
    tokens_before_max_len: int
    shards: int
    pending_shards: int
    by_field: dict[str, float]          # bytes per token (nemo: per padded position)
    by_type: dict[str, float]           # bytes per token of each record, and of each of its draft types alone
    pending_bytes: int                  # what this run will write
    bound: bool                         # --keep-mass: every token at the cap k
    seed_logits_bytes: int              # the seed's fp32 [tokens, vocab] logits
    staging_bytes: int                  # one engine call's captures (vLLM)
    out_dir: str
    out_free: int | None
    capture_dir: str | None
    capture_free: int | None
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)

    def text(self) -> str:
        per = sum(self.by_field.values())
        lines = [(f"plan: {self.samples:,} samples, {self.tokens:,} tokens ({self.tokens_before_max_len:,} before "
                 f"--max-len) in {self.shards} shards; this run writes {self.pending_shards}"),
                 f"  on disk: {fmt_bytes(self.pending_bytes)}" + (" at most (--keep-mass: every token at the cap k)"
                                                                    if self.bound else ""),
                 f"  per token: {per:,.0f} B = " + " + ".join(f"{k} {v:,.0f}" for k, v in self.by_field.items()
                                                               if v),
                 *[f"  per token, {name}: {v:,.0f} B" for name, v in self.by_type.items()
                   if len(self.by_type) > 1],
                 (f"  the seed's full fp32 logits for the same tokens: {fmt_bytes(self.seed_logits_bytes)} "
                 f"({self.seed_logits_bytes / max(self.pending_bytes, 1):,.1f}x this run's bytes)"),
                 f"  capture staging per engine call: {fmt_bytes(self.staging_bytes)}"
                 + (f" in {self.capture_dir} ({fmt_bytes(self.capture_free)} free)" if self.capture_dir else ""),
                 f"  --out {self.out_dir}: " + (f"{fmt_bytes(self.out_free)} free" if self.out_free is not None
                                                 else "free space unknown")]
        return "\n".join(lines + [f"  {n}" for n in self.notes])


def free_space(path: str | os.PathLike) -> tuple[str, int | None]:
    """(the nearest existing directory at or above `path`, its free bytes; None if unreadable)."""
    p = Path(path).resolve()
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        return str(p), shutil.disk_usage(p).free
    except OSError:
        return str(p), None


def _capture_dir(p: ExtractPlan) -> str | None:
    if p.target.engine != "vllm":
        return None
    return p.target.vllm.capture_dir or ("/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())


def records(layout: Layout) -> list[tuple[str, Layout]]:
    """(subdirectory, layout) of every record a run writes ("": --out itself)."""
    return layout.parts if isinstance(layout, MultiLayout) else [("", layout)]


def _extra_bytes(p: ExtractPlan) -> int:
    """The files beside the shards, in every record: NeMo's target weights, speculators' Arrow table,
    the draft vocabulary files."""
    extra = MANIFEST_BYTES
    fresh = not p.manifest.get("extra_files")
    info = p.target.info
    for _, layout in records(p.layout):
        if layout.name == "nemo" and fresh:  # its fp32 target embeddings
            extra += 4 * info.vocab_size * info.hidden_size
        if layout.name == "nemo-dspark" and fresh:  # its target_weights: embedding and LM head in the target dtype
            extra += 2 * p.target.dtype.itemsize * info.vocab_size * info.hidden_size
        if layout.name == "speculators" and fresh:  # its Arrow table of every sample's ids and mask
            extra += 12 * p.inputs.tokens + 24 * len(p.inputs.samples) + (3 << 10)
        if p.draft_ids is not None:  # the draft vocabulary's files: int64 ids (or d2t offsets), a bool t2d
            extra += 8 * p.spec.draft_size + info.vocab_size + 2 * (HEADER_BASE + HEADER_PER_TENSOR)
    return extra


def shard_bytes(p: ExtractPlan, shards: list) -> int:
    """The bytes `shards` write into every record: each layout's declared fields (`store.sizes`) and
    each file's header allowance (native, nemo: a file per shard; the others: a file per sample)."""
    tokens, samples = sum(s.tokens for s in shards), sum(len(s.samples) for s in shards)
    total = 0
    for _, layout in records(p.layout):
        sizes = field_sizes(layout)
        data = tensor_bytes(sizes, tokens, samples, shards=len(shards), positions=samples * layout.spec.max_len)
        files = len(shards) if layout.name in ("native", "nemo", "nemo-dspark") else samples
        total += int(data + (HEADER_BASE + HEADER_PER_TENSOR * len(sizes)) * files)
    return total


def by_draft_type(layout: Layout) -> dict[str, float]:
    """Bytes per token (nemo: per padded position) of each (record, draft type) as its own extraction
    would store it, and of each record as written (serving all its types at once)."""
    out: dict[str, float] = {}
    for d, part in records(layout):
        where = f"{d or part.name}"
        spec = part.spec
        if len(spec.types) > 1:
            for t in spec.types:
                alone = make_layout(replace(spec, types=(t,), num_aux=len(t.layer_ids)))
                out[f"{where}: {t.draft_type} alone"] = sum(bytes_per_token(alone).values())
        out[f"{where}: {'+'.join(spec.draft_types)}"] = sum(bytes_per_token(part).values())
    return out


def disk_plan(p: ExtractPlan) -> DiskPlan:
    sizes = field_sizes(p.layout)
    tokens = sum(s.tokens for s in p.pending)
    pending = shard_bytes(p, p.pending) + _extra_bytes(p)
    capture_ids, _, _ = capture_plan(p.target.aux_layer_ids, p.target.info.num_hidden_layers)
    step = max(min(p.run.batch_tokens, tokens), max((s.length for s in p.pending[0].samples), default=0)
               if p.pending else 0)  # a call holds --batch-tokens, or one longer sample whole
    staging = (step * len(capture_ids) * p.target.info.hidden_size * p.target.dtype.itemsize
               if p.target.engine == "vllm" else 0)
    out_dir, out_free = free_space(p.root)
    cap = _capture_dir(p)
    cap_free = free_space(cap)[1] if cap else None
    notes = [f"--data {line}" for line in mix_lines(p.data, p.inputs.sources or [])]
    for d, layout in records(p.layout):
        if layout.name not in ("native", "nemo"):
            notes.append(f"--format {layout.name}{f' ({d}/)' if d else ''}: one file per sample, each with its "
                         "header allowance counted")
    if p.inputs.truncated or p.inputs.skipped:
        notes.append(f"--max-len {p.target.max_len}: {p.inputs.truncated:,} samples truncated, "
                     f"{p.inputs.skipped:,} skipped (--overlong {p.manifest['settings']['overlong']})")
    return DiskPlan(
        samples=len(p.inputs.samples), tokens=p.inputs.tokens, tokens_before_max_len=p.inputs.tokens_read,
        shards=len(p.shards),
        pending_shards=len(p.pending), by_field=bytes_per_token(sizes), by_type=by_draft_type(p.layout),
        pending_bytes=int(pending),
        bound=p.layout.spec.keep_mass > 0, seed_logits_bytes=4 * p.target.info.vocab_size * tokens,
        staging_bytes=int(staging), out_dir=out_dir, out_free=out_free, capture_dir=cap, capture_free=cap_free,
        notes=notes)


def check_space(plan: DiskPlan) -> None:
    """Refuse a run whose pending bytes do not fit the free space of --out."""
    if plan.out_free is not None and plan.pending_bytes > plan.out_free:
        raise UserError(f"this run writes {fmt_bytes(plan.pending_bytes)}"
                        + (" (at most: --keep-mass)" if plan.bound else "")
                        + f" and {plan.out_dir} has {fmt_bytes(plan.out_free)} free", SPACE_FIX)


def disk_full(exc: BaseException, p: ExtractPlan, committed: set[int]) -> UserError | None:
    """The UserError for a write that hit a full disk (anywhere in `exc`'s causes), else None."""
    err: BaseException | None = exc
    seen: set[int] = set()  # a chain can loop (a Ray error's `cause` whose context is that error)
    while err is not None and id(err) not in seen and not (isinstance(err, OSError) and err.errno in FULL_ERRNOS):
        seen.add(id(err))
        # chained causes, and a Ray worker's exception as its RayTaskError carries it (`cause`)
        ray_cause = getattr(err, "cause", None)  # (UserError's `cause` is its text, not an exception)
        err = err.__cause__ or err.__context__ or (ray_cause if isinstance(ray_cause, BaseException) else None)
    if err is None or not (isinstance(err, OSError) and err.errno in FULL_ERRNOS):
        return None
    left = [s for s in p.pending if s.index not in committed]
    need = shard_bytes(p, left)
    where = err.filename or p.root
    return UserError(f"the disk filled while writing {where} ({err.strerror}): {len(left)} shards, about "
                     f"{fmt_bytes(need)}, are still to be written; the {len(committed)} shards committed so far "
                     "are complete", "free space (or pass --out on a larger filesystem after moving the "
                     "directory there), then re-run the same command: it resumes from the shards committed")

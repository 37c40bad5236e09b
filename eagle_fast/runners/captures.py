"""The host side of a capture: checks at memory speed, the capture dir, and an engine that runs ahead.

Checks: non-finite values and all-zero rows. A capture at real shapes is hundreds of MB (8,192
tokens x 4 ids x H=4096 bf16 is 268 MB), so its checks must cost about one read of the bytes.
One reduction finds every suspect: each row's sum over the hidden dim (NaN and inf propagate
through a sum, and +inf + -inf is NaN; an all-zero row, +0 or -0, sums to exactly 0). Only the
suspect rows are then checked element by element: a finite row whose sum overflows, or one
whose values cancel to 0, is cleared there. So the result is exact, a clean capture costs one
pass, and no bool tensor the size of the capture is ever made.

Staging: the capture dir's name, its free space, and the sweep of dirs whose runner died.

Run ahead: `run_ahead` calls an engine on the next batch in a thread of its own while the
caller consumes the last one (reads its files, runs the head, hands it to a writer), with at
most `depth` finished batches waiting; it times how long the engine thread spent in the engine.
Limits: the checks take CPU or CUDA tensors alike and allocate only per-row results ([rows,
slots]); a batch the engine finished but nobody consumed (an error, a stop) is handed to
`discard`, so its files are removed.
"""

from __future__ import annotations

import logging
import os
import queue
import re
import shutil
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "AheadStats",
    "RowScan",
    "diff_against_engine",
    "free_bytes",
    "process_start",
    "run_ahead",
    "scan_rows",
    "split_capture",
    "split_supervised",
    "storage_prefix",
    "supervision_bytes_per_token",
    "sweep_orphaned_storage",
]

logger = logging.getLogger(__name__)

class RowScan:
    """What `scan_rows` found in `x [R, ..., D]`: the non-finite rows and the all-zero rows."""

    def __init__(self, x: torch.Tensor):
        self._x = x
        sums = x.sum(dim=-1)  # [R, ...]: the one pass over x
        self.nonfinite_rows = self._confirm(~torch.isfinite(sums), lambda r: ~torch.isfinite(r).all(-1))
        self.zero_rows = self._confirm(sums == 0, lambda r: (r == 0).all(-1))
        self.all_finite = not bool(self.nonfinite_rows.any())

    def _confirm(self, suspects: torch.Tensor, exact) -> torch.Tensor:
        """`suspects` narrowed to the rows where `exact(rows [n, D]) -> [n] bool` holds."""
        idx = suspects.nonzero(as_tuple=True)
        if idx[0].numel():
            suspects[idx] = exact(self._x[idx])
        return suspects

    def first_nonfinite(self) -> list[int] | None:
        """Index of the first non-finite element (row index + last-dim index), None if none."""
        if self.all_finite:
            return None
        row = self.nonfinite_rows.nonzero()[0].tolist()
        col = int((~torch.isfinite(self._x[tuple(row)])).nonzero()[0])
        return [*row, col]

    def first_zero_row(self) -> list[int] | None:
        """Index of the first all-zero row, None if none."""
        if not bool(self.zero_rows.any()):
            return None
        return self.zero_rows.nonzero()[0].tolist()


def scan_rows(x: torch.Tensor) -> RowScan:
    """Scan `x [R, ..., D]` for non-finite values and all-zero rows in one pass (module doc)."""
    if x.dim() < 2:
        raise ValueError(f"scan_rows needs [rows, ..., dim], got shape {tuple(x.shape)}")
    return RowScan(x)


@dataclass
class AheadStats:
    """Where the engine thread's time went in one `run_ahead` stream (seconds), and how often
    it found the consumer `depth` results behind."""

    engine: float = 0.0  # inside the engine call
    waiting: float = 0.0  # holding a finished batch because the consumer was behind
    total: float = 0.0  # from the first engine call's start to the last one's end
    held: int = 0  # results that waited for room (the consumer held `depth` already)

    @property
    def busy_fraction(self) -> float:
        return self.engine / self.total if self.total > 0 else 0.0


_END = object()


class _Failed:
    def __init__(self, error: BaseException):
        self.error = error


def run_ahead(
    items: Iterable[Any],
    engine: Callable[[Any], Any],
    depth: int,
    discard: Callable[[Any, Any], None],
    stats: AheadStats | None = None,
) -> Iterator[tuple[Any, Any]]:
    """Yield `(item, engine(item))` in order, calling `engine` on later items in a thread while
    the caller works on earlier ones; at most `depth` (>= 1) results wait for the caller.

    An error in the engine thread is raised here, at the point the caller would have received
    that item. When the caller stops early (an error, `close()`), the thread finishes its call
    in flight, and every result it made that was never yielded goes to `discard(item, result)`.
    """
    if depth < 1:
        raise ValueError(f"depth must be >= 1, got {depth}")
    done: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()
    stats = stats if stats is not None else AheadStats()

    def hand_over(entry) -> bool:
        try:
            done.put_nowait(entry)
            return True
        except queue.Full:
            stats.held += 1
        while not stop.is_set():
            try:
                done.put(entry, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def produce() -> None:
        start = None
        try:
            for item in items:
                if stop.is_set():
                    return
                t0 = time.perf_counter()
                start = t0 if start is None else start
                result = engine(item)
                t1 = time.perf_counter()
                stats.engine += t1 - t0
                stats.total = t1 - start
                if not hand_over((item, result)):
                    discard(item, result)
                    return
                stats.waiting += time.perf_counter() - t1
        except BaseException as exc:  # noqa: BLE001 - raised in the caller's thread
            hand_over(_Failed(exc))
            return
        hand_over(_END)

    thread = threading.Thread(target=produce, name="eagle-fast-engine", daemon=True)
    thread.start()
    try:
        while True:
            entry = done.get()
            if entry is _END:
                return
            if isinstance(entry, _Failed):
                raise entry.error
            yield entry
    finally:
        stop.set()
        thread.join()
        while True:
            try:
                entry = done.get_nowait()
            except queue.Empty:
                break
            if isinstance(entry, tuple):
                discard(*entry)



def split_capture(
    data: dict,
    seq: list[int],
    prompt_ids: list[int],
    *,
    capture_ids: list[int],
    hidden_size: int,
    dtype: torch.dtype,
    aux_slots: list[int],
    final_slot: int,
    name: str = "capture",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Check one engine capture file's tensors and split them into `(aux [T, 3H], final [T, H])`.

    `data`: the file's `{hidden_states [T, n_ids, H], token_ids [T]}`; `seq`: the tokens asked
    for, `prompt_ids`: those the engine reports. Raises RuntimeError, naming `name`, when the
    token ids, the shape or the dtype are off, or a value is non-finite, or a row is all zero.
    One pass over the bytes (`scan_rows`). When the aux slots are consecutive (ascending aux
    ids) both results are views of `data`'s tensor: the store's write and the head's norm make
    the one copy each needs; otherwise aux is gathered (one copy).
    """
    hs = _checked_states(data, seq, prompt_ids, (len(capture_ids), hidden_size), dtype, name)
    scan = scan_rows(hs)
    zero = scan.first_zero_row()
    _refuse_bad_rows(name, capture_ids, scan.first_nonfinite(), zero, int(scan.zero_rows.sum()) if zero else 0)
    T = len(seq)
    first = aux_slots[0] if aux_slots else 0
    if list(aux_slots) == list(range(first, first + len(aux_slots))):
        # a view: [T, n H], row stride n_ids * H (MTP alone: [T, 0])
        aux = hs[:, first:first + len(aux_slots), :].reshape(T, len(aux_slots) * hidden_size)
    else:
        aux = hs[:, list(aux_slots), :].reshape(T, -1)
    return aux, hs[:, final_slot, :]


def _checked_states(data: dict, seq, prompt_ids, slots_h: tuple[int, int], dtype, name: str) -> torch.Tensor:
    """`data["hidden_states"]` once the token ids, its shape `[T, *slots_h]` and dtype check out."""
    hs, token_ids = data.get("hidden_states"), data.get("token_ids")
    if hs is None or token_ids is None:
        raise RuntimeError(f"{name}: file has keys {sorted(data)}, expected hidden_states and token_ids")
    T = len(seq)
    if prompt_ids != seq or token_ids.tolist() != seq:
        raise RuntimeError(
            f"{name}: stored token_ids (len {token_ids.numel()}) do not equal the request "
            f"(len {T}); the engine mixed up requests"
        )
    expected = (T, *slots_h)
    if tuple(hs.shape) != expected:
        raise RuntimeError(
            f"{name}: hidden_states shape {tuple(hs.shape)} != expected {expected} "
            "(prefix caching or chunked prefill misaligned the capture?)"
        )
    if hs.dtype != dtype:
        raise RuntimeError(f"{name}: hidden_states dtype {hs.dtype} != target dtype {dtype}")
    return hs


def _refuse_bad_rows(name: str, capture_ids, bad: list[int] | None, zero: list[int] | None,
                     n_zero: int) -> None:
    """Raise for a non-finite value at `bad` [token, slot, dim] or an all-zero row at `zero`
    [token, slot] (`n_zero` such rows); slots index `capture_ids`."""
    if bad is not None:
        raise RuntimeError(
            f"{name}: non-finite hidden state at [token, slot, dim]={bad}; "
            "check --dtype (fp16 overflows on some models)"
        )
    if zero is not None:
        t, slot = zero
        raise RuntimeError(
            f"{name}: all-zero hidden state at token {t}, capture id {capture_ids[slot]} "
            f"({n_zero} such rows); the engine did not capture this layer"
        )


def supervision_bytes_per_token(head, settings: dict) -> int:
    """Bytes per token of the supervision fields the head in the worker stages, for connector.py's
    `settings` (outputs, k, draft_ids, out_dtype, fields), from one 16-row call of `head`."""
    rows = torch.zeros(16, head.hidden_size, dtype=head.dtype, device=head.device)
    ids = None if settings["draft_ids"] is None else torch.tensor(settings["draft_ids"])
    out = head.compute(rows, tuple(settings["outputs"]), k=settings["k"], draft_ids=ids,
                       out_dtype=getattr(torch, settings["out_dtype"])).as_dict()
    fields = settings["fields"]
    return sum(v.nbytes for f, v in out.items() if fields is None or f in fields) // 16


def split_supervised(
    data: dict,
    seq: list[int],
    prompt_ids: list[int],
    *,
    capture_ids: list[int],
    hidden_size: int,
    dtype: torch.dtype,
    kept_slots: list[int],
    aux_slots: list[int],
    final_slot: int,
    fields: tuple[str, ...],
    name: str = "capture",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Check one file the head in the worker wrote (connector.py) and split it into
    `(aux [T, 3H], {field: [T, ...]})`: the checks and messages of `split_capture`, over the
    stored slots `kept_slots` (one pass) and, from the worker's `scan.final`, the final slot
    that stayed in the worker; every supervision field has T rows."""
    hs = _checked_states(data, seq, prompt_ids, (len(kept_slots), hidden_size), dtype, name)
    T = len(seq)
    final_scan = data.get("scan.final")
    if final_scan is None or final_scan.shape != (4,):
        raise RuntimeError(f"{name}: file has keys {sorted(data)}, expected scan.final [4] from the worker's head")
    scan = scan_rows(hs)
    bad, zero = scan.first_nonfinite(), scan.first_zero_row()
    f_token, f_dim, f_zero, f_zeros = final_scan.tolist()
    if bad is not None:
        bad = [bad[0], kept_slots[bad[1]], bad[2]]
    if f_token >= 0 and (bad is None or (f_token, final_slot) < (bad[0], bad[1])):
        bad = [f_token, final_slot, f_dim]
    n_zero = int(scan.zero_rows.sum()) if zero is not None else 0
    if zero is not None:
        zero = [zero[0], kept_slots[zero[1]]]
    if f_zero >= 0 and final_slot not in kept_slots:
        n_zero += f_zeros
        if zero is None or (f_zero, final_slot) < tuple(zero):
            zero = [f_zero, final_slot]
    _refuse_bad_rows(name, capture_ids, bad, zero, n_zero)
    sup = {}
    for field in fields:
        value = data.get(f"sup.{field}")
        if value is None or value.shape[:1] != (T,):
            got = None if value is None else tuple(value.shape)
            raise RuntimeError(f"{name}: supervision field {field!r} has shape {got}, expected {T} rows "
                               "(the worker's head wrote a short or no result)")
        sup[field] = value
    where = [kept_slots.index(s) for s in aux_slots]
    first = where[0]
    if where == list(range(first, first + len(where))):
        aux = hs[:, first:first + len(where), :].reshape(T, -1)
    else:
        aux = hs[:, where, :].reshape(T, -1)
    return aux, sup

# -- staging ------------------------------------------------------------------------------------
def free_bytes(path: str) -> int:
    """Bytes an unprivileged writer can still put on `path`'s filesystem."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


# Capture dirs are named for their owner, `eagle_fast-hs-{pid}.{start}-XXXXXXXX` (start: the
# process's start time, so a reused pid is not mistaken for the owner). close() removes a dir; a
# runner killed with SIGKILL cannot, so every engine start sweeps the dirs of dead owners.
_STORAGE_NAME = re.compile(r"^eagle_fast-hs-(\d+)\.(\d+)-")


def process_start(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (Linux /proc), or None when unknown."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def storage_prefix() -> str:
    pid = os.getpid()
    return f"eagle_fast-hs-{pid}.{process_start(pid) or 0}-"


def _owner_alive(pid: int, start: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's live process
    now = process_start(pid)
    return start == 0 or now is None or now == start


def sweep_orphaned_storage(parent: str) -> list[str]:
    """Remove capture dirs under `parent` whose owning process is gone; returns their paths.

    Only names this module writes are considered, and only when the owner is provably dead (no
    such pid, or the pid now belongs to a process that started at another time).
    """
    removed = []
    try:
        names = os.listdir(parent)
    except OSError:
        return removed
    for name in names:
        m = _STORAGE_NAME.match(name)
        if m is None or _owner_alive(int(m.group(1)), int(m.group(2))):
            continue
        path = os.path.join(parent, name)
        shutil.rmtree(path, ignore_errors=True)
        if not os.path.exists(path):
            removed.append(path)
    if removed:
        logger.info("removed %d capture dir(s) left by dead runners: %s", len(removed), removed)
    return removed


ENGINE_DIFF_BYTES = 256 << 20  # the fp32 log-prob rows one head call of the engine check holds


def diff_against_engine(head, engine_lps: list, captures: list, max_bytes: int = ENGINE_DIFF_BYTES) -> dict:
    """Log-probs rebuilt by `head` from each capture's final hidden state against vLLM's own
    prompt log-probs (`engine_lps[s][t]`: {id: logprob} after tokens [0, t); our row t - 1).

    Returns top1_agreement, max_abs_err over every id vLLM reports, positions, and
    max_abs_logit (our largest |logit| there, which scales a 16-bit tolerance). The head runs on
    row blocks whose fp32 [rows, V] log-probs stay within `max_bytes` (a real vocabulary's rows
    are 0.6 MB each), and only the ids vLLM reports are kept.
    """
    agree, total, max_err, max_logit = 0, 0, 0.0, 0.0
    rows_per_call = max(1, max_bytes // (4 * head.vocab_size))
    for lps, (_, final) in zip(engine_lps, captures):
        n = len(lps) - 1  # vLLM reports positions 1..len-1: our rows 0..len-2
        for r0 in range(0, n, rows_per_call):
            r1 = min(n, r0 + rows_per_call)
            out = head.compute(final[r0:r1], ("logprobs", "lse"))
            ours = out.logprobs.float().cpu()
            max_logit = max(max_logit, float((ours + out.lse.float().cpu()[:, None]).abs().max()))
            for t in range(r0 + 1, r1 + 1):
                entry = lps[t]
                ids = torch.tensor(list(entry))
                vals = torch.tensor(list(entry.values()))
                row = ours[t - 1 - r0]
                max_err = max(max_err, float((row[ids] - vals).abs().max()))
                agree += int(int(row.argmax()) == max(entry, key=entry.get))
                total += 1
    return {"top1_agreement": agree / max(total, 1), "max_abs_err": max_err, "positions": total,
            "max_abs_logit": max_logit}

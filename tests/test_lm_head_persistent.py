"""The persistent, TMA-fed Triton head (kernels/_triton_persistent.py) against the tiled kernel
and the float64 oracle.

What: on CPU through triton's interpreter, which runs the host tensor descriptors and the
kernel's own loop (6 programs: 3 lanes per group of 2 row blocks, 6 lanes in a short last
group), every mode the persistent kernel covers, on ragged N and V with several draft and
other tiles, row chunks, exact ties across draft and other tiles (the lowest target id wins),
and the routing of the modes it does not cover. Then the sm_90 compile (no GPU): TMA loads,
wgmma, shared memory and spills.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import os
import re
import subprocess
import sys

import pytest
import torch
from _assert import assert_close, assert_ids_equal
from _oracle import lm_head_oracle
from eagle_fast.kernels import lm_head
from test_lm_head_triton_internal import _int_logit_inputs
from triton.runtime.jit import JITFunction

kernels = importlib.import_module("eagle_fast.kernels")
lm = importlib.import_module("eagle_fast.kernels.lm_head_triton")
pers = importlib.import_module("eagle_fast.kernels._triton_persistent")
aot = importlib.import_module("eagle_fast.kernels._triton_aot")

pytestmark = pytest.mark.skipif(pers.TensorDescriptor is None, reason="triton has no TMA descriptors")


@contextlib.contextmanager
def persistent(monkeypatch):
    """`lm_head(impl="triton")` routed to kernel="persistent"; yields the kernels launched."""
    launched = []
    run = pers.run_kernel

    def spy(kernel, *args, **kwargs):
        launched.append(getattr(kernel, "fn", kernel).__name__)
        return run(kernel, *args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(pers, "run_kernel", spy)
        m.setattr(kernels, "_triton_impl", lambda: lambda req: lm.lm_head_triton(req, kernel="persistent"))
        yield launched


def _inputs(seed, N, H, V):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=g).bfloat16()
    weight = (torch.randn(V, H, generator=g) * 0.5).bfloat16()
    norm_weight = (1 + 0.1 * torch.randn(H, generator=g)).bfloat16()
    return hidden, weight, norm_weight


MODES = {
    "lse+argmax": {"outputs": ("lse", "argmax")},
    "argmax": {"outputs": ("argmax",)},
    "draft+argmax": {"outputs": ("draft", "argmax")},
    "draft+lse": {"outputs": ("draft", "lse", "argmax")},
    "draft-bf16+softcap+scale": {
        "outputs": ("draft", "argmax"), "out_dtype": torch.bfloat16, "softcap": 8.0, "logit_scale": 0.7,
    },
}


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("N, V", [(40, 1500), (64, 2100), (80, 3001)], ids=lambda x: str(x))
def test_persistent_matches_tiled_kernel_and_oracle(monkeypatch, mode, N, V):
    """N=40: 3 row blocks of 16 (a full group of 2 and a short one); N=64: 4 blocks, two full
    groups; N=80: 2 blocks of 64.
    V ragged against 256-wide tiles; the draft ids (every 3rd from 5) fill 2-4 draft tiles,
    the last of them mixed with other ids."""
    H = 64
    hidden, weight, nw = _inputs(N + V, N, H, V)
    kw = dict(MODES[mode])
    if "draft" in kw["outputs"]:
        kw["draft_ids"] = torch.arange(5, V, 3)
    tiled = lm_head(hidden, weight, nw, impl="triton", **kw)
    with persistent(monkeypatch) as launched:
        got = lm_head(hidden, weight, nw, impl="triton", **kw)
    assert launched == ["lm_head_persistent_kernel"]
    for name, t in tiled.as_dict().items():
        g = getattr(got, name)
        if t.is_floating_point():  # both fp32 dots of bf16 products; the order of sums differs
            assert_close(g, t, atol=2e-5, rtol=1e-5, name=name)
        else:
            assert_ids_equal(g, t, name=name)
    oracle = lm_head_oracle(hidden, weight, nw, **kw)
    assert_ids_equal(got.argmax, oracle.argmax, name="argmax vs oracle")
    if got.lse is not None:
        assert_close(got.lse, oracle.lse, atol=1e-4, rtol=1e-5, name="lse vs oracle")
    if got.draft_logprobs is not None:
        tol = 1e-4 if got.draft_logprobs.dtype == torch.float32 else 2e-2
        assert_close(got.draft_logprobs, oracle.draft_logprobs, atol=tol, rtol=tol, name="draft_lp")
        assert_ids_equal(got.argmax_in_draft, oracle.argmax_in_draft, name="argmax_in_draft")


@pytest.mark.parametrize("outputs", [("draft", "argmax"), ("draft", "lse")], ids="+".join)
def test_ties_go_to_the_lowest_target_id_across_draft_and_other_tiles(monkeypatch, outputs):
    """The 550 draft ids 601, 603, .., 1699 fill walk positions 0-549 (tiles 0-2 of 256; tile 2
    mixed: positions 550+ are the other ids 0, 1, ..); 7 tiles, the last ragged."""
    V = 1700
    draft = torch.arange(601, V, 2)
    logits = torch.zeros(7, V)
    logits[0, [1601, 7, 900]] = 5.0  # draft 1601 (tile 1) vs other id 7 (tile 2) -> 7
    logits[1, [1699, 1697, 600]] = 5.0  # draft ids (tile 2) and other id 600 (tile 4) -> 600
    logits[2, :] = -3.0  # everything ties -> 0
    logits[3, [1699, 1698]] = 4.0  # a draft id and the walk's last position -> 1698
    logits[4, [603, 605]] = 2.0  # two draft ids in tile 0 -> 603
    logits[5, [1681, 10]] = 6.0  # both in the mixed tile: draft position 540, other 560 -> 10
    logits[6, [1681, 1500, 1600]] = 6.0  # draft id 1681 vs other ids 1500 / 1600 (tiles 5, 6)
    hidden, weight = _int_logit_inputs(logits)
    kw = {"outputs": outputs, "draft_ids": draft, "norm": "none"}
    with persistent(monkeypatch) as launched:
        out = lm_head(hidden, weight, None, impl="triton", **kw)
    assert launched == ["lm_head_persistent_kernel"]
    assert out.argmax.tolist() == [7, 600, 0, 1698, 603, 10, 1500]
    assert out.argmax_in_draft.tolist() == [False, False, False, False, True, False, False]
    tiled = lm_head(hidden, weight, None, impl="triton", **kw)
    assert_close(out.draft_logprobs, tiled.draft_logprobs, atol=1e-6, rtol=1e-6, name="draft_lp")


def test_row_chunks_and_the_cached_walk_weight(monkeypatch):
    """_SCRATCH_BYTES=1: one 16-row block per launch (3 launches for 40 rows) gives what one
    launch gives; the draft-first weight copy is made once for a (weight, draft ids) pair and
    again after the weight changes in place."""
    hidden, weight, nw = _inputs(7, 40, 64, 1100)
    draft = torch.arange(0, 1100, 5)
    kw = {"outputs": ("draft", "lse", "argmax"), "draft_ids": draft}
    with persistent(monkeypatch) as launched:
        whole = lm_head(hidden, weight, nw, impl="triton", **kw)
        copy = pers._WALK_CACHE[0][-1]
        monkeypatch.setattr(lm, "_SCRATCH_BYTES", 1)
        chunked = lm_head(hidden, weight, nw, impl="triton", **kw)
        assert pers._WALK_CACHE[0][-1] is copy
        weight.mul_(-1.0)
        flipped = lm_head(hidden, weight, nw, impl="triton", **kw)
        assert pers._WALK_CACHE[0][-1] is not copy
    assert launched == ["lm_head_persistent_kernel"] * 7
    for name, t in whole.as_dict().items():
        c = getattr(chunked, name)
        if t.is_floating_point():
            assert_close(c, t, atol=1e-5, rtol=1e-5, name=name)
        else:
            assert_ids_equal(c, t, name=name)
    oracle = lm_head_oracle(hidden, weight, nw, **kw)
    assert_ids_equal(flipped.argmax, oracle.argmax, name="argmax after the in-place change")


def test_fp16_weights_and_an_unaligned_weight(monkeypatch):
    """fp16 weights run persistent; a weight view whose rows start off a 16-byte boundary
    cannot be a TMA descriptor's base and runs the tiled kernel, with the same result."""
    hidden, weight, _ = _inputs(11, 24, 64, 1031)
    weight = weight.half()
    with persistent(monkeypatch) as launched:
        got = lm_head(hidden.half(), weight, None, norm="none", impl="triton")
        oracle = lm_head_oracle(hidden.half(), weight, None, norm="none")
        assert launched == ["lm_head_persistent_kernel"]
        assert_ids_equal(got.argmax, oracle.argmax, name="argmax")
        assert_close(got.lse, oracle.lse, atol=1e-4, rtol=1e-5, name="lse")
        shifted = torch.empty(1031 * 64 + 1, dtype=torch.half)[1:].view(1031, 64).copy_(weight)
        again = lm_head(hidden.half(), shifted, None, norm="none", impl="triton")
        assert launched == ["lm_head_persistent_kernel"]  # the tiled kernel ran
    assert_ids_equal(again.argmax, got.argmax, name="argmax")


@pytest.mark.parametrize(
    "kw",
    [{"outputs": ("topk",), "k": 4}, {"outputs": ("logits",)}, {"outputs": ("draft_topk",), "k": 4}],
    ids=["topk", "logits", "draft_topk"],
)
def test_modes_it_does_not_cover_run_the_tiled_kernel(monkeypatch, kw):
    hidden, weight, nw = _inputs(3, 20, 64, 600)
    if "draft_topk" in kw["outputs"]:
        kw = {**kw, "draft_ids": torch.arange(0, 600, 7)}
    with persistent(monkeypatch) as launched:
        got = lm_head(hidden, weight, nw, impl="triton", **kw)
    assert launched == []
    oracle = lm_head_oracle(hidden, weight, nw, **kw)
    assert_ids_equal(got.argmax, oracle.argmax, name="argmax")


@pytest.mark.parametrize("value", ["persistent", "tiled", "fused"])
def test_variant_switch_is_read_at_import(value):
    """EAGLE_FAST_TRITON_VARIANT picks the launcher's default kernel once, at import; an
    unknown value fails the import, naming the choices."""
    code = ("from eagle_fast.kernels import lm_head_triton as m, _triton_config as c; "
            "print(c.KERNEL, m.lm_head_triton.__defaults__[0])")  # fmt: skip
    env = {**os.environ, "EAGLE_FAST_TRITON_VARIANT": value}
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120, check=False)  # fmt: skip
    if value == "fused":
        assert res.returncode != 0 and "expected one of ('tiled', 'persistent')" in res.stderr
    else:
        assert res.returncode == 0, res.stderr
        assert res.stdout.split() == [value, value]


# --------------------------------------------------------------------- sm_90, ahead of time

# Every mode the persistent kernel covers, with the launcher's blocks (`persistent_config`).
SM90_VARIANTS = list(aot.PERSISTENT_VARIANTS)


@pytest.mark.skipif(not isinstance(pers.lm_head_persistent_kernel, JITFunction),
                    reason="TRITON_INTERPRET=1 at import: no AOT compile")  # fmt: skip
@pytest.mark.parametrize("name", SM90_VARIANTS)
def test_persistent_kernel_compiles_for_hopper_with_tma_and_wgmma(monkeypatch, tmp_path, name):
    from triton.backends.compiler import GPUTarget

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))  # a cache hit would skip ptxas's log
    monkeypatch.setenv("TRITON_DUMP_PTXAS_LOG", "1")
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        kernel, cfg, progs = aot.compile_persistent_for(
            GPUTarget("cuda", 90, 32), aot.PERSISTENT_VARIANTS[name]
        )
    log, ptx = buf.getvalue(), kernel.asm["ptx"]
    regs = int(re.findall(r"Used (\d+) registers", log)[-1])
    spill = sum(map(int, re.findall(r"(\d+) bytes spill (?:stores|loads)", log)[-2:]))
    assert "cp.async.bulk.tensor.2d" in ptx, "operands not loaded by TMA"
    assert "wgmma.mma_async" in ptx
    assert kernel.metadata.shared <= 227 * 1024
    assert progs == 132 and progs % cfg.GROUP_SIZE == 0
    assert spill == 0, f"{name}: {spill} B spilled at {regs} registers"
    print(f"{name}: regs={regs} spill={spill}B smem={kernel.metadata.shared}B")

"""`--aux-dtype fp8`: float8_e4m3fn hidden states with one fp32 scale per token.

The codec against its derived error bound and hs_connectors' own quantiser; every format
(native aux and `hidden`, speculators read by hs_connectors' FileTransfer / FP8Transfer, NeMo
refused); `Eagle3Dataset` dequantising; `verify` passing an honest fp8 dataset and failing a
corrupted one; resume refusing a changed --aux-dtype; the CLI flag and `inspect`.
"""

from __future__ import annotations

import pytest
import torch
from _assert import assert_close, assert_ids_equal
from _pipeline import chat_lines, write_jsonl
from safetensors import safe_open

from eagle_fast import Eagle3Dataset, ExtractConfig, extract
from eagle_fast.cli import main
from eagle_fast.errors import UserError
from eagle_fast.pipeline.verify import verify
from eagle_fast.store.fp8 import FP8, dequantize, error_bound, quantize

MAX_LEN = 48
H = 128  # tiny_llama's hidden size


def _bound_holds(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, name: str) -> float:
    """Assert |dequantize(q) - x| <= error_bound elementwise; return the largest err / bound."""
    err = (dequantize(q, scale).double() - x.double()).abs()
    bound = error_bound(x, scale)
    bad = err > bound
    assert not bool(bad.any()), (
        f"{name}: {int(bad.sum())}/{bad.numel()} elements beyond the e4m3 bound; first "
        f"{[tuple(i.tolist()) for i in bad.nonzero()[:5]]}, max err/bound {float((err / bound).max()):.4g}")
    return float((err / bound).max())


# ------------------------------------------------------------------------------- codec


@pytest.mark.parametrize("shape", [(5, 123), (7, 4, 33)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_round_trip_within_the_e4m3_bound(shape, dtype):
    g = torch.Generator().manual_seed(shape[-1])
    # token magnitudes over five decades, and one outlier channel per token (real aux states have them)
    mag = 10.0 ** torch.empty(shape[0], *[1] * (len(shape) - 1)).uniform_(-3, 2, generator=g)
    x = torch.randn(shape, generator=g) * mag
    x.view(shape[0], -1)[:, 7] *= 30
    x = x.to(dtype)
    q, scale = quantize(x)
    assert q.dtype == FP8 and q.shape == x.shape and scale.dtype == torch.float32 and scale.shape == (shape[0],)
    amax = x.float().abs().flatten(1).amax(1)
    assert_close(scale, amax / 448, atol=0, rtol=1e-7, name="scale = amax / 448")
    assert bool((q.float().abs().flatten(1).amax(1) == 448).all())  # the token's amax maps to 448
    ratio = _bound_holds(x, q, scale, "dequantised")
    assert ratio > 0.5, f"the bound is loose (worst error {ratio:.3f} of it): is it the one derived?"
    # the brief's coarser form and the direction: per-token cosine >= sqrt(1 - 2^-8)
    deq = dequantize(q, scale).double().flatten(1)
    x64 = x.double().flatten(1)
    assert bool(((deq - x64).abs() <= amax.double()[:, None] * 2.0 ** -4).all())
    cos = torch.nn.functional.cosine_similarity(deq, x64, dim=1)
    assert bool((cos >= 1 - 2.0 ** -8).all()), cos.min()
    # read back in the target dtype: only that dtype's own rounding is added
    if dtype != torch.float32:
        err = (dequantize(q, scale, dtype).double() - x.double()).abs()
        assert bool((err <= error_bound(x, scale, dtype)).all())


def test_zero_tiny_and_huge_tokens():
    x = torch.zeros(6, 40)
    x[1, 3] = 2.5                                    # one non-zero value
    x[2] = torch.linspace(-1e-30, 1e-30, 40)         # below the scale floor
    x[3] = torch.linspace(-3e37, 3e37, 40)           # near fp32's max
    x[4, ::2] = -7.0                                 # a token with equal magnitudes
    x[5] = torch.randn(40) * 1e-3
    q, scale = quantize(x)
    deq = dequantize(q, scale)
    assert bool(torch.isfinite(deq).all()) and bool(torch.isfinite(scale).all()) and bool((scale > 0).all())
    assert torch.equal(deq[0], torch.zeros(40)) and not bool(torch.signbit(deq[0]).any())  # zeros stay +0
    assert abs(float(deq[1, 3]) - 2.5) <= 2.5 * 2.0 ** -22 and int((deq[1] != 0).sum()) == 1
    assert torch.equal(deq[4, ::2], torch.full((20,), -7.0))
    _bound_holds(x, q, scale, "edge tokens")


def test_codec_is_hs_connectors_quantiser_bit_for_bit():
    fp8_utils = pytest.importorskip("hs_connectors.fp8_utils")
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(9, 4, 50, generator=g) * torch.logspace(-2, 2, 9)[:, None, None]).to(torch.bfloat16)
    x[0] = 0
    q, scale = quantize(x)
    ref_q, ref_scale = fp8_utils.quantize_tensor_to_fp8(x)
    assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8))
    assert ref_scale.shape == (9, 1, 1) and torch.equal(scale, ref_scale.reshape(9))
    ref = fp8_utils.dequantize_fp8_tensor(ref_q, ref_scale, dtype=torch.float32)
    assert torch.equal(dequantize(q, scale), ref)


# ------------------------------------------------------------------------------- native


def _extract(model, data, out, **kw):
    cfg = {"engine": "hf", "dtype": "fp32", "max_len": MAX_LEN, "shard_size": 3, "aux_layers": "0,1,3",
           "progress_tty": False, **kw}
    return extract(ExtractConfig(model=str(model), data=str(data), out=str(out), **cfg))


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8data")
    return write_jsonl(root / "d.jsonl", chat_lines(6))


@pytest.fixture(scope="module")
def native_pair(tmp_path_factory, tiny_llama, data):
    """The same bf16 extraction (--supervision lse) with --aux-dtype auto and fp8 (through the CLI)."""
    root = tmp_path_factory.mktemp("fp8native")
    _extract(tiny_llama, data, root / "auto", dtype="bf16", supervision="lse")
    argv = ["extract", "--model", str(tiny_llama), "--data", str(data), "--out", str(root / "fp8"), "--engine", "hf",
            "--dtype", "bf16", "--max-len", str(MAX_LEN), "--shard-size", "3", "--aux-layers", "0,1,3",
            "--supervision", "lse", "--aux-dtype", "fp8"]
    assert main(argv) == 0
    return root / "auto", root / "fp8"


def test_native_fp8_layout_and_dataset_dequantises(native_pair):
    auto_dir, fp8_dir = native_pair
    a, f = Eagle3Dataset(auto_dir), Eagle3Dataset(fp8_dir)
    m = f.manifest
    assert m["settings"]["aux_dtype"] == "fp8" and m["layout_spec"]["aux_dtype"] == "fp8"
    assert "aux_dtype" not in a.manifest["settings"]  # auto manifests are as they always were
    assert m["fields"]["aux_hidden_states"] == {"dtype": "float8_e4m3fn", "shape": ["T", 3 * H]}
    assert m["fields"]["aux_hidden_states_scale"] == {"dtype": "float32", "shape": ["T"]}
    tokens = m["num_tokens"]
    # bytes: 3H one-byte values + a 4-byte scale per token instead of 3H bf16 values
    size = {d: sum(fl["bytes"] for r in Eagle3Dataset(d).manifest["shards"] for fl in r["files"])
            for d in (auto_dir, fp8_dir)}
    header_slack = 512 * m["num_shards"]
    assert abs((size[auto_dir] - size[fp8_dir]) - tokens * (3 * H * 2 - 3 * H - 4)) < header_slack
    f32 = Eagle3Dataset(fp8_dir, aux_dtype=torch.float32)
    for i in range(len(f)):
        raw, auto = f.raw(i), a[i]
        assert raw["aux_hidden_states"].dtype == FP8 and raw["aux_hidden_states_scale"].dtype == torch.float32
        with safe_open(str(fp8_dir / f.shards[i // 3]["files"][0]["path"]), framework="pt") as h:
            off = h.get_slice("offsets")[i % 3: i % 3 + 2]
            assert torch.equal(raw["aux_hidden_states"].view(torch.uint8),
                               h.get_slice("aux_hidden_states")[int(off[0]): int(off[1])].view(torch.uint8))
        got = f[i]
        assert set(got) == set(auto) and got["aux_hidden_states"].dtype == torch.bfloat16  # the target dtype
        x = auto["aux_hidden_states"]  # what --aux-dtype auto stores: the values fp8 quantised
        wide = f32[i]["aux_hidden_states"]
        assert wide.dtype == torch.float32
        assert torch.equal(wide, dequantize(raw["aux_hidden_states"], raw["aux_hidden_states_scale"]))
        _bound_holds(x, raw["aux_hidden_states"], raw["aux_hidden_states_scale"], f"sample {i} aux")
        err = (got["aux_hidden_states"].double() - x.double()).abs()
        assert bool((err <= error_bound(x, raw["aux_hidden_states_scale"], torch.bfloat16)).all())
        for name in ("input_ids", "loss_mask", "lse", "argmax"):  # the head saw unquantised states
            assert torch.equal(got[name], auto[name]), name
    batch = Eagle3Dataset.collate([f[0], f[1]])
    assert batch["aux_hidden_states"].dtype == torch.bfloat16


def test_inspect_shows_the_aux_dtype(native_pair, capsys):
    auto_dir, fp8_dir = native_pair
    assert main(["inspect", str(fp8_dir)]) == 0
    out = capsys.readouterr().out
    assert "aux dtype   fp8 (float8_e4m3fn, one fp32 scale per token)" in out
    assert "aux_hidden_states float8_e4m3fn[T, 384], aux_hidden_states_scale float32[T]" in out
    assert main(["inspect", str(auto_dir)]) == 0
    assert "aux dtype   bf16 (the target dtype)" in capsys.readouterr().out


def test_verify_holds_fp8_to_its_bound_and_catches_a_bad_scale(native_pair, tmp_path):
    import shutil

    ok, reports, _ = verify(str(native_pair[1]), samples=3)
    by_name = {r.name: r for r in reports}
    assert ok and by_name["aux_hidden_states"].kind == "fp8" and 0 < by_name["aux_hidden_states"].value <= 1
    assert "aux_hidden_states_scale" not in by_name  # checked through the dequantised values
    bad = tmp_path / "bad"
    shutil.copytree(native_pair[1], bad)
    path = bad / "shard-000000.safetensors"
    with safe_open(str(path), framework="pt") as h:
        scale = h.get_tensor("aux_hidden_states_scale")
    raw = bytearray(path.read_bytes())
    start = raw.find(scale.numpy().tobytes())
    assert start > 0
    raw[start: start + scale.numel() * 4] = (scale * 2).numpy().tobytes()  # twice too large
    path.write_bytes(bytes(raw))
    ok, reports, _ = verify(str(bad), samples=6, full_checksums=False)
    assert not ok and not {r.name: r for r in reports}["aux_hidden_states"].ok


def test_native_hidden_supervision_takes_fp8(tiny_llama, data, tmp_path):
    _extract(tiny_llama, data, tmp_path / "auto", supervision="hidden")
    _extract(tiny_llama, data, tmp_path / "fp8", supervision="hidden", aux_dtype="fp8")
    a, f = Eagle3Dataset(tmp_path / "auto"), Eagle3Dataset(tmp_path / "fp8")
    assert f.manifest["fields"]["hidden"]["dtype"] == "float8_e4m3fn"
    for i in range(len(f)):
        raw, got, auto = f.raw(i), f[i], a[i]
        assert set(raw) == {"input_ids", "loss_mask", "aux_hidden_states", "aux_hidden_states_scale",
                            "hidden", "hidden_scale"}
        assert set(got) == set(auto) and got["hidden"].dtype == torch.float32
        _bound_holds(auto["hidden"], raw["hidden"], raw["hidden_scale"], f"sample {i} hidden")
        assert torch.equal(got["hidden"], dequantize(raw["hidden"], raw["hidden_scale"]))
        # its own scale: not the aux states'
        assert_close(raw["hidden_scale"], auto["hidden"].abs().amax(1) / 448, atol=0, rtol=1e-7, name="scale")
    ok, reports, _ = verify(str(tmp_path / "fp8"), samples=2)
    assert ok and {r.name: r.kind for r in reports}["hidden"] == "fp8"


# -------------------------------------------------------------------------- speculators


def test_speculators_read_by_hs_connectors(tiny_llama, data, tmp_path):
    transfer = pytest.importorskip("hs_connectors.transfer")
    fp8_utils = pytest.importorskip("hs_connectors.fp8_utils")
    _extract(tiny_llama, data, tmp_path / "auto", layout="speculators")
    _extract(tiny_llama, data, tmp_path / "fp8", layout="speculators", aux_dtype="fp8")
    a, f = Eagle3Dataset(tmp_path / "auto"), Eagle3Dataset(tmp_path / "fp8", aux_dtype=torch.float32)
    plain = transfer.FileTransfer(tmp_path / "auto" / "hidden_states")
    raw8 = transfer.FileTransfer(tmp_path / "fp8" / "hidden_states")
    fp8_32 = transfer.FP8Transfer(tmp_path / "fp8" / "hidden_states", dequantize_dtype=torch.float32)
    fp8_16 = transfer.FP8Transfer(tmp_path / "fp8" / "hidden_states")  # its default: bf16
    for i in range(len(a)):
        # our bf16/fp32 output, through speculators' plain reader
        got = plain.get_cached(i)
        ours = a.raw(i)
        assert set(got) == {"hidden_states", "token_ids", "loss_mask"}
        assert got["hidden_states"].dtype == torch.float32 and torch.equal(got["hidden_states"], ours["hidden_states"])
        assert_ids_equal(got["token_ids"], ours["token_ids"], name="token_ids")
        T = got["token_ids"].numel()
        # fp8: exactly hs_connectors' layout, the bytes its connector would write
        stored = raw8.get_cached(i)
        assert set(stored) == {"hidden_states", "hidden_states_scales", "token_ids", "loss_mask"}
        assert stored["hidden_states"].dtype == FP8 and stored["hidden_states"].shape == (T, 4, H)
        assert stored["hidden_states_scales"].dtype == torch.float32 and stored["hidden_states_scales"].shape == (T, 1, 1)
        ref_q, ref_scale = fp8_utils.quantize_tensor_to_fp8(ours["hidden_states"])
        assert torch.equal(stored["hidden_states"].view(torch.uint8), ref_q.view(torch.uint8))
        assert torch.equal(stored["hidden_states_scales"], ref_scale)
        # FP8Transfer dequantises to what Eagle3Dataset gives, scales hidden as it promises
        deq = fp8_32.get_cached(i)
        assert set(deq) == {"hidden_states", "token_ids", "loss_mask"}
        assert torch.equal(deq["hidden_states"], f[i]["hidden_states"])
        _bound_holds(ours["hidden_states"], stored["hidden_states"], stored["hidden_states_scales"], f"hs_{i}")
        bf16 = fp8_16.get_cached(i)["hidden_states"]  # bf16 scale and product: bf16's rounding on top
        assert bf16.dtype == torch.bfloat16
        assert_close(bf16, deq["hidden_states"], atol=0, rtol=2.0 ** -7, name=f"hs_{i} bf16")
    assert fp8_32.get_cached(len(a)) is None
    ok, reports, _ = verify(str(tmp_path / "fp8"), samples=2)
    assert ok and {r.name: r.kind for r in reports}["hidden_states"] == "fp8"


# ------------------------------------------------------------------------ nemo, resume


def test_nemo_refuses_fp8_before_any_work(tiny_llama, data, tmp_path, capsys):
    with pytest.raises(UserError, match="--format nemo cannot store --aux-dtype fp8") as exc:
        _extract(tiny_llama, data, tmp_path / "o", layout="nemo", aux_dtype="fp8")
    assert "CachedEagle3Dataset" in exc.value.cause and "--format native or speculators" in exc.value.fix
    assert not (tmp_path / "o").exists()
    code = main(["extract", "--model", str(tiny_llama), "--data", str(data), "--out", str(tmp_path / "o"),
                 "--format", "nemo", "--aux-dtype", "fp8", "--engine", "hf"])
    err = capsys.readouterr().err
    assert code == 2 and "error: --format nemo cannot store --aux-dtype fp8" in err and "fix:" in err
    assert not (tmp_path / "o").exists()
    with pytest.raises(UserError, match="--aux-dtype 'fp4' is not one of auto, fp8"):
        _extract(tiny_llama, data, tmp_path / "o", aux_dtype="fp4")


def test_resume_refuses_a_changed_aux_dtype(tiny_llama, tmp_path):
    small = write_jsonl(tmp_path / "d.jsonl", chat_lines(2))
    for first, second in (("auto", "fp8"), ("fp8", "auto")):
        out = tmp_path / first
        _extract(tiny_llama, small, out, supervision="lse", aux_dtype=first)
        before = sorted(p.name for p in out.iterdir())
        with pytest.raises(UserError, match=f'aux_dtype: "{first}" -> "{second}"'):
            _extract(tiny_llama, small, out, supervision="lse", aux_dtype=second)
        assert sorted(p.name for p in out.iterdir()) == before
        again = _extract(tiny_llama, small, out, supervision="lse", aux_dtype=first)  # same setting resumes
        assert again.complete and "nothing to do" in again.note

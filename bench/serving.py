"""Serving throughput and latency over HTTP, as vLLM's serving benchmark measures them.

    python -m bench.serving --model DIR --concurrency 1,4,16 --prompt-len 512,4096 --output-len 256
    python -m bench.serving --shape 27B --tied --serve-args "--spec mtp"    # random weights, all drafts accepted
    python -m bench.serving --url http://127.0.0.1:8000 --vocab 248320 ...   # a server already running
    python -m bench.serving --concurrency 1,4,8 --prompt-len 512 --spec mtp --in-process  # HTTP vs in process
    python -m bench.serving --smoke          # CPU: the bundled model, 2 levels, a few tokens

Without --url it starts `specfire serve MODEL` (the bundled model when no --model; --shape writes
random weights of a shape first, bench/common.py; --serve-args adds flags) on a free port and
stops it at the end. Per (concurrency C, prompt length L): a warm-up closed loop of 2 x C
requests, then --requests streaming completions of random token-id prompts, at most C in
flight (each client thread sends its next request when its last one ends), greedy, ignore_eos, so
every request generates --output-len tokens. Per level: aggregate output tok/s (output tokens /
wall time), requests/s, TTFT and inter-token latency (between streamed chunks) p50 / p99, time per
output token, per-request decode tok/s (first to last chunk) p50 / min, the server's mean accept length, its own
decode tok/s, chunks per request, the CPU time per output token of its event-loop (main) thread and
of its engine (busiest other) thread from /proc (a server it started), its peak
memory (GPU memory of its process from nvidia-smi, else its resident set), and the CUDA graphs
it captured during the level's warm-up and during its timed part (a started server runs with -v,
which logs each capture; one in the timed part stalls every stream), and, once, how long the
started server took to answer /health and how many graphs it captured before any request. The server runs the
requests it holds in shared steps (one packed forward a round), its engine in a process of its own
(serve/engine.py: its busiest thread is the engine's); against bench/batch.py's in-process rate the
figures show what HTTP costs. Every request sends neutral penalties (repetition 1, frequency and
presence 0), so a model's generation_config.json penalties do not make it other work than
bench/batch.py's; `--in-process` runs bench/batch.py after the server has stopped, on the same
model, route, lengths and concurrencies, offered as these clients offer them (`--requests`: a
closed loop of fresh prompts, driven on one thread as the server's engine thread drives them), and prints its tok/s beside each level's. A table, then
one JSON line last.
"""
from __future__ import annotations

import argparse
import http.client
import json
import math
import os
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

from bench.common import machine, model_config, random_prompt, scratch_dir, write_checkpoint, write_tokenizer


# sent with every request: a model's generation_config.json penalties (the bundled model's
# repetition 1.05, frequency 0.7) would otherwise apply, which bench/batch.py's requests do not have
NEUTRAL = {"repetition_penalty": 1.0, "frequency_penalty": 0.0, "presence_penalty": 0.0}


def percentile(xs: list[float], p: float) -> float | None:
    """Nearest-rank percentile; None for no samples."""
    if not xs:
        return None
    s = sorted(xs)
    return s[max(0, math.ceil(p / 100 * len(s)) - 1)]


class Client:
    def __init__(self, url: str, api_key: str | None, model: str | None):
        u = urllib.parse.urlsplit(url)
        if u.scheme != "http" or not u.hostname:
            raise SystemExit(f"--url must look like http://HOST:PORT, got {url!r}")
        self.host, self.port, self.base = u.hostname, u.port or 80, u.path.rstrip("/").removesuffix("/v1") + "/v1"
        self.headers = {"Content-Type": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"
        self.model = model

    def complete(self, ids: list[int], tokens: int, spec: dict | None) -> dict:
        """One streaming completion; the client-side clock of each chunk, and the server's usage."""
        body = {"prompt": ids, "max_tokens": tokens, "temperature": 0.0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}, **NEUTRAL}
        if self.model:
            body["model"] = self.model
        if spec:
            body["speculation"] = spec
        conn = http.client.HTTPConnection(self.host, self.port, timeout=3600)
        t0 = time.perf_counter()
        chunks: list[float] = []
        usage: dict = {}
        timings: dict = {}
        try:
            conn.request("POST", self.base + "/completions", json.dumps(body), self.headers)
            resp = conn.getresponse()
            if resp.status != 200:
                return {"error": f"HTTP {resp.status}: {resp.read().decode('utf-8', 'replace')[:200]}"}
            for raw in resp:
                line = raw.decode("utf-8").strip()
                if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                    continue
                ev = json.loads(line[5:])
                if "error" in ev:
                    return {"error": str(ev["error"].get("message"))}
                if any(c.get("text") for c in ev.get("choices") or []):
                    chunks.append(time.perf_counter())
                usage = ev.get("usage") or usage
                timings = ev.get("timings") or timings
        except (OSError, http.client.HTTPException) as e:
            return {"error": f"{type(e).__name__}: {e}"}
        finally:
            conn.close()
        n = usage.get("completion_tokens", 0)
        if not chunks or not n:
            return {"error": "no tokens streamed"}
        span = chunks[-1] - chunks[0]
        return {"start": t0, "end": chunks[-1], "ttft": chunks[0] - t0, "tokens": n,
                "itl": [b - a for a, b in zip(chunks, chunks[1:])],
                "tpot": span / (n - 1) if n > 1 else None, "decode_tok_s": (n - 1) / span if n > 1 and span > 0 else None,
                "server_decode_tok_s": timings.get("decode_tok_s"), "accept_len": timings.get("mean_accept_len")}


class Memory:
    """Peak memory of the server while a level runs, sampled every 0.25 s: the GPU memory of its
    processes (the server's and its engine process's, nvidia-smi), else their resident sets (/proc);
    with no process (--url), the GPUs' used memory."""

    def __init__(self, pid: int | None):
        self.pid, self.peak, self._stop = pid, None, threading.Event()
        self.smi = shutil.which("nvidia-smi")

    def sample(self) -> float | None:
        try:
            procs = set(processes(self.pid))        # the server and its engine process
            if self.smi and self.pid:
                out = subprocess.run([self.smi, "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                                     capture_output=True, text=True, timeout=5).stdout
                mib = [float(m) for p, m in (ln.split(",") for ln in out.strip().splitlines() if "," in ln)
                       if int(p) in procs]
                if mib:
                    return sum(mib) / 1024
            if self.pid and os.path.exists(f"/proc/{self.pid}/status"):
                kb = 0
                for p in procs:
                    try:
                        with open(f"/proc/{p}/status") as f:
                            kb += sum(int(ln.split()[1]) for ln in f if ln.startswith("VmRSS:"))
                    except OSError:
                        pass
                return kb / 2 ** 20 if kb else None
            if self.smi:
                out = subprocess.run([self.smi, "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                                     capture_output=True, text=True, timeout=5).stdout
                return sum(float(x) for x in out.split()) / 1024
        except (OSError, ValueError, subprocess.SubprocessError):
            return None
        return None

    def _take(self) -> None:
        v = self.sample()
        if v is not None:
            self.peak = v if self.peak is None else max(self.peak, v)

    def __enter__(self):
        def loop():
            while not self._stop.wait(0.25):
                self._take()
        self._take()
        self._thread = threading.Thread(target=loop, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self._take()


def processes(pid: int | None) -> list[int]:
    """The server's process and its children (the engine process, mesh workers), from /proc."""
    if not pid:
        return []
    out = [pid]
    for p in out:
        for tid in os.listdir(f"/proc/{p}/task") if os.path.isdir(f"/proc/{p}/task") else []:
            try:
                with open(f"/proc/{p}/task/{tid}/children") as f:
                    out += [int(x) for x in f.read().split() if int(x) not in out]
            except OSError:
                pass
    return out


def thread_cpu(pid: int | None) -> dict[tuple[int, int], float]:
    """CPU seconds (user + system) of each thread of process `pid` and its children, keyed by
    (process, thread), from /proc ({} where unreadable)."""
    out: dict[tuple[int, int], tuple[float, float]] = {}
    for p in processes(pid):
        for tid in os.listdir(f"/proc/{p}/task") if os.path.isdir(f"/proc/{p}/task") else []:
            try:
                with open(f"/proc/{p}/task/{tid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                out[(p, int(tid))] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
            except (OSError, IndexError, ValueError):
                pass
    return out


def cpu_split(pid: int | None, before: dict, after: dict) -> tuple[float, float, float] | None:
    """The server's CPU seconds over a level: its main thread (uvicorn's event loop), the busiest
    other thread (the engine's: in the engine process, a child of the server), and the rest."""
    if not after:
        return None
    d = {t: v - before.get(t, 0.0) for t, v in after.items()}
    loop = d.pop((pid, pid), 0.0)
    engine = max(d.values(), default=0.0)
    return loop, engine, sum(d.values()) - engine


def captures(log_path: str | None, start: int) -> tuple[list[str] | None, int]:
    """What CUDA graphs the started server (run with -v) logged capturing past byte `start` of its
    log (each line's text after "captured a "), and where the log ends now; (None, start) for a
    server this bench did not start. Which graphs a level captures tells what to capture earlier."""
    if log_path is None:
        return None, start
    with open(log_path, "rb") as f:
        f.seek(start)
        got = f.read()
    mark = b"] captured a "
    return [ln.split(mark, 1)[1].decode(errors="replace").strip() for ln in got.splitlines() if mark in ln], start + len(got)


def tally(lines: list[str] | None) -> dict[str, int] | None:
    """Capture lines -> how many times each was logged (None stays None)."""
    return None if lines is None else dict(Counter(lines))


def level(client: Client, conc: int, plen: int, args, spec: dict | None, pid: int | None,
          log_path: str | None = None) -> dict:
    """--requests requests at concurrency `conc`, prompts of `plen` tokens: the level's figures.
    First a closed loop of 2 x conc requests of other prompts at the same concurrency (what
    bench/batch.py's closed loop warms with): the row patterns of this concurrency's joins and ends
    are captured before the level is timed. The graphs captured in each part are counted from the
    started server's log (each capture stalls every stream)."""
    prompts = [random_prompt(args.vocab, plen, seed=1000 * plen + i) for i in range(args.requests)]
    warm = [random_prompt(args.vocab, plen, seed=10 ** 9 + 1000 * plen + i) for i in range(2 * conc)]
    at = os.path.getsize(log_path) if log_path else 0
    with ThreadPoolExecutor(conc) as pool:
        list(pool.map(lambda ids: client.complete(ids, args.output_len, spec), warm))
    warm_caps, at = captures(log_path, at)
    with Memory(pid) as mem, ThreadPoolExecutor(conc) as pool:
        cpu0 = thread_cpu(pid)
        t0 = time.perf_counter()
        done = list(pool.map(lambda ids: client.complete(ids, args.output_len, spec), prompts))
        wall = time.perf_counter() - t0
        cpu = cpu_split(pid, cpu0, thread_cpu(pid))
    timed_caps, _ = captures(log_path, at)
    ok = [r for r in done if "error" not in r]
    toks = sum(r["tokens"] for r in ok)
    per_tok = (lambda v: None if cpu is None or not toks else round(v * 1e3 / toks, 4))
    ms = (lambda v: None if v is None else round(v * 1e3, 2))
    itl = [x for r in ok for x in r["itl"]]
    dec = [r["decode_tok_s"] for r in ok if r["decode_tok_s"]]
    return {"concurrency": conc, "prompt_len": plen, "output_len": args.output_len, "requests": len(done),
            "failed": len(done) - len(ok), "errors": sorted({r["error"] for r in done if "error" in r})[:3],
            "duration_s": round(wall, 3), "output_tokens": sum(r["tokens"] for r in ok), "output_tok_s": sum(r["tokens"] for r in ok) / wall,
            "requests_s": len(ok) / wall, "ttft_p50_ms": ms(percentile([r["ttft"] for r in ok], 50)),
            "ttft_p99_ms": ms(percentile([r["ttft"] for r in ok], 99)), "itl_p50_ms": ms(percentile(itl, 50)),
            "itl_p99_ms": ms(percentile(itl, 99)),
            "tpot_p50_ms": ms(percentile([r["tpot"] for r in ok if r["tpot"]], 50)),
            "decode_tok_s_p50": percentile(dec, 50), "decode_tok_s_min": min(dec) if dec else None,
            "server_decode_tok_s_p50": percentile([r["server_decode_tok_s"] for r in ok
                                                   if r["server_decode_tok_s"]], 50),
            "mean_accept_len_p50": percentile([r["accept_len"] for r in ok if r["accept_len"]], 50),
            "chunks_per_request": round(sum(len(r["itl"]) + 1 for r in ok) / len(ok), 1) if ok else None,
            "loop_cpu_ms_per_tok": per_tok(cpu[0]) if cpu else None,
            "engine_cpu_ms_per_tok": per_tok(cpu[1]) if cpu else None,
            "loop_cpu_ms_per_req": round(cpu[0] * 1e3 / len(ok), 2) if cpu and ok else None,
            "peak_mem_gb": None if mem.peak is None else round(mem.peak, 3),
            "captures_warmup": None if warm_caps is None else len(warm_caps),
            "captures_timed": None if timed_caps is None else len(timed_caps),
            "captured_warmup": tally(warm_caps), "captured_timed": tally(timed_caps)}


def start_server(model: str | None, extra: list[str], log_path: str, timeout: float) -> tuple[subprocess.Popen, str]:
    """`specfire serve [MODEL] EXTRA --port P` on a free port, once /health answers."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "specfire", "serve", *([model] if model else []), *extra, "--port", str(port)]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + timeout
    while True:
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            c.request("GET", "/health")
            if c.getresponse().status == 200:
                return proc, url
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            with open(log_path) as f:
                raise SystemExit("specfire serve did not start:\n" + f.read()[-3000:])
        time.sleep(0.5)


def in_process(args, concs: list[int], plens: list[int]) -> dict[tuple[int, int], tuple[float, float]]:
    """bench/batch.py's aggregate tok/s on the same model, route, lengths and concurrencies (greedy,
    ignore_eos, no penalties, as these requests): (concurrency, prompt length) -> (tok/s, the
    driving thread's CPU ms per token). Run after the server has stopped, so the device is free."""
    if args.spec not in ("off", "mtp", "ngram"):
        raise SystemExit("--in-process needs --spec off, mtp or ngram: bench.batch runs one route")
    out: dict[tuple[int, int], tuple[float, float]] = {}
    for plen in plens:
        cmd = [sys.executable, "-m", "bench.batch", "--concurrency", ",".join(map(str, concs)), "--prompt-len",
               str(plen), "--output-len", str(args.output_len), "--spec", args.spec, "--spec-k", str(args.spec_k),
               "--requests", str(args.requests), "--no-exact", *(["--model", args.model] if args.model else [])]
        print("in process: " + shlex.join(cmd[1:]), file=sys.stderr, flush=True)
        got = subprocess.run(cmd, capture_output=True, text=True)
        if got.returncode != 0:
            raise SystemExit(f"bench.batch failed:\n{got.stderr[-3000:]}")
        for r in json.loads(got.stdout.strip().splitlines()[-1])["levels"]:
            out[(r["c"], plen)] = (r["agg_tok_s"], r["host_cpu_ms_per_tok"])
    return out


def table(rows: list[dict]) -> None:
    print("\n| conc. | prompt | out | output tok/s | req/s | TTFT p50 / p99 ms | ITL p50 / p99 ms | "
          "decode tok/s p50 / min | server decode p50 | chunks / req | loop / engine CPU ms per tok | peak GB | failed | "
          "graphs captured warm-up / timed | in-process tok/s (HTTP x), CPU ms per tok |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    f = (lambda v, d=1: "-" if v is None else f"{v:.{d}f}")
    for r in rows:
        print(f"| {r['concurrency']} | {r['prompt_len']} | {r['output_len']} | {f(r['output_tok_s'])} | "
              f"{f(r['requests_s'], 2)} | {f(r['ttft_p50_ms'])} / {f(r['ttft_p99_ms'])} | "
              f"{f(r['itl_p50_ms'], 2)} / {f(r['itl_p99_ms'], 2)} | {f(r['decode_tok_s_p50'])} / "
              f"{f(r['decode_tok_s_min'])} | {f(r['server_decode_tok_s_p50'])} | {f(r['chunks_per_request'])} | "
              f"{f(r['loop_cpu_ms_per_tok'], 3)} / {f(r['engine_cpu_ms_per_tok'], 3)} | {f(r['peak_mem_gb'], 2)} | "
              f"{r['failed']} | {f(r.get('captures_warmup'), 0)} / {f(r.get('captures_timed'), 0)} | "
              f"{f(r.get('in_process_tok_s'))} ({f(r.get('http_x_in_process'), 2)}), "
              f"{f(r.get('in_process_cpu_ms_per_tok'), 3)} |")
    for r in rows:
        if r.get("captured_timed"):
            print(f"c = {r['concurrency']}, prompt {r['prompt_len']}: captured while timed: "
                  + "; ".join(f"{n} x {what}" for what, n in r["captured_timed"].items()))


def stop_server(proc: subprocess.Popen | None) -> None:
    if proc is not None and proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def ints(s: str, flag: str) -> list[int]:
    try:
        v = [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        v = []
    if not v or min(v) < 1:
        raise SystemExit(f"{flag} must be a comma-separated list of positive integers, got {s!r}")
    return v


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--url", default=None, help="a running server (default: start `specfire serve` here)")
    ap.add_argument("--model", default=None, help="checkpoint the started server loads (default: the bundled model)")
    ap.add_argument("--shape", default=None, help="serve random weights of this shape (bench/common.py SHAPES)")
    ap.add_argument("--tied", action="store_true", help="--shape: final norms -1, every MTP draft accepted")
    ap.add_argument("--serve-args", default="", help="more `specfire serve` flags, e.g. '--spec mtp --draft-vocab 32768'")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--served-model-name", default=None, help="model id sent with each request")
    ap.add_argument("--vocab", type=int, default=None, help="prompt ids are drawn below this (default: the "
                    "model's vocabulary; required with --url)")
    ap.add_argument("--concurrency", default="1,4,16", help="offered concurrency levels")
    ap.add_argument("--prompt-len", default="512", help="prompt lengths in tokens")
    ap.add_argument("--output-len", type=int, default=256, help="tokens each request generates")
    ap.add_argument("--requests", type=int, default=16, help="requests per level")
    ap.add_argument("--spec", default=None, help="speculation mode per request (off, mtp, ngram, auto; "
                    "default: the server's)")
    ap.add_argument("--spec-k", type=int, default=3)
    ap.add_argument("--start-timeout", type=float, default=900.0, help="seconds the started server may take to load")
    ap.add_argument("--out", default=os.environ.get("OUT"), help="folder for serving.json")
    ap.add_argument("--in-process", action="store_true",
                    help="then run bench.batch on the same model, route (--spec off, mtp or ngram), lengths, "
                         "concurrencies and closed loop of --requests, and print its in-process tok/s beside each level's (model flags in "
                         "--serve-args are not passed on)")
    ap.add_argument("--smoke", action="store_true", help="CPU: the bundled model, tiny levels")
    args = ap.parse_args()
    serve_args = shlex.split(args.serve_args)
    if args.smoke:
        args.url, args.model, args.output_len, args.requests = None, None, 6, 2
        args.concurrency, args.prompt_len = "1,2", "12"
        serve_args += ["--device", "cpu", "--max-seq-len", "256"]
    concs, plens = ints(args.concurrency, "--concurrency"), ints(args.prompt_len, "--prompt-len")
    if not args.url and not any(a.split("=")[0] == "--max-num-seqs" for a in serve_args):
        # a slot for every offered stream, as the in-process comparator has (the server's default
        # is 8 on a GPU, 4 on a CPU: more would queue, and TTFT would measure the queue)
        serve_args += ["--max-num-seqs", str(max(concs))]
    if not args.url and not any(a in ("-v", "--verbose") for a in serve_args):
        serve_args += ["-v"]            # its log lines: the graph captures each level counts
    if args.requests < 1 or args.output_len < 1:
        raise SystemExit("--requests and --output-len must be positive")
    if args.shape and (args.url or args.model):
        raise SystemExit("--shape writes the model the started server loads; it goes with neither --url nor --model")
    spec = {"mode": args.spec, "k": args.spec_k} if args.spec else None
    proc, url, work = None, args.url, tempfile.mkdtemp(prefix="serving-", dir=scratch_dir() if args.shape else None)
    try:
        if args.shape:
            import torch
            cfg = model_config(args.shape)
            dev = "cuda" if torch.cuda.is_available() else "cpu"
            args.model = write_checkpoint(os.path.join(work, args.shape), cfg,
                                          torch.bfloat16 if dev == "cuda" else torch.float32, dev, tied=args.tied)
            write_tokenizer(args.model, cfg.vocab_size)
        if args.vocab is None:
            if args.url:
                raise SystemExit("--vocab is required with --url (prompt ids are drawn below it)")
            from specfire.api import BUNDLED_MODEL
            from specfire.config import ModelConfig
            args.vocab = ModelConfig.from_dir(args.model or BUNDLED_MODEL).vocab_size
        started = None
        if url is None:
            t0 = time.perf_counter()
            proc, url = start_server(args.model, serve_args, os.path.join(work, "server.log"), args.start_timeout)
            at_start, _ = captures(os.path.join(work, "server.log"), 0)     # logged before any request
            started = {"start_s": round(time.perf_counter() - t0, 1), "captures_at_start": len(at_start)}
        client = Client(url, args.api_key, args.served_model_name)
        for plen in plens:                                   # compile kernels, capture graphs
            w = client.complete(random_prompt(args.vocab, plen, seed=plen), args.output_len, spec)
            if "error" in w:
                raise SystemExit(f"warm-up request failed: {w['error']}")
        rows = []
        for conc in concs:
            for plen in plens:
                rows.append(level(client, conc, plen, args, spec, proc.pid if proc else None,
                                  os.path.join(work, "server.log") if proc else None))
                print(json.dumps({"stage": "level", **rows[-1]}), flush=True)
        stop_server(proc)
        if args.in_process:
            rates = in_process(args, concs, plens)
            for r in rows:
                r["in_process_tok_s"], r["in_process_cpu_ms_per_tok"] = rates.get((r["concurrency"], r["prompt_len"]),
                                                                                  (None, None))
                r["http_x_in_process"] = (round(r["output_tok_s"] / r["in_process_tok_s"], 3)
                                          if r["in_process_tok_s"] else None)
    finally:
        stop_server(proc)
        shutil.rmtree(work, ignore_errors=True)
    table(rows)
    if started:
        print(f"the server answered /health after {started['start_s']} s, {started['captures_at_start']} graphs captured")
    model = f"random {args.shape}{' tied' if args.tied else ''}" if args.shape else args.model or "bundled"
    summary = {"bench": "serving", **machine(), "url": args.url, "model": model,
               "serve_args": serve_args, "spec": spec, "server_start": started, "levels": rows}
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "serving.json"), "w") as f:
            json.dump(summary, f, indent=1)
    print(json.dumps(summary))
    return 0 if all(r["failed"] == 0 for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())

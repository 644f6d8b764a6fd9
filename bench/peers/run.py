"""Peers side by side: the same random-weight checkpoint, the same GPU, the same prompts, one command.

    python -m bench.peers.run --wheels WHEELS_DIR          # on the GPU machine (writes to $OUT)
    python -m bench.peers.run --smoke                      # CPU: tiny shape, the whole flow

Per shape (4B first, then 27B while the time budget allows): write the checkpoint pair
(make_ckpt.py: normal random weights + a tied variant whose every MTP draft is accepted), then
run each engine's runner as its own process with its own timeout: specfire (AR, MTP k=1, k=3),
transformers `generate` (dynamic cache; static cache + torch.compile), ExLlamaV3 (AR, MTP k=1,
k=3). ExLlamaV3's CUDA extension is compiled in the background from the start (niced, on the
CPU cores the runners leave free); its runs go first once it is built, and a transformers task
still running then is stopped once it has had --hf-yield-after seconds (the modes it did not
finish get a second process at the end if --hf-late-min seconds are left). While a checkpoint is
written, specfire's and transformers' runners compile their kernels on a 2-layer copy of the shape
(prewarm.py). Each runner writes JSON as it goes; results.json and the table (peers.md, table.py)
are rewritten after every task, so a run cut short keeps what it measured. `--dry` checks a timing
plan on the CPU with sleeping stand-ins (plan.py).

WHEELS_DIR holds `fla/` (flash-linear-attention + fla-core 0.6.0) and `exl3/` (exllamav3 1.6.x
and the dependencies the machine lacks); they are installed with pip --target into a scratch
folder that only the matching runner sees.
"""
from __future__ import annotations

import argparse
import datetime
import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

from bench.peers import common
from bench.peers import table
from bench.peers.prewarm import Prewarm

ROOT = os.path.dirname(os.path.dirname(common.HERE))


class Driver(Prewarm):
    def __init__(self, args):
        self.args = args
        self.t0 = self.clock()
        self.deadline = self.t0 + args.budget
        self.out = args.out
        os.makedirs(self.out, exist_ok=True)
        self.work = tempfile.mkdtemp(prefix="peers_")
        self.log_path = os.path.join(self.out, "run.log")
        self.build: dict = {}
        self.build_proc = None
        self.exl3_env: dict | None = None
        self.site: dict[str, str | None] = {"fla": None, "exl3": None}
        self.results: dict = {
            "command": "python bench/peers/" + " ".join([os.path.basename(sys.argv[0]), *sys.argv[1:]]),
            "date": datetime.date.today().isoformat(), "commit": args.commit or git_commit(),
            "machine": machine(), "ceiling_Bps": common.CEILING, "prompt_len": args.prompt_len,
            "n_prompts": args.n_prompts, "tokens": args.tokens, "hf_tokens": args.hf_tokens,
            "budget_s": args.budget, "shapes": {}, "timeline": []}

    # ---- bookkeeping -------------------------------------------------------------------------
    def left(self) -> float:
        return self.deadline - self.clock()

    def now(self) -> float:
        return self.clock() - self.t0

    def note(self, what: str, **kw) -> None:
        row = {"t": round(self.now(), 1), "what": what, **kw}
        self.results["timeline"].append(row)
        self.log(json.dumps(row))
        self.save()

    def log(self, line: str) -> None:
        print(f"[peers {self.now():6.1f}s] {line}", flush=True)
        with open(self.log_path, "a") as f:
            f.write(f"[{self.now():6.1f}s] {line}\n")

    def save(self) -> None:
        self.results["build"] = self.build
        with open(os.path.join(self.out, "results.json"), "w") as f:
            json.dump(self.results, f, indent=1)
        with open(os.path.join(self.out, "peers.md"), "w") as f:
            f.write(table.markdown(self.results) + "\n")

    # ---- processes ---------------------------------------------------------------------------
    def env(self, site: str | None = None) -> dict:
        e = dict(os.environ)
        paths = [site] if site else []
        paths += [ROOT, e.get("PYTHONPATH", "")]
        e["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
        e["PYTHONUNBUFFERED"] = "1"
        if common.device() == "cpu":          # tiny models: extra threads only contend for the cores
            e.setdefault("OMP_NUM_THREADS", "1")
        return e

    # plan.py's dry run replaces these four with a virtual clock and sleeping stand-ins
    def clock(self) -> float:
        return time.monotonic()

    def sleep(self, sec: float) -> None:
        time.sleep(sec)

    def popen(self, name: str, cmd: list[str], env: dict, out) -> subprocess.Popen:
        return subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

    def wait(self, p: subprocess.Popen, timeout: float) -> int:
        return p.wait(timeout=timeout)

    def call(self, name: str, cmd: list[str], timeout: float, env: dict, yield_after: float | None = None) -> dict:
        """Run one task in its own process group; kill the group at `timeout`, or, with
        `yield_after`, once the ExLlamaV3 build is done and the task has had that many seconds."""
        logf = os.path.join(self.work, name + ".log")
        t = self.clock()
        with open(logf, "w") as f:
            p = self.popen(name, cmd, env, f)
            status = None
            while status is None:
                step = timeout - (self.clock() - t)
                if yield_after is not None and self.build_state() == "running":
                    step = min(step, 1.0)
                try:
                    rc = self.wait(p, max(0.1, step))
                    status = "ok" if rc == 0 else f"exit {rc}"
                except subprocess.TimeoutExpired:
                    ran = self.clock() - t
                    if ran >= timeout:
                        status = f"timed out after {timeout:.0f} s"
                    elif yield_after is not None and self.build_state() == "ok" and ran >= yield_after:
                        status = f"stopped after {ran:.0f} s: ExLlamaV3's build was done and its runs come next"
                    if status is not None:
                        os.killpg(p.pid, signal.SIGKILL)
                        p.wait()
        sec = self.clock() - t
        with open(logf) as f:
            text = f.read()
        with open(self.log_path, "a") as f:
            f.write(f"---- {name} ({status}, {sec:.1f} s) ----\n{text[-20000:]}\n")
        last = [ln for ln in text.splitlines() if ln.strip()]
        return {"status": status, "seconds": sec, "last_line": last[-1][:300] if last else ""}

    # ---- set-up: wheels and the ExLlamaV3 build ----------------------------------------------
    def install(self) -> None:
        if not self.args.wheels:
            return
        for sub in ("fla", "exl3"):
            whl = sorted(glob.glob(os.path.join(self.args.wheels, sub, "*.whl")))
            if not whl:
                continue
            target = os.path.join(self.work, "site_" + sub)
            pip = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--no-compile",
                   "--no-cache-dir", "--target", target]
            r = subprocess.run(pip + whl, capture_output=True, text=True)
            failed = []
            if r.returncode != 0:      # one wheel this platform refuses must not cost the others
                for w in whl:
                    if subprocess.run(pip + [w], capture_output=True, text=True).returncode != 0:
                        failed.append(os.path.basename(w))
            self.note("install", what_=sub, rc=r.returncode, err=r.stderr.strip()[-300:], failed=failed)
            if len(failed) < len(whl):
                self.site[sub] = target

    def start_build(self) -> None:
        if "exllamav3" not in self.args.engines or common.device() != "cuda" or self.site["exl3"] is None:
            return
        env = self.exl3_env = self.env(self.site["exl3"])
        env.setdefault("MAX_JOBS", str(os.cpu_count() or 8))
        arch = cuda_arch()
        if arch:   # the runner gets the same value: other nvcc flags would make ninja rebuild it all
            env.setdefault("TORCH_CUDA_ARCH_LIST", arch)
        self.build_log = open(os.path.join(self.out, "exl3_build.log"), "w")
        self.build = {"started_t": round(self.now(), 1), "max_jobs": env["MAX_JOBS"],
                      "arch": env.get("TORCH_CUDA_ARCH_LIST")}
        self.build_t = self.clock()
        self.build_proc = self.popen("exl3_build", ["nice", "-n", "10", sys.executable, "-c",
                                                    "import exllamav3, exllamav3.ext; print('built')"],
                                     env, self.build_log)
        self.build_end = None       # set by a thread when the build exits (the driver polls it only between tasks)
        threading.Thread(target=self._watch_build, daemon=True).start()
        self.note("exl3 build started", max_jobs=env["MAX_JOBS"], arch=env.get("TORCH_CUDA_ARCH_LIST"))

    def _watch_build(self) -> None:
        self.build_proc.wait()
        self.build_end = self.clock()

    def build_state(self) -> str:
        """'none' (not attempted), 'running', 'ok' or 'failed'."""
        if self.build_proc is None:
            return "none"
        if "rc" not in self.build:
            rc = self.build_proc.poll()
            if rc is None:
                return "running"
            end = self.build_end or self.clock()
            self.build.update(rc=rc, seconds=round(end - self.build_t, 1), ended_t=round(end - self.t0, 1))
            self.build_log.flush()
            self.note("exl3 build ended", rc=rc, seconds=self.build["seconds"])
        return "ok" if self.build["rc"] == 0 else "failed"

    def stop_build(self) -> None:
        if self.build_state() == "running":
            self.build.update(rc=None, seconds=round(self.clock() - self.build_t, 1), killed_at_budget=True)
            os.killpg(self.build_proc.pid, signal.SIGKILL)
            self.note("exl3 build killed at the end of the budget", seconds=self.build["seconds"])

    # ---- tasks -------------------------------------------------------------------------------
    def shape_entry(self, shape: str) -> dict:
        return self.results["shapes"].setdefault(shape, {"runners": {}})

    def ckpt_code(self, shape: str, out: str, root: str | None = None) -> str:
        return (f"import json, torch; from bench.peers import make_ckpt; dev = 'cuda' if torch.cuda.is_available() else 'cpu'; "
                f"r = make_ckpt.make({shape!r}, {root or self.args.ckpt_root!r}, dev, "
                f"torch.bfloat16 if dev == 'cuda' else torch.float32); json.dump(r, open({out!r}, 'w'))")

    def make_ckpt(self, shape: str) -> bool:
        sh = self.shape_entry(shape)
        cfg = common.cfg_for(shape)
        ctx = self.args.prompt_len + self.args.tokens // 2
        elem = 2 if common.device() == "cuda" else 4
        sh["step_bytes"] = common.step_bytes_cfg(cfg, ctx, elem)
        sh["step_ctx"] = ctx
        need = common.step_bytes_cfg(cfg, 0, elem) * 1.05 + (1 << 30)
        free = self.disk_free()
        if free < need:
            sh["skipped"] = f"{free / 1e9:.0f} GB free under {self.args.ckpt_root}, the checkpoint needs {need / 1e9:.0f} GB"
            self.save()
            return False
        prompts = common.make_prompts(cfg.vocab_size, self.args.n_prompts, self.args.prompt_len)
        sh["prompts_file"] = os.path.join(self.work, f"prompts_{shape}.json")
        with open(sh["prompts_file"], "w") as f:
            json.dump(prompts, f)
        out = os.path.join(self.work, f"ckpt_{shape}.json")
        r = self.call(f"ckpt_{shape}", [sys.executable, "-c", self.ckpt_code(shape, out)], min(self.args.ckpt_timeout, self.left()),
                      self.env())
        if r["status"] != "ok" or not os.path.exists(out):
            sh["skipped"] = f"checkpoint not written ({r['status']}: {r['last_line']})"
            self.note("ckpt failed", shape=shape, **r)
            return False
        with open(out) as f:
            sh["ckpt"] = json.load(f)
        self.note("ckpt written", shape=shape, seconds=round(sh["ckpt"]["seconds"], 1))
        return True

    def disk_free(self) -> float:
        return shutil.disk_usage(self.args.ckpt_root).free

    def runner_cmd(self, engine: str, sh: dict, modes: list[str], tokens: int, res_path: str) -> tuple[list, dict]:
        site = {"transformers": self.site["fla"], "exllamav3": self.site["exl3"]}.get(engine)
        cmd = [sys.executable, "-m", f"bench.peers.run_{engine}", "--normal", sh["ckpt"]["normal"],
               "--tied", sh["ckpt"]["tied"], "--prompts", sh["prompts_file"], "--tokens", str(tokens),
               "--modes", ",".join(modes), "--out", res_path]
        env = self.exl3_env if engine == "exllamav3" and self.exl3_env else self.env(site)
        return cmd, env

    def runner(self, engine: str, shape: str, modes: list[str], timeout: float, tokens: int,
               yield_after: float | None = None, late: bool = False) -> None:
        """One runner process; `late`: a second run of an engine (modes it did not finish), merged."""
        sh = self.shape_entry(shape)
        res_path = os.path.join(self.work, f"{engine}_{shape}{'_late' if late else ''}.json")
        cmd, env = self.runner_cmd(engine, sh, modes, tokens, res_path)
        t = min(timeout, self.left())
        r = self.call(f"{engine}_{shape}{'_late' if late else ''}", cmd, t, env, yield_after)
        data = {}
        if os.path.exists(res_path):
            with open(res_path) as f:
                data = json.load(f)
        data.update(wanted=modes, task_status=r["status"], task_seconds=round(r["seconds"], 1))
        if r["status"] != "ok":
            data["status_line"] = data.get("error") or f"{r['status']}: {data.get('progress') or r['last_line']}"
        if late and engine in sh["runners"]:
            first = sh["runners"][engine]
            first["late_run"] = {k: v for k, v in data.items() if k != "modes"}
            first.setdefault("modes", {}).update(data.get("modes", {}))
            if all(m in first["modes"] for m in first["wanted"]):
                first.pop("status_line", None)
            elif r["status"] != "ok":
                first["status_line"] = data["status_line"]
            data = first
        sh["runners"][engine] = data
        self.note(f"{engine} {shape} done", status=r["status"], seconds=round(r["seconds"], 1))

    def skip(self, engine: str, shape: str, modes: list[str], why: str) -> None:
        self.shape_entry(shape)["runners"][engine] = {"wanted": modes, "status_line": why, "modes": {}}
        self.note(f"{engine} {shape} skipped", why=why)

    def exl3(self, shape: str) -> None:
        modes = self.args.exl3_modes.split(",")
        st = self.build_state()
        if common.device() != "cuda" or self.site["exl3"] is None and st == "none":
            # the runner itself says why in one line (no CUDA, package not importable)
            self.runner("exllamav3", shape, modes, 120, self.args.tokens)
        elif st == "failed":
            self.skip("exllamav3", shape, modes, f"extension build failed after {self.build['seconds']:.0f} s "
                      f"(exl3_build.log: {tail(self.build_log.name)})")
        else:
            self.runner("exllamav3", shape, modes, self.args.exl3_timeout, self.args.tokens)

    def main(self) -> None:
        a = self.args
        self.install()
        self.start_build()
        pending_exl3: list[str] = []
        try:
            for i, shape in enumerate(a.shapes.split(",")):
                if i > 0 and self.left() < a.big_min:
                    self.shape_entry(shape)["skipped"] = (
                        f"{self.left():.0f} s of the {a.budget:.0f} s budget left; the shape needs about "
                        f"{a.big_min:.0f} s (checkpoint + runs)")
                    self.note("shape skipped", shape=shape)
                    continue
                self.drain(pending_exl3)
                self.prewarm_start(shape)
                ok = self.make_ckpt(shape)
                self.prewarm_finish()
                if not ok:
                    continue
                big = i > 0
                tasks = []
                if "specfire" in a.engines:
                    tasks.append(("specfire", a.sf_modes.split(","), a.sf_timeout, a.tokens))
                if "transformers" in a.engines:
                    modes = (a.hf_modes_big if big else a.hf_modes).split(",")
                    tasks.append(("transformers", modes, a.hf_timeout, a.hf_tokens))
                if "exllamav3" in a.engines:
                    pending_exl3.append(shape)
                for eng, modes in (("specfire", a.sf_modes), ("transformers", a.hf_modes_big if big else a.hf_modes),
                                   ("exllamav3", a.exl3_modes)):
                    if eng not in a.engines:   # the table still says why this engine has no row
                        self.skip(eng, shape, modes.split(","), a.why_left_out or "left out of this run (--engines)")
                for eng, modes, tmo, toks in tasks:
                    self.drain(pending_exl3)
                    # a later shape's task must leave time for ExLlamaV3 runs still waiting on the build
                    reserve = a.exl3_reserve if big and pending_exl3 and self.build_state() == "running" else 0
                    if self.left() < a.min_task + reserve:
                        self.skip(eng, shape, modes, f"budget spent ({a.budget:.0f} s"
                                  + (f", {reserve:.0f} s kept for ExLlamaV3)" if reserve else ")"))
                        continue
                    self.runner(eng, shape, modes, tmo, toks,
                                yield_after=a.hf_yield_after if eng == "transformers" and pending_exl3 else None)
            self.drain(pending_exl3, wait=True)
            self.late_transformers()
            for shape in pending_exl3:
                why = (f"extension still compiling when the {a.budget:.0f} s budget ran out "
                       f"({self.clock() - self.build_t:.0f} s of build)") if self.build_state() == "running" \
                    else f"budget spent ({a.budget:.0f} s)"
                self.skip("exllamav3", shape, a.exl3_modes.split(","), why)
        finally:
            self.prewarm_finish()
            self.stop_build()
            self.results["wall_s"] = round(self.now(), 1)
            self.save()
            for shape, sh in self.results["shapes"].items():
                for d in ("normal", "tied"):
                    p = sh.get("ckpt", {}).get(d)
                    if p and not a.keep:
                        shutil.rmtree(p, ignore_errors=True)
            print(table.markdown(self.results), flush=True)

    def late_transformers(self) -> None:
        """transformers' modes cut short (stopped for ExLlamaV3 or by their timeout) get a second
        process at the end if --hf-late-min seconds are left."""
        a = self.args
        for shape, sh in self.results["shapes"].items():
            r = sh.get("runners", {}).get("transformers")
            if not r or "ckpt" not in sh or r.get("late_run") or "error" in r:
                continue
            left_modes = [m for m in r.get("wanted", []) if "tok_s" not in r.get("modes", {}).get(m, {})
                          or r["modes"][m].get("prompts_done", 1) < r["modes"][m].get("prompts_total", 1)]
            if not left_modes or r.get("task_status") == "ok":
                continue
            if self.left() < a.hf_late_min:
                self.note("transformers late run skipped", shape=shape, left=round(self.left()), modes=left_modes)
                continue
            self.runner("transformers", shape, left_modes, self.left(), a.hf_tokens, late=True)

    def drain(self, pending: list[str], wait: bool = False) -> None:
        """Run the ExLlamaV3 tasks whose build is settled (first in line once it is); with `wait`,
        wait for the build while the budget allows."""
        while pending:
            st = self.build_state()
            if st == "running" and wait and self.left() > self.args.min_task:
                self.sleep(2)
                continue
            if st == "running" or self.left() < self.args.min_task:
                return
            self.exl3(pending.pop(0))


def tail(path: str) -> str:
    try:
        with open(path) as f:
            lines = [ln.strip() for ln in f if ln.strip()]
        return lines[-1][:200] if lines else "empty"
    except OSError:
        return "no log"


def git_commit() -> str | None:
    try:
        return subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def cuda_arch() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20).stdout.split()
        return out[0] if out else None
    except (OSError, subprocess.SubprocessError):
        return None


def machine() -> dict:
    import platform

    import torch
    m = {"torch": torch.__version__, "python": platform.python_version(), "cpus": os.cpu_count()}
    try:
        m["gpu"] = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                                  capture_output=True, text=True, timeout=20).stdout.strip() or "cpu"
    except (OSError, subprocess.SubprocessError):
        m["gpu"] = "cpu"
    return m


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="4B,27B", help="in order; later shapes only while the budget allows")
    ap.add_argument("--engines", default="specfire,transformers,exllamav3")
    ap.add_argument("--why-left-out", help="one line for the table's rows of the engines --engines leaves out")
    ap.add_argument("--budget", type=float, default=430, help="seconds for the whole run")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--n-prompts", type=int, default=2, help="timed prompts (plus one warm-up prompt)")
    ap.add_argument("--tokens", type=int, default=128, help="tokens per prompt: specfire, ExLlamaV3")
    ap.add_argument("--hf-tokens", type=int, default=64, help="tokens per prompt: transformers (slower)")
    ap.add_argument("--sf-modes", default="ar,mtp1,mtp3")
    ap.add_argument("--hf-modes", default="eager,static_compile")
    ap.add_argument("--hf-modes-big", default="eager", help="transformers modes on the shapes after the first")
    ap.add_argument("--exl3-modes", default="ar,mtp1,mtp3")
    ap.add_argument("--sf-timeout", type=float, default=150)
    ap.add_argument("--hf-timeout", type=float, default=240)
    ap.add_argument("--exl3-timeout", type=float, default=150)
    ap.add_argument("--ckpt-timeout", type=float, default=150)
    ap.add_argument("--min-task", type=float, default=25, help="no task starts with less time left")
    ap.add_argument("--big-min", type=float, default=260,
                    help="a later shape starts only with this much left (checkpoint + one runner + ExLlamaV3)")
    ap.add_argument("--exl3-reserve", type=float, default=100,
                    help="seconds a later shape's task leaves for ExLlamaV3 runs waiting on the build")
    ap.add_argument("--hf-yield-after", type=float, default=60,
                    help="transformers' task is stopped once ExLlamaV3's build is done and it has run this long")
    ap.add_argument("--hf-late-min", type=float, default=90,
                    help="seconds needed at the end for a second transformers run of the modes it did not finish")
    ap.add_argument("--prewarm", action=argparse.BooleanOptionalAction, default=None,
                    help="compile specfire's and transformers' kernels on a 2-layer copy of the shape while "
                         "its checkpoint is written (default: on with CUDA)")
    ap.add_argument("--prewarm-grace", type=float, default=10,
                    help="seconds the pre-warm may run past the checkpoint before it is stopped")
    ap.add_argument("--prewarm-ckpt-timeout", type=float, default=60)
    ap.add_argument("--prewarm-root", default=tempfile.gettempdir(),
                    help="where the small pre-warm checkpoint goes (not /dev/shm: that holds the big one)")
    ap.add_argument("--dry", metavar="EST", nargs="?", const="",
                    help="timing plan check: no engine runs; each task sleeps its estimate (plan.py: "
                         "'ckpt=85,specfire=60,...' seconds), on a clock sped up by --dry-scale")
    ap.add_argument("--dry-scale", type=float, default=0.2)
    ap.add_argument("--ckpt-root", default="/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())
    ap.add_argument("--wheels", help="folder with fla/ and exl3/ wheel folders, installed per runner")
    ap.add_argument("--out", default=os.environ.get("OUT") or os.path.join(tempfile.gettempdir(), "peers_out"))
    ap.add_argument("--commit", help="commit id to record (default: git rev-parse)")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoints")
    ap.add_argument("--smoke", action="store_true", help="CPU check of the whole flow: tiny shape, few tokens")
    args = ap.parse_args()
    if args.smoke:
        args.shapes, args.prompt_len, args.tokens, args.hf_tokens = "tiny", 24, 12, 12
        args.budget = max(args.budget, 1500)
        args.ckpt_root = tempfile.mkdtemp(prefix="peers_ckpt_")
    if args.prewarm is None:
        args.prewarm = common.device() == "cuda"
    if args.dry is not None:
        from bench.peers import plan
        plan.DryDriver(args).main()
    else:
        Driver(args).main()


if __name__ == "__main__":
    main()

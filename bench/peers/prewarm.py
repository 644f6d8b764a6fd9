"""run.py's pre-warm: while the big checkpoint is written, the same kernels are compiled on a
2-layer copy of the shape (`<shape>-warm` in common.py: the same widths, vocabulary 4096), so the
measured runs do not pay Triton / inductor compiles and autotuning on the critical path of a
time-boxed GPU call. Their own warm-up still runs before anything is timed; the tok/s and TTFT
figures do not depend on it, only how soon the runners get there.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading

from bench.peers import common


class Prewarm:
    """Mixed into run.Driver (uses its clock, popen, wait, env, runner_cmd, ckpt_code, note)."""

    def prewarm_start(self, shape: str) -> None:
        """In a thread, beside the big checkpoint's writer: write `<shape>-warm` (the shape's widths,
        2 layers, vocabulary 4096: seconds), then start specfire's and transformers' runners on it,
        so the Triton / inductor compiles and autotuning they pay at first use land in the on-disk
        caches while the big checkpoint is written; the measured runs then start warm (their own
        warm-up still runs). The thread touches no shared state but `self.prewarm`."""
        a = self.args
        engines = [e for e in ("specfire", "transformers") if e in a.engines]
        if not a.prewarm or not engines:
            return
        warm = shape + common.WARM
        pw = self.prewarm = {"shape": warm, "procs": {}, "t0": self.clock()}

        def work() -> None:
            cfg = common.cfg_for(warm)
            sh = {"prompts_file": os.path.join(self.work, f"prompts_{warm}.json")}
            with open(sh["prompts_file"], "w") as f:
                json.dump(common.make_prompts(cfg.vocab_size, a.n_prompts, a.prompt_len), f)
            out = os.path.join(self.work, f"ckpt_{warm}.json")
            with open(os.path.join(self.work, f"ckpt_{warm}.log"), "w") as log:
                code = self.ckpt_code(warm, out, a.prewarm_root)
                p = self.popen(f"ckpt_{warm}", [sys.executable, "-c", code], self.env(), log)
                try:
                    rc = self.wait(p, a.prewarm_ckpt_timeout)
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)
                    rc = "timed out"
            if rc != 0 or not os.path.exists(out) or pw.get("stop"):
                pw["skipped"] = f"2-layer checkpoint not written ({rc})" if not pw.get("stop") else "stopped"
                return
            with open(out) as f:
                sh["ckpt"] = json.load(f)
            pw["ckpt"] = sh["ckpt"]
            pw["ckpt_s"] = round(self.clock() - pw["t0"], 1)
            for eng in engines:
                modes = (a.sf_modes if eng == "specfire" else a.hf_modes).split(",")
                res_path = os.path.join(self.work, f"{eng}_{warm}.json")
                cmd, env = self.runner_cmd(eng, sh, modes, a.tokens if eng == "specfire" else a.hf_tokens, res_path)
                log = open(os.path.join(self.work, f"prewarm_{eng}.log"), "w")
                pw["procs"][eng] = (self.popen(f"prewarm_{eng}", cmd, env, log), self.clock(), res_path, log)

        pw["thread"] = threading.Thread(target=work, daemon=True)
        pw["thread"].start()

    def prewarm_finish(self) -> None:
        """Wait up to --prewarm-grace for the pre-warm runners, stop the rest (nothing may share the
        GPU with a measured run), record how far each got, delete the small checkpoint."""
        pw = getattr(self, "prewarm", None)
        if not pw:
            return
        end = self.clock() + self.args.prewarm_grace
        pw["thread"].join(timeout=max(0.1, (end - self.clock()) * getattr(self, "scale", 1.0)))
        pw["stop"] = True                 # a thread still writing the small checkpoint starts nothing
        pw["thread"].join()
        summary = {"ckpt_s": pw.get("ckpt_s"), "skipped": pw.get("skipped")}
        for eng, (p, t0, res_path, log) in pw["procs"].items():
            try:
                rc = self.wait(p, max(0.1, end - self.clock()))
                status = "ok" if rc == 0 else f"exit {rc}"
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
                status = "stopped when the checkpoint was done"
            log.close()
            data = {}
            if os.path.exists(res_path):
                with open(res_path) as f:
                    data = json.load(f)
            took = data["finished"] - data["started"] if "finished" in data else self.clock() - t0
            summary[eng] = {"status": status, "seconds": round(took, 1),
                            "modes_done": sorted(data.get("modes", {})), "progress": data.get("progress"),
                            "error": data.get("error")}
            with open(log.name) as f, open(self.log_path, "a") as out:
                out.write(f"---- prewarm {eng} ({status}) ----\n{f.read()[-8000:]}\n")
        self.results["prewarm"] = {"shape": pw["shape"], **summary}
        self.note("prewarm done", **{e: v["status"] for e, v in summary.items() if isinstance(v, dict)})
        for d in pw.get("ckpt", {}).get("normal"), pw.get("ckpt", {}).get("tied"):
            if d:
                shutil.rmtree(d, ignore_errors=True)
        self.prewarm = None

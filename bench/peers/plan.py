"""Dry run of run.py's schedule: the same Driver (ordering, timeouts, budget, the ExLlamaV3 build in
the background, the pre-warm), but no engine runs: every task is a process that sleeps its
estimated seconds on a clock sped up by --dry-scale, so a timing plan is checked on the CPU in
seconds before it spends device time.

    python -m bench.peers.run --dry "ckpt=85,specfire=60,transformers=130,exllamav3=130,build=270" \
        --shapes 27B --budget 435 --dry-scale 0.2

Estimate keys: ckpt (the shape's checkpoint), ckpt_warm (its 2-layer copy), prewarm_specfire,
prewarm_transformers, specfire, transformers, exllamav3, build (the ExLlamaV3 extension), install.
A task whose estimate exceeds its timeout is cut as on the GPU; runners leave no result file, so
their rows say "not run".
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from bench.peers import run

DEFAULTS = {"ckpt": 85, "ckpt_warm": 8, "prewarm_specfire": 40, "prewarm_transformers": 90, "specfire": 60,
            "transformers": 130, "exllamav3": 130, "build": 270, "install": 4}


def parse(text: str) -> dict[str, float]:
    est = dict(DEFAULTS)
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, val = part.partition("=")
        if not sep or key not in DEFAULTS:
            raise SystemExit(f"--dry: {part!r} is not KEY=SECONDS with KEY one of {', '.join(DEFAULTS)}")
        est[key] = float(val)
    return est


class DryDriver(run.Driver):
    def __init__(self, args):
        self.est, self.scale, self._real0 = parse(args.dry), args.dry_scale, time.monotonic()
        args.wheels = None                     # nothing is installed; the build is a stand-in
        super().__init__(args)
        self.site = {"fla": None, "exl3": "dry"}

    def clock(self) -> float:                  # virtual seconds
        return (time.monotonic() - self._real0) / self.scale

    def sleep(self, sec: float) -> None:
        time.sleep(sec * self.scale)

    def wait(self, p: subprocess.Popen, timeout: float) -> int:
        return p.wait(timeout=timeout * self.scale)

    def disk_free(self) -> float:
        return float("inf")

    def make_ckpt(self, shape: str) -> bool:
        """As run.py's, without the bytes-per-step count (a meta model of the shape: seconds of real
        time here, which the sped-up clock would multiply)."""
        real = run.common.step_bytes_cfg
        run.common.step_bytes_cfg = lambda cfg, ctx, elem=2: 0
        try:
            return super().make_ckpt(shape)
        finally:
            run.common.step_bytes_cfg = real

    def install(self) -> None:
        self.sleep(self.est["install"])
        self.note("install (dry)")

    def popen(self, name: str, cmd: list[str], env: dict, out) -> subprocess.Popen:
        if name.startswith("ckpt_"):
            key = "ckpt_warm" if name.endswith(run.common.WARM) else "ckpt"
        elif name == "exl3_build":
            key = "build"
        elif name.startswith("prewarm_"):
            key = name
        else:                                  # <engine>_<shape>
            key = name.split("_")[0]
        sec = self.est[key] * self.scale
        side = ""
        if name.startswith("ckpt_"):           # what make_ckpt.make would have returned
            shape = name[len("ckpt_"):]
            res = {"shape": shape, "normal": f"/dry/peers_{shape}", "tied": f"/dry/peers_{shape}_tied",
                   "seconds": self.est[key], "bytes": 0}
            side = f"; import json; json.dump({res!r}, open({os.path.join(self.work, name + '.json')!r}, 'w'))"
        return subprocess.Popen([sys.executable, "-c", f"import time; time.sleep({sec}){side}"], stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)

    def start_build(self) -> None:
        if "exllamav3" in self.args.engines:
            self.exl3_env = self.env()
            super_env = run.common.device
            run.common.device = lambda: "cuda"     # the build starts only on a GPU machine
            try:
                super().start_build()
            finally:
                run.common.device = super_env

    def exl3(self, shape: str) -> None:
        st = self.build_state()
        if st == "failed":
            return super().exl3(shape)
        self.runner("exllamav3", shape, self.args.exl3_modes.split(","), self.args.exl3_timeout, self.args.tokens)


    def main(self) -> None:
        super().main()
        print("\ntimeline (virtual seconds):\n" + timeline(self.results), flush=True)


def timeline(results: dict) -> str:
    return "\n".join(f"{r['t']:7.1f} s  {r['what']}  " + json.dumps({k: v for k, v in r.items() if k not in ("t", "what")})
                     for r in results["timeline"])

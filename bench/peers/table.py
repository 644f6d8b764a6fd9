"""The Peers table from run.py's results.json: one row per engine x mode x shape, with bandwidth
as a fraction of the measured ceiling, TTFT, peak memory, the greedy output check against
transformers, and a one-line reason wherever a peer could not run a case; then the published
figures of engines that cannot be installed on the GPU machine, labelled as such.

    python -m bench.peers.table results.json
"""
from __future__ import annotations

import json
import sys

from bench.peers.common import CEILING, equal_prefix

ENGINES = ("specfire", "transformers", "exllamav3")
MODE_TEXT = {
    ("specfire", "ar"): "AR",
    ("specfire", "mtp1"): "MTP k=1, every draft accepted",
    ("specfire", "mtp3"): "MTP k=3, every draft accepted",
    ("transformers", "eager"): "generate, dynamic cache",
    ("transformers", "static_compile"): "generate, static cache + torch.compile",
    ("exllamav3", "ar"): "AR, unquantized",
    ("exllamav3", "mtp1"): "MTP k=1, every draft accepted",
    ("exllamav3", "mtp3"): "MTP k=3, every draft accepted",
}
MODES = {"specfire": ("ar", "mtp1", "mtp3"), "transformers": ("eager", "static_compile"),
         "exllamav3": ("ar", "mtp1", "mtp3")}

# Engines that cannot be installed on the GPU machine: published figures only, never measured here.
PUBLISHED = [
    {"engine": "SGLang 0.5.16 (published, not measured by us)",
     "mode": "Qwen3.6-27B (real weights) bf16, 1x H200, MTP speculative decoding on, batch 1, "
             "8192-token random prompt, 1024 out",
     "tok_s": 1000 / 5.61, "ttft": "734 ms",
     "source": "sgl-project/sglang PR #32959 (cookbook benchmarks, open): TPOT 5.61 ms at max_concurrency 1; "
               "its 1433 tok/s per GPU equals (8192 + 1024) / (0.734 s + 1023 x 5.61 ms), so one GPU"},
]
NOT_FOUND = ("vLLM: not measured (cannot be installed on the GPU machine) and no published batch-1 figure "
             "for a 27B Qwen3.5/3.6 on one H100/H200 in bf16 was found.")


def output_check(engine: str, mode: dict, ref: dict | None) -> str:
    """Greedy tokens of a run on the normal checkpoint against transformers' (eager) per prompt:
    the equal-prefix length out of the compared length."""
    if mode.get("checkpoint") != "normal":
        return "n/a (tied: all logits equal)"
    if engine == "transformers" and ref is mode:
        return "reference"
    if ref is None or "token_ids" not in ref:
        return "no reference"
    parts = []
    for a, b in zip(mode["token_ids"], ref["token_ids"]):
        n = min(len(a), len(b))
        parts.append(f"{equal_prefix(a[:n], b[:n])}/{n}")
    return ", ".join(parts)


def rows(results: dict) -> list[dict]:
    out = []
    for shape, sh in results.get("shapes", {}).items():
        nbytes = sh.get("step_bytes")
        runs = sh.get("runners", {})
        tf = runs.get("transformers", {}).get("modes", {})
        ref = tf.get("eager") if "error" not in tf.get("eager", {}) else None
        for eng in ENGINES:
            r = runs.get(eng)
            if r is None:
                continue
            ver = r.get("version") or ""
            if eng == "transformers" and r.get("fla"):
                ver += f" + fla {r['fla']}"
            why = r.get("status_line")
            for m in MODES[eng]:
                if m not in r.get("wanted", MODES[eng]):
                    continue
                md = r.get("modes", {}).get(m)
                row = {"shape": shape, "engine": eng, "version": ver, "mode": MODE_TEXT[(eng, m)]}
                if md is None or "tok_s" not in md:
                    row["reason"] = (md or {}).get("error") or why or "not run"
                    out.append(row)
                    continue
                row.update(tok_s=md["tok_s"], bw=md["tok_s"] * nbytes / CEILING if nbytes else None,
                           ttft_ms=1e3 * md["ttft_s"], peak_gb=md.get("peak_gb"),
                           check=output_check(eng, md, ref))
                if eng == "transformers" and m == "static_compile" and not md.get("compiled"):
                    row["mode"] += " (not compiled: CPU)"
                if md.get("prompts_done", 0) < md.get("prompts_total", 0):
                    row["mode"] += f" ({md['prompts_done']} of {md['prompts_total']} prompts: cut by the time limit)"
                if eng == "specfire":
                    row["mode"] += ", CUDA graphs" if md.get("graphs") else ", eager (no CUDA graphs)"
                if md.get("mean_accept_len"):
                    row["mode"] += f", tau {md['mean_accept_len']:.2f}"
                if md.get("draft_accept_rate") is not None:
                    row["mode"] += f", drafts accepted {100 * md['draft_accept_rate']:.0f}%"
                out.append(row)
        if sh.get("skipped"):
            out.append({"shape": shape, "engine": "all", "version": "", "mode": "", "reason": sh["skipped"]})
    return out


def markdown(results: dict) -> str:
    lines = ["| shape | engine | version | mode | tok/s | of 4.17 TB/s | TTFT ms | peak GB | greedy tokens = transformers' |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows(results):
        if "reason" in r:
            lines.append(f"| {r['shape']} | {r['engine']} | {r['version']} | {r['mode']} | - | - | - | - | "
                         f"not run: {r['reason']} |")
            continue
        bw = f"{100 * r['bw']:.1f}%" if r.get("bw") is not None else "-"
        pk = f"{r['peak_gb']:.1f}" if r.get("peak_gb") is not None else "-"
        lines.append(f"| {r['shape']} | {r['engine']} | {r['version']} | {r['mode']} | {r['tok_s']:.1f} | {bw} | "
                     f"{r['ttft_ms']:.0f} | {pk} | {r['check']} |")
    for p in PUBLISHED:
        lines.append(f"| 27B | {p['engine']} | | {p['mode']} | {p['tok_s']:.0f} | - | {p['ttft']} | - | "
                     f"source: {p['source']} |")
    lines += ["", NOT_FOUND]
    return "\n".join(lines)


def main() -> None:
    with open(sys.argv[1]) as f:
        print(markdown(json.load(f)))


if __name__ == "__main__":
    main()

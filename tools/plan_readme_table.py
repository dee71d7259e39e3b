#!/usr/bin/env python3
"""Prints the planner README's reach table from the real CLI (flatpeak plan --format json).

Usage: tools/plan_readme_table.py [path/to/flatpeak] > table.md
Rows: gpt-oss-120b, Qwen3-235B-A22B, GLM-4.5, DeepSeek-V3 on H100-80GB and H200, N in {8, 16, 32,
64}, S = 1M, schedules baseline, practice, flatpeak, at CP = 1 and at --cp auto.
"""
import json
import subprocess
import sys

FLATPEAK = sys.argv[1] if len(sys.argv) > 1 else "build/planner/tools/flatpeak"
MODELS = ["gpt-oss-120b", "Qwen3-235B-A22B", "GLM-4.5", "DeepSeek-V3"]
GPUS = ["H100-80GB", "H200"]
COUNTS = [8, 16, 32, 64]
SCHEDULES = ["baseline", "practice", "flatpeak"]
PEAKS = ["dispatch", "vocab", "checkpoint", "optimizer", "layer"]


def gib(b):
    return f"{b / 2**30:.1f}"


def plan(model, gpu, n, schedule, cp):
    cmd = [FLATPEAK, "plan", "--model", model, "--gpu", gpu, "--gpus", str(n), "--context", "1M",
           "--schedule", schedule, "--cp", cp, "--format", "json"]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode not in (0, 3):
        raise SystemExit(f"{' '.join(cmd)}: exit {out.returncode}: {out.stderr}")
    return json.loads(out.stdout)


print("| model | GPU | N | schedule | CP | " + " | ".join(f"{p} GiB" for p in PEAKS) +
      " | binding | GPU required GiB | host/node GiB | fits |")
print("|---|---|---:|---|---:|" + "---:|" * len(PEAKS) + "---|---:|---:|---|")
for model in MODELS:
    for gpu in GPUS:
        for n in COUNTS:
            for schedule in SCHEDULES:
                for cp in ["1", "auto"]:
                    p = plan(model, gpu, n, schedule, cp)
                    peaks = " | ".join(gib(p["peaks"][k]["bytes"]) for k in PEAKS)
                    fits = "yes" if p["gpu"]["fits"] and p["host"]["fits"] else \
                        ("no (GPU)" if not p["gpu"]["fits"] else "no (host)")
                    cp_text = str(p["inputs"]["run"]["cp"]) + (" (auto)" if cp == "auto" else "")
                    print(f"| {model} | {gpu} | {n} | {schedule} | {cp_text} | {peaks} | {p['gpu']['binding']} | "
                          f"{gib(p['gpu']['required_bytes'])} | {gib(p['host']['peak_bytes'])} | {fits} |")

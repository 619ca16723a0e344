#!/usr/bin/env python3
"""Before/after medians of kvserve's criterion benches, from one interleaved run.

    python3 scripts/bench_compare.py BASE_REV [--rounds N] [--filter REGEX] [--bench CRATE:BENCH ...]

Builds the chosen criterion benches (release, `cargo bench --no-run`) twice: at BASE_REV, checked
out in a temporary git worktree with its own target dir, and in this working tree. Then it runs
the two builds' binaries alternately (base, new, base, new, ...) for N rounds, so both sides see
the same machine load, and prints each benchmark's median over rounds (each round's value is
criterion's median estimate) and the ratio new / base. These machines are shared and noisy: only
ratios from one run mean anything.

Defaults: the allocator, radix, scheduler-step and decode-attention benches, 3 rounds.
"""

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile

DEFAULT_BENCHES = [
    "kv-pool:allocators",
    "radix-cache:radix",
    "scheduler:schedule_step",
    "attention:decode_attention",
]


def build(tree, target, benches):
    """Builds the benches in `tree`; returns {crate:bench: executable}."""
    exes = {}
    for spec in benches:
        crate, bench = spec.split(":")
        out = subprocess.run(
            ["cargo", "bench", "--no-run", "--message-format=json", "-p", crate, "--bench", bench],
            cwd=tree,
            env=dict(os.environ, CARGO_TARGET_DIR=target),
            check=True,
            stdout=subprocess.PIPE,
        ).stdout
        for line in out.decode().splitlines():
            try:
                msg = json.loads(line)
            except json.JSONDecodeError:
                continue
            if msg.get("reason") == "compiler-artifact" and msg.get("executable") \
                    and msg["target"]["name"] == bench and "bench" in msg["target"]["kind"]:
                exes[spec] = msg["executable"]
        if spec not in exes:
            sys.exit(f"bench_compare: no executable for {spec} in {tree}")
    return exes


def run(exe, home, flt, measure):
    args = [exe, "--bench", "--warm-up-time", "1", "--measurement-time", str(measure)]
    if flt:
        args.append(flt)
    subprocess.run(args, env=dict(os.environ, CRITERION_HOME=home), check=True,
                   stdout=subprocess.DEVNULL)
    medians = {}
    for root, _dirs, files in os.walk(home):
        if root.endswith(os.sep + "new") and "estimates.json" in files and \
                "benchmark.json" in files:
            with open(os.path.join(root, "benchmark.json")) as f:
                name = json.load(f)["full_id"]
            with open(os.path.join(root, "estimates.json")) as f:
                medians[name] = json.load(f)["median"]["point_estimate"]
    return medians


def fmt_ns(ns):
    for unit, scale in (("s", 1e9), ("ms", 1e6), ("µs", 1e3)):
        if ns >= scale:
            return f"{ns / scale:.3g} {unit}"
    return f"{ns:.3g} ns"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("base")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--filter", default=None, help="criterion filter (a regex on bench ids)")
    ap.add_argument("--bench", action="append", help="CRATE:BENCH (repeatable)")
    ap.add_argument("--measurement-time", type=float, default=2.0)
    a = ap.parse_args()
    benches = a.bench or DEFAULT_BENCHES
    tree = subprocess.run(["git", "rev-parse", "--show-toplevel"], check=True,
                          stdout=subprocess.PIPE).stdout.decode().strip()
    work = tempfile.mkdtemp(prefix="bench-compare-")
    base_tree = os.path.join(work, "base")
    try:
        subprocess.run(["git", "worktree", "add", "--detach", base_tree, a.base], cwd=tree,
                       check=True, stdout=subprocess.DEVNULL)
        shared = os.path.join(os.path.dirname(tree), "shared")
        if os.path.isdir(shared) and not os.path.exists(os.path.join(work, "shared")):
            os.symlink(shared, os.path.join(work, "shared"))
        base_target = os.environ.get("BENCH_COMPARE_BASE_TARGET",
                                     os.path.join(work, "target"))
        new_target = os.environ.get("CARGO_TARGET_DIR", os.path.join(tree, "target"))
        sides = {
            "base": build(base_tree, base_target, benches),
            "new": build(tree, new_target, benches),
        }
        results = {"base": {}, "new": {}}
        for r in range(a.rounds):
            for spec in benches:
                for side in ("base", "new"):
                    home = os.path.join(work, "criterion", side, str(r), spec.replace(":", "-"))
                    for name, ns in run(sides[side][spec], home, a.filter,
                                        a.measurement_time).items():
                        results[side].setdefault(name, []).append(ns)
            print(f"round {r + 1}/{a.rounds} done", file=sys.stderr)
        print(f"| benchmark | {a.base} (median) | working tree (median) | new / base |")
        print("|---|---|---|---|")
        for name in sorted(set(results["base"]) | set(results["new"])):
            b, n = results["base"].get(name), results["new"].get(name)
            if not b or not n:
                print(f"| {name} | {fmt_ns(statistics.median(b)) if b else '—'} | "
                      f"{fmt_ns(statistics.median(n)) if n else '—'} | — |")
                continue
            mb, mn = statistics.median(b), statistics.median(n)
            print(f"| {name} | {fmt_ns(mb)} | {fmt_ns(mn)} | {mn / mb:.3f} |")
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", base_tree], cwd=tree,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if not os.environ.get("BENCH_COMPARE_KEEP"):
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

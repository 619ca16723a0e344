#!/usr/bin/env python3
"""kvserve's CPU backend beside llama.cpp on the same checkpoints, interleaved (issue #18).

Per round and weight dtype it runs, one after the other: `kvserve bench` with one 512-token
prompt and 128 output tokens at 2 threads and at 1 thread (prefill = 512 / TTFT, decode = 1 /
ITL p50), then `llama-bench -p 512 -n 128 -d 0,512 -r 1` at 2 and 1 threads (pp512 at depth 0;
tg128 at depth 512, i.e. decode after a 512-token prompt). After the rounds, batch-16 decode
once per dtype: `kvserve bench --num-prompts 16` (16 / ITL p50) and `llama-batched-bench -npl
16` (S_TG). Prints medians over the rounds and kvserve / llama.cpp, and writes every sample as
JSON lines to --out.

Usage (the README's "Comparing with llama.cpp" builds both and writes the checkpoints):
  python3 scripts/llama_cpp_compare.py --kvserve target/release/kvserve \
      --llama-bin LLAMA/build/bin --model f32=/tmp/ck-f32:/tmp/ck-f32.gguf \
      --model bf16=/tmp/ck-bf16:/tmp/ck-bf16.gguf --model f16=/tmp/ck-f16:/tmp/ck-f16.gguf \
      --rounds 3 --out compare.jsonl
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import tempfile


def kvserve(bin_path, model_dir, threads, prompts):
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "bench.json")
        subprocess.run(
            [bin_path, "bench", "--model-path", model_dir, "--workload", "random",
             "--num-prompts", str(prompts), "--random-input-len", "512",
             "--random-output-len", "128", "--random-range-ratio", "1",
             "--request-rate", "inf", "--threads", str(threads), "--kv-cache-dtype", "float16",
             "--quiet", "--json", out, "--plot", os.path.join(tmp, "bench.png")],
            check=True, stdout=subprocess.DEVNULL)
        with open(out) as f:
            result = json.load(f)
    return result[0]  # the bench's outcomes, one per cache mode: only `radix` here


def llama_bench(bin_dir, gguf, threads):
    out = subprocess.run(
        [os.path.join(bin_dir, "llama-bench"), "-m", gguf, "-t", str(threads), "-p", "512",
         "-n", "128", "-d", "0,512", "-r", "1", "-o", "json"],
        check=True, capture_output=True, text=True).stdout
    rows = json.loads(out)
    prefill = next(r["avg_ts"] for r in rows if r["n_prompt"] == 512 and r["n_depth"] == 0)
    decode = next(r["avg_ts"] for r in rows if r["n_gen"] == 128 and r["n_depth"] == 512)
    return prefill, decode


def llama_batched(bin_dir, gguf, threads, batch):
    out = subprocess.run(
        [os.path.join(bin_dir, "llama-batched-bench"), "-m", gguf, "-c", "16384", "-b", "2048",
         "-ub", "512", "-t", str(threads), "-npp", "512", "-ntg", "128", "-npl", str(batch)],
        check=True, capture_output=True, text=True).stdout
    # | PP | TG | B | N_KV | T_PP s | S_PP t/s | T_TG s | S_TG t/s | T s | S t/s |
    for line in out.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 8 and re.fullmatch(r"\d+", cells[2]) and int(cells[2]) == batch:
            return float(cells[7])
    raise RuntimeError(f"no B={batch} row in llama-batched-bench's output:\n{out}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kvserve", required=True)
    ap.add_argument("--llama-bin", required=True)
    ap.add_argument("--model", action="append", required=True, metavar="DTYPE=DIR:GGUF")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="compare.jsonl")
    args = ap.parse_args()
    models = []
    for spec in args.model:
        dtype, paths = spec.split("=", 1)
        model_dir, gguf = paths.split(":", 1)
        models.append((dtype, model_dir, gguf))

    samples = []  # (dtype, figure, system, value)

    def record(dtype, figure, system, value):
        samples.append((dtype, figure, system, value))
        with open(args.out, "a") as f:
            f.write(json.dumps({"dtype": dtype, "figure": figure, "system": system,
                                "tokens_per_s": value}) + "\n")
        print(f"{dtype:5s} {figure:14s} {system:9s} {value:9.1f}", flush=True)

    for _ in range(args.rounds):
        for dtype, model_dir, gguf in models:
            for threads in (2, 1):
                run = kvserve(args.kvserve, model_dir, threads, 1)
                record(dtype, f"prefill {threads}t", "kvserve", 512 / run["ttft_p50_s"])
                record(dtype, f"decode b1 {threads}t", "kvserve", 1 / run["itl_p50_s"])
                prefill, decode = llama_bench(args.llama_bin, gguf, threads)
                record(dtype, f"prefill {threads}t", "llama.cpp", prefill)
                record(dtype, f"decode b1 {threads}t", "llama.cpp", decode)
    for dtype, model_dir, gguf in models:
        run = kvserve(args.kvserve, model_dir, 2, 16)
        record(dtype, "decode b16 2t", "kvserve", 16 / run["itl_p50_s"])
        record(dtype, "decode b16 2t", "llama.cpp", llama_batched(args.llama_bin, gguf, 2, 16))

    figures = ["prefill 2t", "prefill 1t", "decode b1 2t", "decode b1 1t", "decode b16 2t"]
    dtypes = [m[0] for m in models]
    print("\nmedians, tokens/s (" + " / ".join(dtypes) + "):")
    print("| | kvserve | llama.cpp | kvserve / llama.cpp |\n|---|---|---|---|")
    for figure in figures:
        med = {(d, s): statistics.median(v for dd, f, ss, v in samples
                                         if dd == d and f == figure and ss == s)
               for d in dtypes for s in ("kvserve", "llama.cpp")}
        k = " / ".join(f"{med[(d, 'kvserve')]:,.1f}" for d in dtypes)
        ll = " / ".join(f"{med[(d, 'llama.cpp')]:,.1f}" for d in dtypes)
        r = " / ".join(f"{med[(d, 'kvserve')] / med[(d, 'llama.cpp')]:.2f}" for d in dtypes)
        print(f"| {figure} | {k} | {ll} | {r} |")
    for system in ("kvserve", "llama.cpp"):
        ratios = []
        for d in dtypes:
            two, one = (statistics.median(v for dd, f, ss, v in samples
                                          if dd == d and f == fig and ss == system)
                        for fig in ("prefill 2t", "prefill 1t"))
            ratios.append(f"{two / one:.2f}")
        print(f"{system}: prefill 2 threads / 1 thread = {' / '.join(ratios)}")


if __name__ == "__main__":
    main()

#!/usr/bin/env bash
# PD disaggregation through the router, as separate processes, on any backend:
#
#   bash scripts/pd_pair_check.sh KVSERVE BACKEND [MODEL_DIR] [BENCH_JSON]
#
# starts one plain server, a prefill and a decode server and `kvserve router
# --pd-disaggregation` in front of the pair, all with `--backend BACKEND` (and `--model-path
# MODEL_DIR`; default the tiny preset), on loopback ports from PD_PORT_BASE (default 31000).
# It checks that three prompts' greedy tokens through the router equal the plain server's
# (a wgpu, cuda or rocm pair moves its KV through a host mirror of each device store), then,
# with BENCH_JSON, runs `kvserve bench --url` through the router into that file. Every process
# it started is stopped when it exits, failed or not; a failure prints the servers' last lines.
# Servers get 60 s to come up, each request 30 s, the bench PD_BENCH_SECONDS (default 40).
# `scripts/gpu_check.sh run` runs it with --backend cuda.
set -uo pipefail
[ $# -ge 2 ] || { echo "usage: $0 KVSERVE BACKEND [MODEL_DIR] [BENCH_JSON]" >&2; exit 2; }
kvserve=$1 backend=$2 model=${3:-} json=${4:-}
base=${PD_PORT_BASE:-31000}
logs=$(mktemp -d /tmp/pd-pair.XXXX)
pids=()
cleanup() {
    kill "${pids[@]}" 2>/dev/null
    wait 2>/dev/null
    rm -rf "$logs"
}
trap cleanup EXIT
trap 'exit 1' INT TERM
fail() {
    echo "pd_pair_check: $1" >&2
    for f in "$logs"/*.log; do
        echo "--- $(basename "$f")" >&2
        tail -n 15 "$f" >&2
    done
    exit 1
}

args=(--backend "$backend" --max-total-tokens 4096)
[ -n "$model" ] && args+=(--model-path "$model")
"$kvserve" serve "${args[@]}" --port "$base" >"$logs/single.log" 2>&1 &
pids+=($!)
"$kvserve" serve "${args[@]}" --port $((base + 1)) --disaggregation-mode prefill \
    --disaggregation-bootstrap-port $((base + 9)) >"$logs/prefill.log" 2>&1 &
pids+=($!)
"$kvserve" serve "${args[@]}" --port $((base + 2)) --disaggregation-mode decode \
    >"$logs/decode.log" 2>&1 &
pids+=($!)
"$kvserve" router --pd-disaggregation --prefill "http://127.0.0.1:$((base + 1))" $((base + 9)) \
    --decode "http://127.0.0.1:$((base + 2))" --port $((base + 3)) >"$logs/router.log" 2>&1 &
pids+=($!)

python3 - "$base" "$backend" <<'EOF' || fail "greedy tokens through the PD pair"
import json, sys, time, urllib.request

base, backend = int(sys.argv[1]), sys.argv[2]

def get(port, path):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
        return r.status

def post(port, body):
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/generate", json.dumps(body).encode(),
        {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.load(r)

deadline = time.time() + 60
for port in range(base, base + 4):
    while True:
        try:
            if get(port, "/health") == 200:
                break
        except OSError:
            pass
        if time.time() > deadline:
            sys.exit(f"port {port} did not come up")
        time.sleep(0.5)

# Page-aligned and not, and longer than the default chunk of the tiny preset's pool.
prompts = [[300 + (i * 7 + s * 13) % 4000 for i in range(n)] for n, s in [(64, 1), (75, 2), (150, 3)]]
for i, ids in enumerate(prompts):
    body = {"input_ids": ids,
            "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}}
    want = post(base, body)["output_ids"]
    got = post(base + 3, body)["output_ids"]
    if got != want:
        sys.exit(f"prompt {i}: the PD pair gave {got}, one server {want}")
print(f"PD pair on {backend}: greedy tokens through the router equal one server's "
      f"({len(prompts)} prompts, 8 tokens each)")
EOF

if [ -n "$json" ]; then
    bench=("$kvserve" bench --url "http://127.0.0.1:$((base + 3))" --workload random
        --num-prompts 16 --random-input-len 512 --random-output-len 64 --random-range-ratio 1
        --request-rate inf --quiet --json "$json")
    [ -n "$model" ] && bench+=(--model-path "$model")
    timeout "${PD_BENCH_SECONDS:-40}" "${bench[@]}" || fail "kvserve bench through the router"
fi

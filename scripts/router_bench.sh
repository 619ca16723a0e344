#!/usr/bin/env bash
# The router's loopback benchmark (issue #16): three `kvserve serve` instances with small KV
# pools (--max-total-tokens) behind `kvserve router`, the generated-shared-prefix workload with
# more groups than one instance can cache, `kvserve bench --url <router>` once per policy
# (every instance's cache flushed in between), then the same workload on one instance with
# three times the pool (the single-big-instance ideal). Prints one line per run, then the
# simulator's figures for the same workload and cluster (`kvserve sim --dp 3`, the router's
# policy code over simulated instances), to compare hit rates with the loopback run.
#
#   scripts/router_bench.sh [path/to/kvserve] [extra bench flags…]
#
# Environment: TOKENS (per-instance pool, default 3072), NUM_GROUPS (12), PER_GROUP (6),
# SYSTEM (512), QUESTION (32), OUTPUT (8), RATE (requests/s, default 4), POLICIES.
set -euo pipefail
K=${1:-target/release/kvserve}
shift || true
TOKENS=${TOKENS:-3072}
GROUPS_N=${NUM_GROUPS:-12}
PER_GROUP=${PER_GROUP:-6}
SYSTEM=${SYSTEM:-512}
QUESTION=${QUESTION:-32}
OUTPUT=${OUTPUT:-8}
RATE=${RATE:-4}
POLICIES=${POLICIES:-"round_robin random power_of_two cache_aware kv_events"}
DIR=$(mktemp -d)
PIDS=()
cleanup() {
    for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
    wait 2>/dev/null || true
    rm -rf "$DIR"
}
trap cleanup EXIT

# Starts `kvserve ARGS…` in the background, logging to $DIR/$1.log; sets PORT to its port.
start() {
    local name=$1
    shift
    "$K" "$@" 2>"$DIR/$name.log" >/dev/null &
    PIDS+=($!)
    for _ in $(seq 600); do
        PORT=$(grep -o 'http://127.0.0.1:[0-9]*' "$DIR/$name.log" | head -1 | cut -d: -f3 || true)
        [ -n "$PORT" ] && return 0
        sleep 0.1
    done
    echo "$name did not start:" >&2
    cat "$DIR/$name.log" >&2
    exit 1
}

bench() {
    local port=$1
    shift
    "$K" bench --url "http://127.0.0.1:$port" --workload gsp --gsp-num-groups "$GROUPS_N" \
        --gsp-prompts-per-group "$PER_GROUP" --gsp-system-prompt-len "$SYSTEM" \
        --gsp-question-len "$QUESTION" --gsp-output-len "$OUTPUT" --request-rate "$RATE" \
        --quiet --json "$DIR/bench.json" --plot "$DIR/bench.png" "$@" | grep -E '^\[remote\] TTFT' | tail -1
}

WORKERS=()
EVENTS=()
for i in 0 1 2; do
    ev=$((5600 + RANDOM % 2000 + i))
    start "worker$i" serve --port 0 --threads 1 --max-total-tokens "$TOKENS" \
        --kv-events-config "{\"publisher\": \"zmq\", \"endpoint\": \"tcp://127.0.0.1:$ev\", \"topic\": \"kv\"}"
    WORKERS+=("http://127.0.0.1:$PORT")
    EVENTS+=("tcp://127.0.0.1:$ev")
done
echo "instances: ${WORKERS[*]} (--max-total-tokens $TOKENS each); workload: gsp $GROUPS_N groups x $PER_GROUP, system $SYSTEM, question $QUESTION, output $OUTPUT tokens, $RATE req/s"

for policy in $POLICIES; do
    for w in "${WORKERS[@]}"; do curl -sf -X POST "$w/flush_cache" >/dev/null; done
    extra=()
    if [ "$policy" = kv_events ]; then
        extra=(--worker-kv-events "${EVENTS[@]}" --kv-events-topic kv)
    fi
    start "router-$policy" router --worker-urls "${WORKERS[@]}" --policy "$policy" --port 0 "${extra[@]}"
    router_pid=${PIDS[-1]}
    sleep 0.5 # the kv_events subscriptions reach the workers
    printf '%-13s %s\n' "$policy" "$(bench "$PORT" "$@")"
    kill "$router_pid"
done

start big serve --port 0 --threads 1 --max-total-tokens $((3 * TOKENS))
printf '%-13s %s\n' "one instance ×3 pool" "$(bench "$PORT" "$@")"

echo "simulated (kvserve sim --dp 3, the same workload, pools and page size; TTFT from the cost model):"
"$K" sim --workload gsp --gsp-num-groups "$GROUPS_N" --gsp-prompts-per-group "$PER_GROUP" \
    --gsp-system-prompt-len "$SYSTEM" --gsp-question-len "$QUESTION" --gsp-output-len "$OUTPUT" \
    --request-rate "$RATE" --page-size 16 --max-total-tokens "$TOKENS" --dp 3 \
    --router-policy "$(echo $POLICIES | tr ' ' ',')" --quiet --no-timings | tail -n +3

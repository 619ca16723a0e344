#!/usr/bin/env bash
# Issue #14's checks on a real NVIDIA GPU, as one prepared run for the `device` machine (whose
# image has the CUDA driver, NVRTC and cuBLAS but no Rust toolchain), in two halves:
#
#   bash scripts/gpu_check.sh prepare   # here: build the binaries into .gpu/ (ignored by git)
#   bash scripts/gpu_check.sh run       # there, with .gpu carried: every check, logs to $OUT
#   bash scripts/gpu_check.sh profile   # there: the bandwidth table per set of tuning defines,
#                                       # then Nsight Compute on decode attention
#
# `run` does, each step under its own time limit and going on after a failure:
#   1. nvidia-smi, and where libcuda, NVRTC and cuBLAS are found;
#   2. attention-cuda's tests/gpu.rs with KVSERVE_REQUIRE_CUDA=1: the dense and attention
#      conformance suites against the f64 reference, and the tiny Llama and MLA decoders' greedy
#      schedule against the CPU backend (model::greedy_check);
#   3. examples/decode_bandwidth.rs: decode attention's KV GB/s per kernel (chunked,
#      pipelined, and pipelined with the split merge in the kernel: `+merge`), KV dtype, page
#      size and context length, against the GPU's peak (H100
#      3350 GB/s, H200 4800 GB/s, by its name); then its MLA table (DeepSeek-V3's latent rows,
#      16 and 128 heads; the pipelined kernel's tensor-core MLA form as `+mma`), and its
#      prefill table (the pipelined kernel against paged_prefill, TFLOP/s); then
#      examples/gemm_throughput.rs: TFLOP/s and weight GB/s per batch size of Llama-3-8B's
#      matmuls (cuBLAS, the own kernel, its tensor-core form), of DeepSeek-V2-Lite's MLA query
#      and output paths (folded at load against the projection plus `bmm`), and of Qwen3-30B-A3B's and
#      DeepSeek-V2-Lite's MoE layers (lanes' and tensor-core forms);
#   4. a SmolLM2-135M-shaped Hugging Face checkpoint (random bf16 weights, written by the
#      model crate's random_checkpoint example) served end to end by `kvserve bench --backend
#      cuda` (batch 1, its pool sized by --mem-fraction-static from the GPU's memory, and
#      batch 16), once more with --disable-cuda-graph, once on the tensor-core forms
#      (--cuda-{gemm,moe,prefill}-tensor-cores), a shared-prefix workload with HiCache on a
#      small device pool, and a DeepSeek-V2-Lite-shaped MLA checkpoint (its first two layers:
#      absorbed MLA with `bmm`, a dense and a 64-expert MoE layer; random bf16 weights) at
#      batch 16;
#   5. PD disaggregation on the GPU (scripts/pd_pair_check.sh): a prefill and a decode server
#      behind `kvserve router`, their KV moved through host mirrors of the device stores,
#      greedy tokens against one server, then `kvserve bench --url` through the router;
#   6. the attention conformance suite (both kernels; the tensor-core MLA form), the
#      tensor-core MoE check and the prefill kernel's cases under compute-sanitizer's memcheck (out-of-bounds and
#      misaligned accesses) and racecheck (shared-memory hazards: what emulation, which runs
#      a block's threads in lockstep between barriers, cannot see), where the image has it.
# Everything goes to $OUT/check.log, the benches' JSON beside it, a line per step to
# $OUT/summary.txt as each step ends (eight files: the device returns at most eight); `run`
# exits non-zero when any step failed. The steps' limits add up to 600 s (each ends early;
# the whole run took about 90 s on an H100 before the PD step was added).
set -uo pipefail
cd "$(dirname "$0")/.."
GPU_DIR=.gpu

# NVRTC's PTX on disk (attention-cuda's compile_cache), shared by every test's device, bench
# and profile run of one invocation: each kernel specialisation is compiled once, not once per
# process. A fresh private directory (mktemp), so no other user's files are loaded.
kernel_cache() {
    [ -n "${KVSERVE_KERNEL_CACHE:-}" ] || KVSERVE_KERNEL_CACHE=$(mktemp -d /tmp/kvserve-kernels.XXXXXX)
    export KVSERVE_KERNEL_CACHE
}

prepare() {
    set -e
    cargo build --release --locked -p attention-cuda --features cuda-13 --example decode_bandwidth \
        --example gemm_throughput
    cargo build --release --locked -p engine --features cuda-13 --bin kvserve
    cargo build --release --locked -p model --example random_checkpoint
    local test_bin
    test_bin=$(cargo test --release --locked -p attention-cuda --features cuda-13 --test gpu \
        --no-run --message-format=json \
        | python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "gpu":
        print(m["executable"])')
    rm -rf "$GPU_DIR" && mkdir -p "$GPU_DIR"
    cp "$test_bin" "$GPU_DIR/gpu-tests"
    cp target/release/examples/decode_bandwidth target/release/examples/gemm_throughput \
        target/release/examples/random_checkpoint target/release/kvserve "$GPU_DIR/"
    strip "$GPU_DIR"/* 2>/dev/null || true
    du -sh "$GPU_DIR"/*
    echo "prepared $GPU_DIR: carry it (the device tool's carry: [\"$GPU_DIR\"]) and run" \
        "'bash scripts/gpu_check.sh run'"
}

# cudarc opens libcuda, libnvrtc and libcublas by name: every directory holding NVRTC or
# cuBLAS (PyPI's nvidia-* wheels, a CUDA toolkit) goes on LD_LIBRARY_PATH.
cuda_library_path() {
    local dirs
    dirs=$( (python3 -c '
import glob, os, sys
for p in sys.path:
    for d in glob.glob(os.path.join(p, "nvidia", "*", "lib")) + glob.glob(os.path.join(p, "nvidia", "*", "*", "lib")):
        print(d)' 2>/dev/null; ls -d /usr/local/cuda/lib64 /usr/local/cuda/targets/*/lib 2>/dev/null) \
        | while read -r d; do
            compgen -G "$d/libnvrtc.so*" >/dev/null || compgen -G "$d/libcublas.so*" >/dev/null \
                && echo "$d"
        done \
        | sort -u | paste -sd: -)
    export LD_LIBRARY_PATH="${dirs}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
}

# The GPU's memory bandwidth in GB/s, by its name (H100 SXM 3350, H100 PCIe 2000, H200 4800).
peak_gbps() {
    local name peak=3350
    name=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1)
    case "$name" in *H200*) peak=4800 ;; *H100*PCIe*) peak=2000 ;; esac
    echo "$peak"
}

profile() {
    local out="${OUT:-/tmp/gpu-check}" ncu defines target
    mkdir -p "$out"
    cuda_library_path
    kernel_cache
    # The bandwidth table once per set of the kernels' tuning defines (KVSERVE_CUDA_DEFINES;
    # PROFILE_DEFINES: sets separated by ';', the first the defaults) and per split target
    # (SPLIT_TARGETS: split_kv_target_blocks values separated by spaces; unset: the default);
    # PROFILE_TABLES picks decode_bandwidth's tables (`prefill` times paged_prefill's tuning
    # defines, e.g. PROFILE_DEFINES=';PF_QSPLIT=0;PF_STAGES=3').
    local sets=("")
    [ -n "${PROFILE_DEFINES-;ATTN_MIN_BLOCKS=4;V_UNROLL_MAX=4}" ] \
        && IFS=';' read -r -a sets <<<"${PROFILE_DEFINES-;ATTN_MIN_BLOCKS=4;V_UNROLL_MAX=4}"
    read -r -a targets <<<"${SPLIT_TARGETS:-default}"
    for defines in "${sets[@]}"; do
        for target in "${targets[@]}"; do
            echo "== KVSERVE_CUDA_DEFINES='$defines' split target $target" | tee -a "$out/profile.log"
            [ "$target" = default ] && target=
            KVSERVE_CUDA_DEFINES="$defines" timeout 150 "$GPU_DIR/decode_bandwidth" \
                "$(peak_gbps)" 2 "$target" both both "${PROFILE_TABLES:-both}" 2>&1 \
                | tee -a "$out/profile.log"
        done
    done
    [ "${NO_NCU:-0}" = 1 ] && return 0
    ncu=$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -n 1)
    [ -n "$ncu" ] || { echo "no ncu" | tee -a "$out/profile.log"; return 1; }
    # The defaults, one kernel at a time (NCU_KERNELS, default both), one back-to-back launch
    # of each table row in NCU_ROWS (default 7: f16, pages of 16, 32768 positions × 16
    # requests; fp8's rows are 24-35 in the same order): a row is 182 calls of the kernel
    # (one untimed, 20 alone, one untimed, 20 × 8 back to back), so row r's back-to-back
    # launches start after 182r + 22.
    for kernel in ${NCU_KERNELS:-chunked pipelined}; do
        local entry=paged_attention
        [ "$kernel" = pipelined ] && entry=paged_attention_pipelined
        for row in ${NCU_ROWS:-7}; do
            echo "== ncu $entry, row $row" >>"$out/profile.log"
            timeout 120 "$ncu" --clock-control none --kernel-name "$entry" \
                --launch-skip $((182 * row + 100)) --launch-count 1 --section SpeedOfLight \
                --section Occupancy --section LaunchStats --section WarpStateStats \
                --section SchedulerStats --section MemoryWorkloadAnalysis \
                "$GPU_DIR/decode_bandwidth" "$(peak_gbps)" 2 "" "$kernel" 2>&1 | grep -v '^|' \
                >>"$out/profile.log"
        done
    done
}

run() {
    local out="${OUT:-/tmp/gpu-check}"
    mkdir -p "$out"
    [ -x "$GPU_DIR/gpu-tests" ] || { echo "no $GPU_DIR/gpu-tests: run 'prepare' here first"; exit 2; }
    cuda_library_path
    kernel_cache
    local failed=0
    : >"$out/summary.txt"
    step() { # step NAME SECONDS COMMAND...
        local name=$1 limit=$2 t0=$SECONDS rc
        shift 2
        echo "== $name" | tee -a "$out/check.log"
        timeout "$limit" "$@" 2>&1 | tee -a "$out/check.log"
        rc=${PIPESTATUS[0]}
        [ "$rc" = 0 ] || failed=1
        echo "$name: rc $rc in $((SECONDS - t0)) s" >>"$out/summary.txt"
    }
    step env 20 bash -c 'nvidia-smi; echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH";
        for l in libcuda.so.1 libnvrtc.so.13 libcublas.so.13 libnvrtc.so.12 libcublas.so.12; do
            python3 -c "import ctypes,sys; ctypes.CDLL(sys.argv[1]); print(sys.argv[1], \"loads\")" "$l" \
                2>/dev/null || echo "$l does not load"; done'
    step gpu-tests 130 env KVSERVE_REQUIRE_CUDA=1 "$GPU_DIR/gpu-tests" --nocapture --test-threads 1
    step bandwidth 60 "$GPU_DIR/decode_bandwidth" "$(peak_gbps)" 2 "" both both mha
    step bandwidth-mla 30 "$GPU_DIR/decode_bandwidth" "$(peak_gbps)" 2 "" both both mla
    step prefill 20 "$GPU_DIR/decode_bandwidth" "$(peak_gbps)" 2 "" both both prefill
    step gemm 35 "$GPU_DIR/gemm_throughput" "$(peak_gbps)"
    local ck=/tmp/smollm2-shape-bf16
    step checkpoint 15 "$GPU_DIR/random_checkpoint" "$ck" bf16
    local bench=("$GPU_DIR/kvserve" bench --backend cuda --model-path "$ck" --workload random
        --random-input-len 512 --random-output-len 128 --random-range-ratio 1
        --request-rate inf --quiet --plot /tmp/bench.png)
    # Batch 1 sizes its pool as SGLang does on a GPU: 85 % of the device after the weights.
    step bench-b1 25 "${bench[@]}" --num-prompts 1 --mem-fraction-static 0.85 \
        --json "$out/bench-b1.json"
    step bench-b16 30 "${bench[@]}" --num-prompts 16 --json "$out/bench-b16.json"
    step bench-b16-eager 25 "${bench[@]}" --num-prompts 16 --disable-cuda-graph \
        --json "$out/bench-b16-eager.json"
    # Decode batches of 16 under graphs on the own matmul's tensor-core form and prefills on
    # paged_prefill (against bench-b16); its JSON goes into the log ($OUT holds eight files).
    step bench-b16-tc 25 bash -c '"$@" && cat /tmp/bench-b16-tc.json' _ "${bench[@]}" \
        --num-prompts 16 --cuda-gemm-tensor-cores --cuda-moe-tensor-cores \
        --cuda-prefill-tensor-cores \
        --json /tmp/bench-b16-tc.json
    # HiCache on the device store: a shared-prefix workload on a pool that holds a fraction of
    # it, so prefixes are evicted to the host tier and loaded back through CudaKvRows.
    step bench-hicache 25 "$GPU_DIR/kvserve" bench --backend cuda --model-path "$ck" \
        --workload gsp --gsp-num-groups 8 --gsp-prompts-per-group 8 --gsp-system-prompt-len 1024 \
        --gsp-question-len 64 --gsp-output-len 16 --max-total-tokens 4096 \
        --enable-hierarchical-cache --quiet --plot /tmp/bench-hicache.png \
        --json "$out/bench-hicache.json"
    # MLA end to end: DeepSeek-V2-Lite's first two layers (2.2 GB of random bf16 weights).
    local mla=/tmp/deepseek-v2-lite-2l-bf16
    step checkpoint-mla 15 "$GPU_DIR/random_checkpoint" "$mla" bf16 deepseek-v2-lite-2l
    step bench-mla 25 "$GPU_DIR/kvserve" bench --backend cuda --model-path "$mla" \
        --workload random --random-input-len 512 --random-output-len 128 \
        --random-range-ratio 1 --request-rate inf --num-prompts 16 --quiet \
        --plot /tmp/bench-mla.png --json "$out/bench-mla.json"
    step pd-pair 50 bash scripts/pd_pair_check.sh "$GPU_DIR/kvserve" cuda "$ck" \
        "$out/bench-pd.json"
    local sanitizer
    sanitizer=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -n 1)
    if [ -n "$sanitizer" ]; then
        for tool in memcheck racecheck; do
            step "sanitizer-$tool" 35 env KVSERVE_REQUIRE_CUDA=1 "$sanitizer" --tool "$tool" \
                --error-exitcode 3 "$GPU_DIR/gpu-tests" gpu_attention_conformance_quick \
                gpu_mla_tensor_cores gpu_moe_tensor_cores gpu_prefill_tensor_cores --exact \
                --nocapture
        done
    else
        echo "sanitizer: compute-sanitizer not found: skipped" >>"$out/summary.txt"
    fi
    cat "$out/summary.txt"
    return "$failed"
}

case "${1:-}" in
    prepare) prepare ;;
    run) run ;;
    profile) profile ;;
    *) echo "usage: bash scripts/gpu_check.sh prepare|run|profile" >&2; exit 2 ;;
esac

#!/usr/bin/env bash
# Re-run every published comparison at HEAD on a quiet machine, one after another, into
# bench-results/<commit>/ (one log per benchmark; each prints its own markdown table naming the
# commit), then regenerate docs/suite-results.md from the suite's result files (each suite cell run
# 3 times, the verdict the majority). The tables in docs/benchmarks.md that the benches render from
# their logs are rewritten by each bench's `--render LOG --doc docs/benchmarks.md`;
# tests/test_docs_generated.py fails when a committed table differs from its log.
#
#     bash bench/rerun_all.sh [PART ...]     # parts: suite suite-mlx mlx throughput sampled hugeoff qos logcost determinism determinism-gemma determinism-mlx monitor longctx
#
# throughput, sampled and hugeoff: bench/throughput.py over fresh server pairs (8 by default: each pair a
# fresh daemon and a fresh llama-server), greedy; sampled at temperature 0.8, seed 1; hugeoff greedy with
# malloc's huge pages off for both servers (GLIBC_TUNABLES glibc.malloc.hugetlb=0; on for both otherwise).
# Each writes bench-results/<commit>/throughput_<UTC>.jsonl and renders its block into docs/benchmarks.md.
# logcost (bench/throughput.py --log-cost 5) and monitor (bench/monitor_cost.py) write their own logs
# under bench-results/<commit>/ too and render their blocks (monitor: into docs/benchmarks.md and
# docs/monitor.md). longctx: bench/longctx.py at 2k/6k/12k-token prompts, 1 and 4 streams, over 3 fresh
# server pairs, its log under bench-results/<commit>/ and its block into docs/benchmarks.md.
#
# mlx: bench/mlx_vs_server.py over fresh server pairs (4 by default: each a fresh superfluid --runtime mlx
# and a fresh mlx_lm.server), ours as shipped on a Linux CPU (the MLX test directory run as f32 over
# OpenBLAS) vs mlx_lm.server on its f32 copy with the same OpenBLAS preloaded, every reply forced to its
# length on both sides (logit_bias on the stop ids). Writes bench-results/<commit>/mlx_vs_server_<UTC>.jsonl
# and renders its block into docs/benchmarks.md. Like suite-mlx, not in the default parts (it needs the
# mlx extra); about 50 minutes on a quiet 2-core machine.
# qos: bench/qos.py's three parts one after another (agents and shared over 3 rounds, kv 1), each its own
# bench-results/<commit>/qos_<part>_<UTC>.jsonl, each rendered into its block (`qos PART llamacpp`).
#
# determinism, determinism-gemma and determinism-mlx: bench/determinism_cost.py over fresh daemon pairs
# (6 by default: each pair a default daemon and a --deterministic one), on llama.cpp with the SmolLM2 GGUF,
# with Gemma 3 270M's (SmolLM2's 8,192-token window leaves its 12,000-token row unmeasured; Gemma's is 32k),
# and on MLX with the MLX test directory (`python -m superfluid.models --mlx`); each writes
# bench-results/<commit>/determinism_<UTC>.jsonl and renders its block (keyed by runtime and model) into
# docs/benchmarks.md. determinism-gemma and determinism-mlx are not in the default parts (as suite-mlx is not).
#
# The suite runs superfluid with --deterministic (its worker_kill and daemon_restart scenarios ask
# for text identical to an uninterrupted reference; bench/determinism_cost.py prices the mode); the
# throughput benchmarks run the default mode.
#
# Refuses to start while the machine is busy (1-minute load average above 0.5): llama.cpp's threads
# collapse under other load and both sides of every ratio would be measured on a different machine.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
commit=$(git rev-parse --short HEAD)
out=bench-results/$commit
mkdir -p "$out"
load=$(cut -d' ' -f1 /proc/loadavg)
if awk "BEGIN{exit !($load > ${SUPERFLUID_BENCH_MAX_LOAD:-0.5})}"; then
    echo "the machine is busy (load average $load): benchmarks need a quiet machine" >&2
    exit 1
fi
server=$(bash bench/build_llama_server.sh)
models=$($PY -m superfluid.models)  # read whole: `| head -1` broke its pipe, and pipefail ended the script
model=$(sed -n 1p <<< "$models")
small=$(sed -n 2p <<< "$models")  # Gemma 3 270M: the suite's unload_reload needs a second model
parts=${*:-suite throughput sampled hugeoff qos logcost determinism monitor longctx}
# the 1-minute load average lags a finished part by a minute or two: wait (at most 5 minutes) for it to
# settle before the next, so that bench/throughput.py's own quiet-machine check judges other load only
settle() {
    for _ in $(seq 60); do
        awk "BEGIN{exit !($(cut -d' ' -f1 /proc/loadavg) > ${SUPERFLUID_BENCH_MAX_LOAD:-0.5})}" || return 0
        sleep 5
    done
}
throughput() {  # bench/throughput.py over fresh server pairs, its log under $out, its block into the docs
    local log
    log=$out/throughput_$(date -u +%Y%m%dT%H%M%SZ).jsonl
    $PY bench/throughput.py --model "$model" --llama-server "$server" --out "$log" "$@"
    $PY bench/throughput.py --render "$log" --doc docs/benchmarks.md
}
mlx() {  # bench/mlx_vs_server.py over fresh server pairs, its log under $out, its block into the docs
    local log
    log=$out/mlx_vs_server_$(date -u +%Y%m%dT%H%M%SZ).jsonl
    $PY bench/mlx_vs_server.py --model "$($PY -m superfluid.models --mlx | tail -1)" --out "$log" "$@"
    $PY bench/mlx_vs_server.py --render "$log" --doc docs/benchmarks.md
}
qos() {  # bench/qos.py, one log per part under $out, each part's block into the docs
    local log p
    for p in agents shared kv; do
        settle
        log=$out/qos_${p}_$(date -u +%Y%m%dT%H%M%SZ).jsonl
        $PY bench/qos.py --model "$model" --llama-server "$server" --parts "$p" --out "$log"
        $PY bench/qos.py --render "$log" --doc docs/benchmarks.md
    done
}
determinism() {  # bench/determinism_cost.py over fresh daemon pairs, its log under $out, its block into the docs
    local log
    log=$out/determinism_$(date -u +%Y%m%dT%H%M%SZ).jsonl
    $PY bench/determinism_cost.py --out "$log" "$@"
    $PY bench/determinism_cost.py --render "$log" --doc docs/benchmarks.md
}
for part in $parts; do
    settle
    echo "== $part ($(date -u +%H:%M:%S))"
    case $part in
        suite)
            box=$out/box.json
            printf '{"box": "%s", "llama_server": "%s", "llama_lib": "%s", "llama_args": ["-t", "2"], "superfluid_args": ["--deterministic"], "models": {"gguf": "%s", "small_gguf": "%s"}}\n' \
                "$(hostname)" "$server" "$(dirname "$server")" "$model" "$small" > "$box"
            # exits 1 when any cell fails (a peer's fail is a result, not an error of this script)
            $PY -m superfluid.suite run --systems superfluid-llamacpp,llama-server --scale small --repeat 3 \
                --box "$box" --out "$out/suite" 2>&1 | tee "$out/suite.log" || true
            # notes: the setup in words, bench-results/<commit>/suite-notes.md where someone wrote it
            notes=(); [ -f "$out/suite-notes.md" ] && notes=(--notes "$out/suite-notes.md")
            $PY -m superfluid.suite compare "$out/suite" "${notes[@]}" > docs/suite-results.md ;;
        suite-mlx)
            # the MLX pair: ours on the MLX test directory (4-bit, run as f32 over OpenBLAS on a Linux
            # CPU) vs mlx_lm.server on its f32 copy with the same OpenBLAS; Gemma as ours' companion
            mlx=$($PY -m superfluid.models --mlx | tail -1)
            f32=$HOME/.cache/superfluid/mlx-f32/$(basename "$mlx")
            [ -f "$f32/config.json" ] || $PY -m mlx_lm convert --hf-path "$mlx" --mlx-path "$f32" -d --dtype float32
            blas=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0
            box=$out/box-mlx.json
            printf '{"box": "%s", "superfluid_args": ["--deterministic"], "models": {"mlx": "%s", "small_gguf": "%s", "mlx_server_model": "%s"}, "mlx_server_env": {"LD_PRELOAD": "%s"}}\n' \
                "$(hostname)" "$mlx" "$small" "$f32" "$blas" > "$box"
            $PY -m superfluid.suite run --systems superfluid-mlx,mlx-lm-server --scale small --repeat 3 \
                --box "$box" --out "$out/suite-mlx" 2>&1 | tee "$out/suite-mlx.log" || true
            notes=(); [ -f "$out/suite-mlx-notes.md" ] && notes=(--notes "$out/suite-mlx-notes.md")
            $PY -m superfluid.suite compare "$out/suite-mlx" "${notes[@]}" > docs/suite-results-mlx.md ;;
        mlx) mlx 2>&1 | tee "$out/mlx-vs-server.log" ;;
        throughput) throughput 2>&1 | tee "$out/throughput.log" ;;
        sampled) throughput --temperature 0.8 --seed 1 2>&1 | tee "$out/throughput-sampled.log" ;;
        hugeoff) throughput --huge-pages off 2>&1 | tee "$out/throughput-hugeoff.log" ;;
        qos) qos 2>&1 | tee "$out/qos.log" ;;
        logcost)  # its own log and block (KEY: log-cost and the model)
            log=$out/throughput_log_cost_$(date -u +%Y%m%dT%H%M%SZ).jsonl
            $PY bench/throughput.py --model "$model" --log-cost 5 --out "$log" 2>&1 | tee "$out/log-cost.log"
            $PY bench/throughput.py --render "$log" --doc docs/benchmarks.md ;;
        determinism) determinism --model "$model" 2>&1 | tee "$out/determinism.log" ;;
        determinism-gemma) determinism --model "$small" 2>&1 | tee "$out/determinism-gemma.log" ;;
        determinism-mlx)
            mlx=$($PY -m superfluid.models --mlx | tail -1)
            determinism --runtime mlx --model "$mlx" 2>&1 | tee "$out/determinism-mlx.log" ;;
        monitor)  # one log, its block in both pages that show the monitor's cost
            log=$out/monitor_cost_$(date -u +%Y%m%dT%H%M%SZ).jsonl
            $PY bench/monitor_cost.py --model "$model" --out "$log" 2>&1 | tee "$out/monitor-cost.log"
            $PY bench/monitor_cost.py --render "$log" --doc docs/benchmarks.md
            $PY bench/monitor_cost.py --render "$log" --doc docs/monitor.md ;;
        longctx)
            log=$out/longctx_$(date -u +%Y%m%dT%H%M%SZ).jsonl
            $PY bench/longctx.py --model "$model" --llama-server "$server" --rounds 3 --out "$log" 2>&1 \
                | tee "$out/longctx.log"
            $PY bench/longctx.py --render "$log" --doc docs/benchmarks.md ;;
        *) echo "unknown part: $part" >&2; exit 2 ;;
    esac
done
echo "results in $out"

#!/bin/bash
# llama-bench binary, one process per run, its context changed by cshim.so: variants alternated in random order.
B=~/.cache/superfluid/llama-server-0.3.36/build/bin; M=~/.superfluid/models/gemma-3-270m-q4_k_m.gguf
for r in $(seq 1 ${ROUNDS:-5}); do
  for v in $(shuf -e ${VARIANTS:-base ours notp}); do
    case $v in
      base) env="";;
      ours) env="SHIM_NSEQ=4 SHIM_KVU=1 SHIM_NCTX=13312";;
      notp) env="SHIM_NOTP=1";;
      seq4) env="SHIM_NSEQ=4 SHIM_KVU=1";;
      ours_notp) env="SHIM_NSEQ=4 SHIM_KVU=1 SHIM_NCTX=13312 SHIM_NOTP=1";;
    esac
    out=$(env $env LD_PRELOAD=/tmp/x/cshim.so $B/llama-bench -m $M -p 12000 -n 0 -fa 1 -t 2 -r 1 --no-warmup 2>&1 | grep pp12000)
    echo "$r $v $(echo $out | awk -F'|' '{print $(NF-1)}')"
  done
done

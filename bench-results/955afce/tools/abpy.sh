#!/bin/bash
B=~/.cache/superfluid/llama-server-0.3.36/build/bin; M=~/.superfluid/models/gemma-3-270m-q4_k_m.gguf
PY=/work/main/.venv/bin/python
for r in 1 2 3 4; do
  for v in $(shuf -e bin py pyimp); do
    case $v in
      bin) out=$($B/llama-bench -m $M -p 12000 -n 0 -fa 1 -t 2 -r 1 2>&1 | grep pp12000);;
      py) out=$(R=1 $PY /tmp/x/pybench.py 2>&1 | grep pp12000);;
      pyimp) out=$(R=1 IMPORTS=numpy,llama_cpp,superfluid.worker._llamacpp PYTHONPATH=/work/main $PY /tmp/x/pybench.py 2>&1 | grep pp12000);;
    esac
    echo "$r $v $(echo $out | awk -F'|' '{print $(NF-1)}')"
  done
done

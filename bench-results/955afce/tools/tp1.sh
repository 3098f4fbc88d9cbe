#!/bin/bash
for r in 1 2 3 4 5 6; do
  for v in $(shuf -e 0 1); do
    out=$(TP=$v SEED=$((2000+r)) /work/main/.venv/bin/python /tmp/x/tp1.py 2>&1 | grep RATE)
    echo "$r tp=$v $out"
  done
done

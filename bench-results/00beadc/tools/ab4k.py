"""A/B at 4,096 prompt tokens (Gemma 3 270M, depth 0): our LlamaEngine (fresh process) against
llama-bench (fresh process, --no-warmup), alternated in a seeded random order. Prints per-round tok/s."""
import os, random, re, subprocess, sys
M = os.path.expanduser("~/.superfluid/models/gemma-3-270m-q4_k_m.gguf")
BIN = os.path.expanduser("~/.cache/superfluid/llama-server-0.3.36/build/bin")
N = int(sys.argv[1]) if len(sys.argv) > 1 else 10
VARIANTS = sys.argv[2].split(",") if len(sys.argv) > 2 else ["eng", "bench"]
ENG = r'''
import random, sys, time, os
sys.path.insert(0, "/work/main")
from superfluid.worker._engine import BatchRow
from superfluid.worker._llamacpp import LlamaEngine
import superfluid.worker._llamacpp as LC
kw = dict(max_batch=int(os.environ.get("MB", "1")), max_context=13312, threads=2)
e = LlamaEngine(os.environ["M"], **kw)
rng = random.Random(1)
toks = [rng.randrange(100, 200000) for _ in range(4096)]
step = int(os.environ.get("STEP", "512"))
t0 = time.perf_counter()
for pos in range(0, len(toks), step):
    e.decode([BatchRow(seq=0, tokens=tuple(toks[pos:pos+step]), pos0=pos, want_logits=pos+step >= len(toks))])
print("TPS", len(toks) / (time.perf_counter() - t0))
'''
def run(v):
    env = dict(os.environ, M=M)
    if v.startswith("eng"):
        if v == "eng2048": env["STEP"] = "2048"
        out = subprocess.run([sys.executable, "-c", ENG], env=env, capture_output=True, text=True).stdout
        return float(re.search(r"TPS ([\d.]+)", out).group(1))
    args = [f"{BIN}/llama-bench", "-m", M, "-p", "4096", "-n", "0", "-fa", "1", "-t", "2", "-r", "1", "--no-warmup"]
    out = subprocess.run(args, capture_output=True, text=True).stdout
    return float(re.search(r"pp4096 \|\s+([\d.]+)", out).group(1))
rng = random.Random(7)
res = {v: [] for v in VARIANTS}
for r in range(N):
    order = VARIANTS[:]; rng.shuffle(order)
    row = {v: run(v) for v in order}
    for v in VARIANTS: res[v].append(row[v])
    print(r + 1, " ".join(f"{v} {row[v]:.1f}" for v in order), " ratio", f"{row[VARIANTS[0]] / row[VARIANTS[1]]:.3f}", flush=True)
import statistics as st
rat = [a / b for a, b in zip(res[VARIANTS[0]], res[VARIANTS[1]])]
print("median ratio", f"{st.median(rat):.3f}", "min", f"{min(rat):.3f}", "max", f"{max(rat):.3f}",
      " medians", {v: round(st.median(x), 1) for v, x in res.items()})

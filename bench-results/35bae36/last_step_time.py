"""Warm last step of a 5,204-token conversation, timed alone: the old grid's 20-row last cell vs
this commit's 84-row last step (and the pre-grid 1 row), same KV, same engine, alternating."""
import sys, time
sys.path.insert(0, "/work/main"); sys.path.insert(0, "/work/main/bench")
from superfluid.worker._engine import BatchRow
from superfluid.worker._llamacpp import LlamaEngine
from grid_cost import conversation
threads = int(sys.argv[1])
eng = LlamaEngine("/root/.superfluid/models/SmolLM2-135M-Instruct.Q4_1.gguf", max_batch=1, max_context=8192, threads=threads)
conv = conversation(eng, 5200)
n = len(conv)
t = time.perf_counter()
for p in range(0, n - 84, 2048):
    q = min(p + 2048, n - 84)
    eng.decode([BatchRow(seq=0, tokens=tuple(conv[p:q]), pos0=p, want_logits=False)])
print(f"conv {n} tokens, threads {threads}, prefill to {n - 84}: {time.perf_counter() - t:.1f} s", flush=True)
times = {1: [], 20: [], 84: []}
for rep in range(3):
    for rows in (84, 20, 1):
        # the KV holds conv[:n-84]; bring it to n-rows (not timed), then time the last step
        if rows < 84:
            eng.decode([BatchRow(seq=0, tokens=tuple(conv[n - 84:n - rows]), pos0=n - 84, want_logits=False)])
        t = time.perf_counter()
        eng.decode([BatchRow(seq=0, tokens=tuple(conv[n - rows:]), pos0=n - rows, want_logits=True)])
        times[rows].append(time.perf_counter() - t)
        eng.seq_rm(0, n - 84, -1)
for rows, ts in times.items():
    print(f"last step of {rows} rows over a {n}-token KV: best {min(ts):.3f} s, all " + ", ".join(f"{x:.3f}" for x in ts))

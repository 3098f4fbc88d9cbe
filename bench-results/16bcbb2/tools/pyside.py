# lockstep Python side: our worker's LlamaEngine, same protocol as cside.c
import sys, time, array
sys.path.insert(0, "/work/main")
from superfluid.worker._engine import BatchRow
import superfluid.worker._llamacpp as LC
path, max_ctx, step = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
e = LC.LlamaEngine(path, max_batch=1, max_context=max_ctx, threads=2)
ex = e.info.extra
print("ready", ex["n_ctx"], e.info.n_seq, int(ex["kv_unified"]), int(not ex["kv_unified"]), flush=True)
toks = []
for line in sys.stdin:
    if line.startswith("load "):
        a = array.array("i"); a.frombytes(open(line[5:].strip(), "rb").read()); toks = a.tolist()
        e.seq_rm(0, 0, -1); print("ok", len(toks), flush=True); continue
    i = int(line); p0 = i * step; chunk = toks[p0:p0 + step]
    t0 = time.perf_counter()
    e.decode([BatchRow(seq=0, tokens=tuple(chunk), pos0=p0, want_logits=p0 + len(chunk) >= len(toks))])
    print(0, f"{time.perf_counter() - t0:.6f}", flush=True)

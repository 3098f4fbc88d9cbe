# Does a new sequence's first chunk landing at the top of the shared pool (beside the cached previous
# sequence, evicted only at the next chunk, as the worker's lazy _make_room does) slow its prefill?
import random, sys, time, os
from pathlib import Path
sys.path.insert(0, os.environ.get("SRC", "/work/main"))
from superfluid.worker._engine import BatchRow
import superfluid.worker._llamacpp as LC
from superfluid.suite._corpus import document
m = str(Path.home() / ".superfluid/models/gemma-3-270m-q4_k_m.gguf")
N = int(os.environ.get("N", "12000"))
e = LC.LlamaEngine(m, max_batch=1, max_context=13312, threads=2)
docs = [e.tokenize(document(N * 2, 700 + i), add_special=True, parse_special=False)[:N] for i in range(40)]
prev = None
def run(seq, toks, top):
    global prev
    t = 0.0; pos = 0
    while pos < N:
        if pos == (512 if top else 0) and prev is not None:
            e.seq_rm(prev, 0, -1)
        take = toks[pos:pos + 512]
        t0 = time.perf_counter()
        e.decode([BatchRow(seq=seq, tokens=tuple(take), pos0=pos, want_logits=pos + len(take) >= N)])
        t += time.perf_counter() - t0; pos += len(take)
    prev = seq
    return N / t
seq = 0
run(seq, docs[0], False); seq += 1
for i in range(int(os.environ.get("R", "8"))):
    r = {}
    for v in random.sample(["fresh", "top"], 2):
        r[v] = run(seq % 4, docs[1 + 2 * i + (v == "top")], v == "top"); seq += 1
    print(i, {k: f"{v:.0f}" for k, v in r.items()}, f"top/fresh {r['top'] / r['fresh']:.3f}", flush=True)

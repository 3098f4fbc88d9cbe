import random, sys, time, os
from pathlib import Path
sys.path.insert(0, "/work/main")
from superfluid.worker._engine import BatchRow
import superfluid.worker._llamacpp as LC
from superfluid.suite._corpus import document
m = str(Path.home() / ".superfluid/models/gemma-3-270m-q4_k_m.gguf")
N = int(os.environ.get("N", "12000"))
_cp = LC._context_params
engs = {}
for name in ("ours", "out1"):
    def p(**kw):
        cp = _cp(**kw)
        if name == "out1":
            cp.n_outputs_max = cp.n_seq_max
        return cp
    LC._context_params = p
    engs[name] = LC.LlamaEngine(m, max_batch=1, max_context=13312, threads=2)
e0 = engs["ours"]
docs = [e0.tokenize(document(N * 2, 900 + i), add_special=True, parse_special=False)[:N] for i in range(40)]
def run(e, toks, chunk=512):
    e.seq_rm(0, 0, -1)
    t0 = time.perf_counter(); pos = 0
    while pos < N:
        take = toks[pos:pos+chunk]
        e.decode([BatchRow(seq=0, tokens=tuple(take), pos0=pos, want_logits=pos + len(take) >= N)]); pos += len(take)
    return N / (time.perf_counter() - t0)
for e in engs.values(): run(e, docs[0])
for i in range(int(os.environ.get("R", "6"))):
    r = {}
    for k in random.sample(list(engs), 2):
        r[k] = run(engs[k], docs[1 + i])
    print(i, {k: f"{v:.0f}" for k, v in r.items()}, f"out1/ours {r['out1']/r['ours']:.3f}", flush=True)

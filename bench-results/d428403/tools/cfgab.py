import random, sys, time, os
from pathlib import Path
sys.path.insert(0, "/work/main")
from superfluid.worker._engine import BatchRow
import superfluid.worker._llamacpp as LC
from superfluid.suite._corpus import document
m = str(Path.home() / ".superfluid/models/gemma-3-270m-q4_k_m.gguf")
N = 12000
_cp = LC._context_params
engs = {}
for name in ("ours", "serverlike"):
    def p(**kw):
        if name == "serverlike":
            kw["n_seq"] = 1
        cp = _cp(**kw)
        if name == "serverlike":
            cp.n_ctx = 53248; cp.kv_unified = False
        return cp
    LC._context_params = p
    engs[name] = LC.LlamaEngine(m, max_batch=1, max_context=13312, threads=2)
e0 = engs["ours"]
docs = [e0.tokenize(document(N * 2, 900 + i), add_special=True, parse_special=False)[:N] for i in range(40)]
def run(e, toks, chunk):
    e.seq_rm(0, 0, -1)
    t0 = time.perf_counter(); pos = 0
    while pos < N:
        take = toks[pos:pos+chunk]
        e.decode([BatchRow(seq=0, tokens=tuple(take), pos0=pos, want_logits=pos + len(take) >= N)]); pos += len(take)
    return N / (time.perf_counter() - t0)
for e in engs.values(): run(e, docs[0][:3000] + docs[0][3000:], 512)
variants = {"ours": ("ours", 512), "ours-2048": ("ours", 2048), "serverlike": ("serverlike", 512), "serverlike-2048": ("serverlike", 2048)}
sel = os.environ.get("V", "ours,serverlike").split(",")
for i in range(int(os.environ.get("R", "6"))):
    r = {}
    for k in random.sample(sel, len(sel)):
        en, ch = variants[k]
        r[k] = run(engs[en], docs[1 + i], ch)
    print(i, {k: f"{v:.0f}" for k, v in r.items()}, " ".join(f"{k}/ours {r[k]/r['ours']:.3f}" for k in sel if k != "ours"), flush=True)

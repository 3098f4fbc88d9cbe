# Our engine alone (in this process, as the worker builds it) against llama-server's prompt_ms, same
# 12k-token prose prompts, alternated in random order. Both resident; one runs at a time.
import os, sys, time, random
from pathlib import Path
SRC = os.environ.get("SRC", "/work/main")
sys.path.insert(0, SRC); sys.path.insert(0, SRC + "/bench")
import httpx
from _common import llama_server_argv, Server, free_port
from superfluid.worker._engine import BatchRow
import superfluid.worker._llamacpp as LC
from superfluid.suite._corpus import document
M = str(Path.home() / ".superfluid/models/gemma-3-270m-q4_k_m.gguf")
N = int(os.environ.get("N", "12000"))
engs = {}
_cp = LC._context_params
for name, outmax in (("eng", 0), ("out64", 64)):
    def p(outmax=outmax, **kw):
        cp = _cp(**kw)
        cp.n_outputs_max = outmax
        return cp
    LC._context_params = p
    engs[name] = LC.LlamaEngine(M, max_batch=1, max_context=13312, threads=2)
e = engs["eng"]
p2 = free_port()
ls = Server("llama-server", llama_server_argv(str(Path.home() / ".cache/superfluid/llama-server-0.3.36/build/bin/llama-server"), M, p2, lanes=1, ctx=13312, threads=2), p2)
try:
    ls.wait_ready()
    httpx.post(ls.url + "/completion", json={"prompt": "hello there", "n_predict": 8}, timeout=60)
    def toks(seed):
        return e.tokenize(document(N * 2, seed), add_special=True, parse_special=False)[:N]
    def eng(t, step=int(os.environ.get("STEP", "512")), e=e):
        e.seq_rm(0, 0, -1)
        busy = 0.0; pos = 0
        while pos < len(t):
            take = t[pos:pos + step]
            t0 = time.perf_counter()
            e.decode([BatchRow(seq=0, tokens=tuple(take), pos0=pos, want_logits=pos + len(take) >= len(t))])
            busy += time.perf_counter() - t0; pos += len(take)
        return len(t) / busy
    def lsr(t):
        r = httpx.post(ls.url + "/completion", json={"prompt": t, "n_predict": 1, "cache_prompt": False}, timeout=900).json()
        assert r["tokens_evaluated"] == len(t), (r["tokens_evaluated"], len(t))
        return r["timings"]["prompt_per_second"]
    for x in engs.values(): eng(toks(1)[:2048], e=x)
    seed = 800
    for i in range(int(os.environ.get("R", "6"))):
        res = {}
        seed += 1
        t = toks(seed)
        for k in random.sample(["eng", "out64", "ls"], 3):
            res[k] = lsr(t) if k == "ls" else eng(t, e=engs[k])
        print(i, {k: f"{v:.0f}" for k, v in res.items()}, f"eng/ls {res['eng'] / res['ls']:.3f} out64/ls {res['out64'] / res['ls']:.3f} out64/eng {res['out64'] / res['eng']:.3f}", flush=True)
finally:
    ls.stop()

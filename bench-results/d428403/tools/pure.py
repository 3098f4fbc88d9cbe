import os, sys, time, random, subprocess, glob, json
import httpx, llama_cpp
sys.path.insert(0, "/tmp/bench-x/bench")
from _common import superfluid_argv, llama_server_argv, Server, free_port
from superfluid.suite._corpus import document
M = os.path.expanduser("~/.superfluid/models/gemma-3-270m-q4_k_m.gguf")
vocab = llama_cpp.Llama(M, vocab_only=True, verbose=False)
def ids(seed):
    t = vocab.tokenize(document(24000, seed).encode(), add_bos=True)[:12000]
    return vocab.detokenize(t[1:]).decode("utf-8", "ignore")
for f in glob.glob("/tmp/x/sc/decode-*.log"): os.remove(f)
p1 = free_port(); sf = Server("superfluid", superfluid_argv(M, p1, "--max-batch", "1", "--max-context", "13312", "--threads", "2"), p1, env={"PYTHONPATH": "/tmp/x/sc:/tmp/bench-x"})
p2 = free_port(); ls = Server("llama-server", llama_server_argv(os.path.expanduser("~/.cache/superfluid/llama-server-0.3.36/build/bin/llama-server"), M, p2, lanes=1, ctx=13312, threads=2), p2)
sf.wait_ready(); ls.wait_ready()
sid = httpx.get(sf.url + "/v1/models").json()["data"][0]["id"]
httpx.post(sf.url + "/v1/completions", json={"model": sid, "prompt": "hello there", "max_tokens": 8}, timeout=60)
httpx.post(ls.url + "/completion", json={"prompt": "hello there", "n_predict": 8}, timeout=60)
def logfile():
    return max(glob.glob("/tmp/x/sc/decode-*.log"), key=os.path.getsize)
def sf_run(toks):
    n0 = sum(1 for _ in open(logfile()))
    t0 = time.time()
    rr = httpx.post(sf.url + "/v1/completions", json={"model": sid, "prompt": toks, "max_tokens": 1, "temperature": 0}, timeout=600)
    if rr.status_code != 200: print(rr.status_code, rr.text[:300])
    wall = time.time() - t0
    rows = [tuple(map(float, l.split())) for l in open(logfile())][n0:]
    busy = sum(b - a for a, b, n in rows if n > 1)
    n = sum(n for a, b, n in rows if n > 1) + 1
    return n / busy, n / wall
def ls_run(toks):
    t0 = time.time()
    r = httpx.post(ls.url + "/completion", json={"prompt": toks, "n_predict": 1, "cache_prompt": False}, timeout=600).json()
    return r["timings"]["prompt_per_second"], r["tokens_evaluated"] / (time.time() - t0)
print("superfluid /v1/completions accepts token arrays?", end=" ")
seed = 700
out = []
for r in range(int(os.environ.get("R", "4"))):
    res = {}
    for k in random.sample(["sf", "ls"], 2):
        seed += 1
        res[k] = (sf_run if k == "sf" else ls_run)(ids(seed))
    out.append(res)
    print(r, {k: f"compute {v[0]:.0f} / wall {v[1]:.0f}" for k, v in res.items()}, f"compute sf/ls {res['sf'][0]/res['ls'][0]:.3f} wall {res['sf'][1]/res['ls'][1]:.3f}", flush=True)
sf.stop(); ls.stop()

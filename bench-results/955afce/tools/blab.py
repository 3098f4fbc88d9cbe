# Our engine's context: our decode of prose in 512-token rows vs llama-bench's loop (batch_get_one,
# random tokens, 2,048-token calls) on the same context, alternated.
import random, sys, time, os, ctypes
from pathlib import Path
sys.path.insert(0, "/work/main")
from superfluid.worker._engine import BatchRow
import superfluid.worker._llamacpp as LC
from superfluid.suite._corpus import document
L = LC.L
m = str(Path.home() / ".superfluid/models/gemma-3-270m-q4_k_m.gguf")
N = 12000
e = LC.LlamaEngine(m, max_batch=1, max_context=13312, threads=2)
docs = [e.tokenize(document(N * 2, 1500 + i), add_special=True, parse_special=False)[:N] for i in range(20)]
def ours(toks):
    e.seq_rm(0, 0, -1)
    t0 = time.perf_counter(); pos = 0
    while pos < N:
        take = toks[pos:pos+512]
        e.decode([BatchRow(seq=0, tokens=tuple(take), pos0=pos, want_logits=pos + len(take) >= N)]); pos += len(take)
    return N / (time.perf_counter() - t0)
rng = random.Random(5)
def bl(_toks):
    e.seq_rm(0, 0, -1)
    n_vocab = e.info.n_vocab
    arr = (ctypes.c_int32 * 2048)()
    t0 = time.perf_counter(); pos = 0
    while pos < N:
        n = min(2048, N - pos)
        for i in range(n):
            arr[i] = rng.randrange(n_vocab)
        if pos == 0: arr[0] = e.info.bos
        rc = L.llama_decode(e._ctx, L.llama_batch_get_one(arr, n)); assert rc == 0, rc
        pos += n
    return N / (time.perf_counter() - t0)
ours(docs[0]); bl(None)
for i in range(int(os.environ.get("R", "6"))):
    r = {}
    for k in random.sample(["ours", "bl"], 2):
        r[k] = (ours if k == "ours" else bl)(docs[1 + i])
    print(i, {k: f"{v:.0f}" for k, v in r.items()}, f"bl/ours {r['bl']/r['ours']:.3f}", flush=True)

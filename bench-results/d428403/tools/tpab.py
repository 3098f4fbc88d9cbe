import random, sys, time, os, ctypes
from pathlib import Path
sys.path.insert(0, "/work/main")
from superfluid.worker._engine import BatchRow
import superfluid.worker._llamacpp as LC
import llama_cpp as LL
from superfluid.suite._corpus import document
L = LC.L
class TPP(ctypes.Structure):
    _fields_ = [("cpumask", ctypes.c_bool * 512), ("n_threads", ctypes.c_int), ("prio", ctypes.c_int),
                ("poll", ctypes.c_uint32), ("strict_cpu", ctypes.c_bool), ("paused", ctypes.c_bool)]
libdir = os.environ.get("LLAMA_CPP_LIB_PATH") or str(Path(LL.__file__).parent / "lib")
cpu = ctypes.CDLL(os.path.join(libdir, "libggml-cpu.so"))
base = ctypes.CDLL(os.path.join(libdir, "libggml-base.so"))
base.ggml_threadpool_params_default.restype = TPP; base.ggml_threadpool_params_default.argtypes = [ctypes.c_int]
cpu.ggml_threadpool_new.restype = ctypes.c_void_p; cpu.ggml_threadpool_new.argtypes = [ctypes.POINTER(TPP)]
m = str(Path.home() / ".superfluid/models/gemma-3-270m-q4_k_m.gguf")
N = 12000
engs = {"plain": LC.LlamaEngine(m, max_batch=1, max_context=13312, threads=2),
        "pool": LC.LlamaEngine(m, max_batch=1, max_context=13312, threads=2)}
tpp = base.ggml_threadpool_params_default(2)
print("tpp poll", tpp.poll, "prio", tpp.prio)
pool = cpu.ggml_threadpool_new(ctypes.byref(tpp))
lib = LL.llama_cpp._lib
lib.llama_attach_threadpool.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]; lib.llama_attach_threadpool.restype = None
lib.llama_attach_threadpool(engs["pool"]._ctx, pool, None)
e0 = engs["plain"]
docs = [e0.tokenize(document(N * 2, 1300 + i), add_special=True, parse_special=False)[:N] for i in range(30)]
def run(e, toks):
    e.seq_rm(0, 0, -1)
    t0 = time.perf_counter(); pos = 0
    while pos < N:
        take = toks[pos:pos+512]
        e.decode([BatchRow(seq=0, tokens=tuple(take), pos0=pos, want_logits=pos + len(take) >= N)]); pos += len(take)
    return N / (time.perf_counter() - t0)
for e in engs.values(): run(e, docs[0][:2048] + [docs[0][0]] * 0 if False else docs[0])
for i in range(int(os.environ.get("R", "8"))):
    r = {}
    for k in random.sample(list(engs), 2):
        r[k] = run(engs[k], docs[1 + i])
    print(i, {k: f"{v:.0f}" for k, v in r.items()}, f"pool/plain {r['pool']/r['plain']:.3f}", flush=True)

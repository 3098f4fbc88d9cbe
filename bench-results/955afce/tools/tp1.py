# One engine per process: one 12k prefill, with or without an attached ggml threadpool (TP=1).
import sys, time, os, ctypes
from pathlib import Path
sys.path.insert(0, "/work/main")
from superfluid.worker._engine import BatchRow
import superfluid.worker._llamacpp as LC
import llama_cpp as LL
from superfluid.suite._corpus import document
m = str(Path.home() / ".superfluid/models/gemma-3-270m-q4_k_m.gguf")
N = 12000
e = LC.LlamaEngine(m, max_batch=1, max_context=13312, threads=2)
if os.environ.get("TP") == "1":
    class TPP(ctypes.Structure):
        _fields_ = [("cpumask", ctypes.c_bool * 512), ("n_threads", ctypes.c_int), ("prio", ctypes.c_int),
                    ("poll", ctypes.c_uint32), ("strict_cpu", ctypes.c_bool), ("paused", ctypes.c_bool)]
    libdir = str(Path(LL.__file__).parent / "lib")
    cpu = ctypes.CDLL(os.path.join(libdir, "libggml-cpu.so")); base = ctypes.CDLL(os.path.join(libdir, "libggml-base.so"))
    f = getattr(cpu, "ggml_threadpool_params_default", None) or base.ggml_threadpool_params_default
    f.restype = TPP; f.argtypes = [ctypes.c_int]
    cpu.ggml_threadpool_new.restype = ctypes.c_void_p; cpu.ggml_threadpool_new.argtypes = [ctypes.POINTER(TPP)]
    tpp = f(2); pool = cpu.ggml_threadpool_new(ctypes.byref(tpp))
    lib = LL.llama_cpp._lib
    lib.llama_attach_threadpool.argtypes = [ctypes.c_void_p] * 3; lib.llama_attach_threadpool.restype = None
    lib.llama_attach_threadpool(e._ctx, pool, None)
toks = e.tokenize(document(N * 2, int(os.environ.get("SEED", "1"))), add_special=True, parse_special=False)[:N]
def run(toks):
    e.seq_rm(0, 0, -1)
    t0 = time.perf_counter(); pos = 0
    while pos < len(toks):
        take = toks[pos:pos+512]
        e.decode([BatchRow(seq=0, tokens=tuple(take), pos0=pos, want_logits=pos + len(take) >= len(toks))]); pos += len(take)
    return len(toks) / (time.perf_counter() - t0)
run(toks[:1024])
print(f"RATE {run(toks):.1f}")

"""Counts, per flash-attention node of our LlamaEngine, the unmasked entries and 64x64 tiles of its mask
(session 16, #18). NSEQ=1 sizes the sliding-window pool as llama-server's."""
import ctypes, os, random, sys, collections
import numpy as np
from pathlib import Path
sys.path.insert(0, "/work/main")
import llama_cpp as LL
import superfluid.worker._llamacpp as LC
from superfluid.worker._engine import BatchRow
class T(ctypes.Structure): pass
T._fields_ = [("type", ctypes.c_int), ("buffer", ctypes.c_void_p), ("ne", ctypes.c_int64 * 4), ("nb", ctypes.c_size_t * 4),
              ("op", ctypes.c_int), ("op_params", ctypes.c_int32 * 16), ("flags", ctypes.c_int32), ("src", ctypes.POINTER(T) * 10),
              ("view_src", ctypes.c_void_p), ("view_offs", ctypes.c_size_t), ("data", ctypes.c_void_p), ("name", ctypes.c_char * 64),
              ("extra", ctypes.c_void_p), ("padding", ctypes.c_char * 8)]
libdir = os.environ.get("LLAMA_CPP_LIB_PATH") or str(Path(LL.__file__).parent / "lib")
base = ctypes.CDLL(os.path.join(libdir, "libggml-base.so"))
base.ggml_op_desc.restype = ctypes.c_char_p; base.ggml_op_desc.argtypes = [ctypes.POINTER(T)]
out = []
def cb(t, ask, ud):
    tt = ctypes.cast(t, ctypes.POINTER(T))
    if base.ggml_op_desc(tt) != b"FLASH_ATTN_EXT":
        return False
    if ask:
        return True
    m = tt.contents.src[3].contents
    n_kv, nq = m.ne[0], m.ne[1]
    rowb = m.nb[1]
    buf = (ctypes.c_uint16 * (rowb // 2 * nq)).from_address(m.data)
    a = np.frombuffer(buf, dtype=np.float16).reshape(nq, rowb // 2)[:, :n_kv]
    allowed = np.isfinite(a)
    tiles = 0
    for q0 in range(0, nq, 64):
        blk = allowed[q0:q0+64]
        for k0 in range(0, n_kv, 64):
            if blk[:, k0:k0+64].any(): tiles += 1
    out.append((n_kv, nq, int(allowed.sum()), tiles))
    return True
CB = LL.ggml_backend_sched_eval_callback(cb)
_cp = LC._context_params
def p(**kw):
    if os.environ.get("NSEQ"): kw["n_seq"] = int(os.environ["NSEQ"])
    cp = _cp(**kw); cp.cb_eval = CB; cp.cb_eval_user_data = None; return cp
LC._context_params = p
e = LC.LlamaEngine(os.path.expanduser("~/.superfluid/models/gemma-3-270m-q4_k_m.gguf"), max_batch=1, max_context=13312, threads=2)
rng = random.Random(1)
toks = [rng.randrange(100, e.info.n_vocab - 100) for _ in range(12000)]
pos = 0
while pos < 8704:
    out.clear()
    take = toks[pos:pos+512]
    e.decode([BatchRow(seq=0, tokens=tuple(take), pos0=pos, want_logits=False)]); pos += len(take)
    if pos in (1024, 4096, 8704):
        print(pos - 512, sorted(set(out)))

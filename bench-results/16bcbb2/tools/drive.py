# lockstep driver: chunk i on one side, then chunk i on the other (random order per chunk)
import sys, subprocess, random, array, os
sys.path.insert(0, "/work/main"); sys.path.insert(0, "/work/main/bench")
from _common import median, median_ci
import superfluid.worker._llamacpp as LC
from superfluid.suite._corpus import document
M = os.environ.get("M", "/root/.superfluid/models/gemma-3-270m-q4_k_m.gguf")
N = int(os.environ.get("N", "12000")); STEP = 512; R = int(os.environ.get("R", "6")); CTX = int(os.environ.get("CTX", "12288"))
PY = [sys.executable, "/tmp/s21/ls/pyside.py", M, str(CTX), str(STEP)]
def start(argv, env=None):
    p = subprocess.Popen(argv, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
    return p, p.stdout.readline().split()
if os.environ.get("PARGS"):
    penv = dict(os.environ, **dict(kv.split("=", 1) for kv in os.environ.get("PENV", "").split())) if os.environ.get("PENV") else None
    py, hello = start(["/tmp/s21/ls/cside", M, *os.environ["PARGS"].split(), "2", str(STEP)], env=penv)
    n_ctx, n_seq, uni, swaf = os.environ["PARGS"].split()
else:
    py, hello = start(PY)
    n_ctx, n_seq, uni, swaf = hello[1:5]
print("our params: n_ctx", n_ctx, "n_seq", n_seq, "unified", uni, "swa_full", swaf, flush=True)
cargv = ["/tmp/s21/ls/cside", M, n_ctx, n_seq, uni, swaf, "2", str(STEP)]
if os.environ.get("CARGS"): cargv[2:6] = os.environ["CARGS"].split()
cenv = dict(os.environ, **dict(kv.split("=", 1) for kv in os.environ.get("CENV", "").split())) if os.environ.get("CENV") else None
c, _ = start(cargv, env=cenv)
sides = {"py": py, "c": c}
vocab = LC.LlamaEngine.__new__(LC.LlamaEngine)
import llama_cpp
v = llama_cpp.Llama(M, vocab_only=True, verbose=False)
def ask(p, s):
    p.stdin.write(s + "\n"); return p.stdout.readline().split()
rng = random.Random(int(os.environ.get("SEED", "1")))
ratios = []
for r in range(R + 1):
    ids = v.tokenize(document(N * 2, 500 + r).encode(), add_bos=True)[:N]
    fn = f"/tmp/s21/ls/toks{r}.bin"; array.array("i", ids).tofile(open(fn, "wb"))
    for p in sides.values(): ask(p, "load " + fn)
    tot = {"py": 0.0, "c": 0.0}
    per = []
    for i in range(-(-N // STEP)):
        t = {}
        for k in rng.sample(list(sides), 2):
            rc, dt = ask(sides[k], str(i)); assert rc == "0", rc; t[k] = float(dt); tot[k] += t[k]
        per.append(t["py"] / t["c"])
    if r == 0:
        for k, p in sides.items():
            print(k, [l for l in open(f"/proc/{p.pid}/smaps_rollup") if "AnonHuge" in l or "Rss" in l], flush=True)
        continue
    ratios.append(tot["c"] / tot["py"])
    print(f"round {r}: py {N / tot['py']:.1f} tok/s, c {N / tot['c']:.1f} tok/s, py/c speed {tot['c'] / tot['py']:.4f}; per-chunk time py/c median {median(per):.4f} first {per[0]:.3f} last {per[-1]:.3f}", flush=True)
lo, hi = median_ci(ratios)
print(f"py/c speed: median {median(ratios):.4f} (95% CI {lo:.4f}-{hi:.4f}) over {len(ratios)} rounds; cargv {cargv[2:]}", flush=True)
for p in sides.values(): p.stdin.close(); p.wait()

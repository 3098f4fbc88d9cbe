"""One in-process executor level run for whichever superfluid tree is first on sys.path (A/B of trees)."""
import sys, time
import superfluid
from superfluid.proto import Admit, Sampling
from superfluid.worker._executor import Executor
from superfluid.worker._llamacpp import LlamaEngine

model, lanes_list, tokens = sys.argv[1], [int(x) for x in sys.argv[2].split(",")], int(sys.argv[3])
engine = LlamaEngine(model, max_batch=8, max_context=4096, threads=2)
texts = [f"Question {i}: explain topic number {i} in detail, please. Answer:" for i in range(8)]
work = [engine.tokenize(t, add_special=True, parse_special=False) for t in texts]

def level(lanes):
    for seq in range(engine.info.n_seq):
        engine.seq_rm(seq, 0, -1)
    ex = Executor(engine, max_lanes=lanes)
    queue = list(enumerate(work)); gen = 0; t0 = time.perf_counter()
    while queue or ex.lanes:
        while queue and len(ex.lanes) < lanes:
            tag, toks = queue.pop(0)
            ex.admit(Admit(lane=tag, tokens=toks, n_prompt=len(toks), max_new=tokens, sampling=Sampling(), ignore_eos=True))
        res = ex.step(prefill_budget=512)
        gen += sum(1 for r in res.emits if r[1] >= 0)
    return gen / (time.perf_counter() - t0)

level(8)
out = {n: round(level(n), 1) for n in lanes_list}
print(superfluid.__file__, out, flush=True)

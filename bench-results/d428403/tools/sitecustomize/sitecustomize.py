"""Times every LlamaEngine.decode of a worker started with this directory on PYTHONPATH (session 16, #18)."""
import os, sys, time
if True:
    import importlib.abc
    class _Hook(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name == "superfluid.worker._llamacpp":
                sys.meta_path.remove(self)
                import importlib.util
                spec = importlib.util.find_spec(name)
                loader = spec.loader
                orig_exec = loader.exec_module
                def exec_module(module):
                    orig_exec(module); _patch_mod(module)
                loader.exec_module = exec_module
                return spec
            return None
    def _patch_mod(LC):
        orig = LC.LlamaEngine.decode
        f = open(f"/tmp/x/sc/decode-{os.getpid()}.log", "a", buffering=1)
        def decode(self, rows, abort=None):
            t0 = time.perf_counter()
            try:
                return orig(self, rows, abort)
            finally:
                f.write(f"{t0:.6f} {time.perf_counter():.6f} {sum(len(r.tokens) for r in rows)}\n")
        LC.LlamaEngine.decode = decode
    sys.meta_path.insert(0, _Hook())

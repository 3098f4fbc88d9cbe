import ctypes, os, sys
if os.environ.get("IMPORTS"):
    for mod in os.environ["IMPORTS"].split(","):
        __import__(mod)
B = os.path.expanduser("~/.cache/superfluid/llama-server-0.3.36/build/bin/libllama-bench-impl.so")
lib = ctypes.CDLL(B, mode=getattr(os, "RTLD_GLOBAL", 0) if os.environ.get("GLOBAL") else 0)
f = getattr(lib, "_Z11llama_benchiPPc")
args = ["llama-bench", "-m", os.path.expanduser("~/.superfluid/models/gemma-3-270m-q4_k_m.gguf"), "-p", os.environ.get("N", "12000"), "-n", "0", "-fa", "1", "-t", "2", "-r", os.environ.get("R", "2")]
argv = (ctypes.c_char_p * (len(args) + 1))(*[a.encode() for a in args], None)
f.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
print("rc", f(len(args), argv))

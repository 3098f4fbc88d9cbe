import sys, os
sys.path.insert(0, "bench")
import superfluid.worker._llamacpp as LC
fa_off = os.environ.get("FA") == "off"
orig = LC._context_params
def patched(**kw):
    cp = orig(**kw)
    if fa_off:
        cp.flash_attn_type = LC.L.LLAMA_FLASH_ATTN_TYPE_DISABLED
    return cp
LC._context_params = patched
import grid_cost
print("flash attention", "off" if fa_off else "on (default)", flush=True)
grid_cost.main()

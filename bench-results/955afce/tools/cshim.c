#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include "llama.h"
static int envi(const char *k, int d) { const char *v = getenv(k); return v && *v ? atoi(v) : d; }
struct llama_context * llama_init_from_model(struct llama_model * m, struct llama_context_params p) {
    static struct llama_context * (*real)(struct llama_model *, struct llama_context_params);
    if (!real) real = dlsym(RTLD_NEXT, "llama_init_from_model");
    p.n_seq_max = envi("SHIM_NSEQ", p.n_seq_max);
    p.kv_unified = envi("SHIM_KVU", p.kv_unified);
    p.n_ctx = envi("SHIM_NCTX", p.n_ctx);
    p.swa_full = envi("SHIM_SWAFULL", p.swa_full);
    fprintf(stderr, "CSHIM n_ctx=%u n_seq_max=%u kv_unified=%d swa_full=%d\n", p.n_ctx, p.n_seq_max, p.kv_unified, p.swa_full);
    return real(m, p);
}
void llama_attach_threadpool(struct llama_context * c, ggml_threadpool_t a, ggml_threadpool_t b) {
    static void (*real)(struct llama_context *, ggml_threadpool_t, ggml_threadpool_t);
    if (!real) real = dlsym(RTLD_NEXT, "llama_attach_threadpool");
    if (envi("SHIM_NOTP", 0)) { fprintf(stderr, "CSHIM no threadpool\n"); return; }
    real(c, a, b);
}

#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include "llama.h"
struct llama_context * llama_init_from_model(struct llama_model * m, struct llama_context_params p) {
    static struct llama_context * (*real)(struct llama_model *, struct llama_context_params);
    if (!real) real = dlsym(RTLD_NEXT, "llama_init_from_model");
    fprintf(stderr, "PSHIM ctx n_ctx=%u n_batch=%u n_ubatch=%u n_seq_max=%u n_rs_seq=%u n_outputs_max=%u n_outputs_max_per_seq=%u n_threads=%d n_threads_batch=%d ctx_type=%d rope=%d pooling=%d attn=%d fa=%d rfb=%g rfs=%g yef=%g yaf=%g ybf=%g ybs=%g yoc=%u defrag=%g cb_eval=%p type_k=%d type_v=%d abort=%p emb=%d offload_kqv=%d no_perf=%d op_offload=%d swa_full=%d kv_unified=%d samplers=%p n_samplers=%zu ctx_other=%p\n",
        p.n_ctx, p.n_batch, p.n_ubatch, p.n_seq_max, p.n_rs_seq, p.n_outputs_max, p.n_outputs_max_per_seq, p.n_threads, p.n_threads_batch, p.ctx_type, p.rope_scaling_type, p.pooling_type, p.attention_type, p.flash_attn_type, p.rope_freq_base, p.rope_freq_scale, p.yarn_ext_factor, p.yarn_attn_factor, p.yarn_beta_fast, p.yarn_beta_slow, p.yarn_orig_ctx, p.defrag_thold, (void*)p.cb_eval, p.type_k, p.type_v, (void*)p.abort_callback, p.embeddings, p.offload_kqv, p.no_perf, p.op_offload, p.swa_full, p.kv_unified, (void*)p.samplers, p.n_samplers, (void*)p.ctx_other);
    return real(m, p);
}
struct llama_model * llama_model_load_from_file(const char * path, struct llama_model_params p) {
    static struct llama_model * (*real)(const char *, struct llama_model_params);
    if (!real) real = dlsym(RTLD_NEXT, "llama_model_load_from_file");
    fprintf(stderr, "PSHIM model devices=%p overrides=%p ngl=%d split=%d load_mode=%d lazy=%d main_gpu=%d kvo=%p vocab_only=%d check=%d extra_bufts=%d no_host=%d no_alloc=%d mtp=%d\n",
        (void*)p.devices, (void*)p.tensor_buft_overrides, p.n_gpu_layers, p.split_mode, p.load_mode, p.lazy_mode, p.main_gpu, (void*)p.kv_overrides, p.vocab_only, p.check_tensors, p.use_extra_bufts, p.no_host, p.no_alloc, p.load_mtp);
    return real(path, p);
}
void llama_attach_threadpool(struct llama_context * c, ggml_threadpool_t a, ggml_threadpool_t b) {
    static void (*real)(struct llama_context *, ggml_threadpool_t, ggml_threadpool_t);
    if (!real) real = dlsym(RTLD_NEXT, "llama_attach_threadpool");
    fprintf(stderr, "PSHIM attach_threadpool %p %p\n", (void*)a, (void*)b);
    real(c, a, b);
}

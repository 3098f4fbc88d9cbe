// lockstep C side: same context params as our engine, decodes chunk i of a token file on request
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include "llama.h"
static double now(void){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
static void quiet(enum ggml_log_level l, const char*t, void*u){(void)l;(void)t;(void)u;}
int main(int argc, char**argv){
  // model n_ctx n_seq unified swa_full threads step
  const char*path=argv[1]; int n_ctx=atoi(argv[2]), n_seq=atoi(argv[3]), uni=atoi(argv[4]), swaf=atoi(argv[5]), th=atoi(argv[6]), step=atoi(argv[7]);
  llama_log_set(quiet,NULL);
  llama_backend_init();
  struct llama_model_params mp=llama_model_default_params();
  struct llama_model*m=llama_model_load_from_file(path,mp);
  struct llama_context_params cp=llama_context_default_params();
  cp.kv_unified=uni; cp.swa_full=swaf; cp.n_ctx=n_ctx; cp.n_seq_max=n_seq; cp.n_batch=2048; cp.n_ubatch=512; cp.n_threads=th; cp.n_threads_batch=th;
  struct llama_context*c=llama_init_from_model(m,cp);
  llama_memory_t mem=llama_get_memory(c);
  llama_batch b=llama_batch_init(step,0,1);
  int *toks=NULL; int nt=0;
  char line[4096];
  printf("ready\n"); fflush(stdout);
  while(fgets(line,sizeof line,stdin)){
    if(!strncmp(line,"load ",5)){ line[strcspn(line,"\n")]=0; FILE*f=fopen(line+5,"rb"); fseek(f,0,SEEK_END); long sz=ftell(f); fseek(f,0,SEEK_SET); free(toks); toks=malloc(sz); nt=fread(toks,4,sz/4,f); fclose(f); llama_memory_seq_rm(mem,0,-1,-1); printf("ok %d\n",nt); fflush(stdout); continue;}
    int i=atoi(line); int p0=i*step; int n=nt-p0<step?nt-p0:step;
    b.n_tokens=n; for(int k=0;k<n;k++){b.token[k]=toks[p0+k];b.pos[k]=p0+k;b.n_seq_id[k]=1;b.seq_id[k][0]=0;b.logits[k]=(p0+k==nt-1);}
    double t0=now(); int rc=llama_decode(c,b); double t1=now();
    printf("%d %.6f\n",rc,t1-t0); fflush(stdout);
  }
  return 0;
}

// Greedy decoding from token ids with llama.cpp's C API, to check that kvserve and llama.cpp
// compute the same model (issue #18's like-for-like check); see README "Comparing with
// llama.cpp". Prints the N generated ids, space-separated.
// usage: llama_cpp_greedy MODEL.gguf N ID [ID...]
#include "llama.h"
#include <stdio.h>
#include <stdlib.h>

int main(int argc, char ** argv) {
    if (argc < 4) {
        fprintf(stderr, "usage: %s MODEL.gguf N ID [ID...]\n", argv[0]);
        return 2;
    }
    int n_gen = atoi(argv[2]);
    int n_prompt = argc - 3;
    llama_token * prompt = malloc(sizeof(llama_token) * n_prompt);
    for (int i = 0; i < n_prompt; i++) prompt[i] = atoi(argv[3 + i]);
    llama_log_set(NULL, NULL);
    llama_backend_init();
    struct llama_model_params mp = llama_model_default_params();
    struct llama_model * model = llama_model_load_from_file(argv[1], mp);
    if (!model) return 1;
    struct llama_context_params cp = llama_context_default_params();
    cp.n_ctx = n_prompt + n_gen + 8;
    cp.n_batch = cp.n_ctx;
    cp.n_threads = cp.n_threads_batch = 1;
    struct llama_context * ctx = llama_init_from_model(model, cp);
    int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
    struct llama_batch batch = llama_batch_get_one(prompt, n_prompt);
    llama_token tok;
    for (int g = 0; g < n_gen; g++) {
        if (llama_decode(ctx, batch)) return 1;
        const float * logits = llama_get_logits_ith(ctx, -1);
        tok = 0;
        for (int v = 1; v < n_vocab; v++) if (logits[v] > logits[tok]) tok = v;
        printf("%d%s", tok, g + 1 < n_gen ? " " : "\n");
        batch = llama_batch_get_one(&tok, 1);
    }
    llama_free(ctx);
    llama_model_free(model);
    return 0;
}

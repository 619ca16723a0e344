#!/usr/bin/env python3
"""Writes a Llama-family Hugging Face checkpoint (config.json + one model.safetensors, f32,
bf16 or f16) as a GGUF file for llama.cpp, without torch: the tensor names, the q/k row permutation and
the metadata keys follow llama.cpp's convert_hf_to_gguf.py (conversion/llama.py), the tensors
keep their dtype (2-D weights f32, bf16 or f16, norms f32). The vocabulary is written as a
byte-level-BPE ("gpt2") token list of the tokenizer.json's tokens with no merges: enough for
llama-bench, llama-batched-bench and generation from token ids (what issue #18's comparison
uses), not for llama.cpp's own text tokenisation.

usage: safetensors_to_gguf.py CHECKPOINT_DIR OUT.gguf   (needs: pip install gguf numpy)
"""
import json
import struct
import sys
from pathlib import Path

import gguf
import numpy as np

# Hugging Face leaf name -> GGUF name (llama.cpp's tensor map for MODEL_ARCH.LLAMA).
LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
TOP_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def read_safetensors(path):
    """(name, dtype, shape, raw bytes) of every tensor, in file order."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        base = 8 + n
        data = np.memmap(path, dtype=np.uint8, mode="r")
    for name, info in header.items():
        if name == "__metadata__":
            continue
        a, b = info["data_offsets"]
        yield name, info["dtype"], info["shape"], data[base + a : base + b]


def permute(w, n_head, n_head_kv):
    """convert_hf_to_gguf's LlamaModel.permute: HF's rotate-half q/k rows to GGUF's order."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    src, out = Path(sys.argv[1]), sys.argv[2]
    cfg = json.loads((src / "config.json").read_text())
    tok = json.loads((src / "tokenizer.json").read_text())
    n_head, n_kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim", cfg["hidden_size"] // n_head)

    tensors = list(read_safetensors(src / "model.safetensors"))
    half = {dt for _, dt, shape, _ in tensors if len(shape) == 2} & {"BF16", "F16"}
    w = gguf.GGUFWriter(out, "llama")
    w.add_name(src.name)
    w.add_context_length(cfg.get("max_position_embeddings", 2048))
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    w.add_rope_freq_base(cfg.get("rope_theta", 10000.0))
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    w.add_rope_dimension_count(head_dim)
    w.add_file_type({"BF16": gguf.LlamaFileType.MOSTLY_BF16, "F16": gguf.LlamaFileType.MOSTLY_F16}
                    .get(min(half, default=None), gguf.LlamaFileType.ALL_F32))

    vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])
    assert [i for _, i in vocab] == list(range(cfg["vocab_size"])), "vocab ids must be 0..vocab_size"
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list([t for t, _ in vocab])
    w.add_token_types([gguf.TokenType.NORMAL] * len(vocab))
    # One merge: the writer cannot store an empty string array, and llama.cpp needs the key.
    w.add_token_merges([f"{vocab[0][0][0]} {vocab[0][0][1:]}"])
    w.add_bos_token_id(cfg.get("bos_token_id", 1))
    w.add_eos_token_id(cfg.get("eos_token_id", 2))
    w.add_add_bos_token(False)

    for name, dtype, shape, raw in tensors:
        if name.startswith("model.layers."):
            i, leaf = name[len("model.layers."):].split(".", 1)
            gname = f"blk.{i}.{LAYER_NAMES[leaf]}"
        elif name == "lm_head.weight" and cfg.get("tie_word_embeddings"):
            continue
        else:
            gname = TOP_NAMES[name]
        arr = raw.view(np.uint16 if dtype in ("BF16", "F16") else np.float32).reshape(shape)
        if name.endswith("q_proj.weight"):
            arr = permute(arr, n_head, n_head)
        elif name.endswith("k_proj.weight"):
            arr = permute(arr, n_head, n_kv)
        if len(shape) == 1 and dtype == "BF16":  # norms in f32, as the converter writes them
            arr = (arr.astype(np.uint32) << 16).view(np.float32)
            dtype = "F32"
        elif len(shape) == 1 and dtype == "F16":
            arr = arr.view(np.float16).astype(np.float32)
            dtype = "F32"
        qtype = {"F32": gguf.GGMLQuantizationType.F32, "BF16": gguf.GGMLQuantizationType.BF16,
                 "F16": gguf.GGMLQuantizationType.F16}[dtype]
        w.add_tensor(gname, np.ascontiguousarray(arr), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


if __name__ == "__main__":
    main()

"""Build an MLX model directory from a llama-architecture GGUF (the bundled SmolLM2).

``mx.load`` reads a GGUF's Q4_0/Q4_1/Q8_0 tensors as MLX affine-quantized
arrays (``weight`` packed uint32, ``scales``, ``biases``; 32 values a group),
which is the layout mlx-lm's ``QuantizedLinear``/``QuantizedEmbedding`` take,
so the weights are copied bit for bit; only names and the Q/K row order change:

* llama.cpp's converter permutes the rows of ``attn_q``/``attn_k`` per head
  (a head's rows ``[x0..x31, y0..y31]`` become ``[x0, y0, x1, y1, ...]``) so
  that its RoPE can rotate adjacent pairs; mlx-lm's llama rotates halves
  (the Hugging Face layout), so the permutation is undone. It acts on whole
  rows, so ``weight``, ``scales`` and ``biases`` move together.
* The tokenizer is rebuilt from the GGUF's vocabulary and merges with
  ``tokenizers`` (byte-level BPE, digits split one by one as llama.cpp's
  ``smollm`` pre-tokenizer does), control tokens as special added tokens,
  and the chat template goes into ``tokenizer_config.json``.

Only what SmolLM2 needs is supported (``general.architecture == llama``,
``tokenizer.ggml.model == gpt2``); anything else is refused with the reason.

Run as ``python -m superfluid.models --mlx``: writes
``<model cache>/SmolLM2-135M-Instruct-mlx/`` (0700 dir, 0600 files) and prints
its path.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from .._private import make_private_dir

__all__ = ["MLX_MODEL_DIR", "convert_gguf", "mlx_test_model_path"]

MLX_MODEL_DIR = "SmolLM2-135M-Instruct-mlx"
_FORMAT = 2  # bump when the written directory changes: an older build is rebuilt

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# llama.cpp's pre-tokenizers that are GPT-2's regex, after splitting digits one by one
_DIGIT_SPLIT_PRE = {"smollm"}
_PLAIN_PRE = {"default", "gpt-2", "gpt2"}


def _scalar(meta: dict[str, Any], key: str, default: Any = None) -> Any:
    value = meta.get(key, default)
    return value.item() if hasattr(value, "item") else value


def _unpermute(rows: Any, n_head: int) -> Any:
    """Undo llama.cpp's per-head interleave of Q/K rows (works on any row-major array)."""
    shape = rows.shape
    per = shape[0] // n_head
    return rows.reshape(n_head, per // 2, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def _hf_name(name: str) -> str:
    stem, _, kind = name.rpartition(".")
    if stem.startswith("blk."):
        _, layer, part = stem.split(".", 2)
        if part not in _LAYER_NAMES:
            raise ValueError(f"unsupported tensor {name}")
        return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{kind}"
    if stem not in _TOP_NAMES:
        raise ValueError(f"unsupported tensor {name}")
    return f"{_TOP_NAMES[stem]}.{kind}"


def _weights(tensors: dict[str, Any], n_head: int, n_head_kv: int) -> tuple[dict[str, Any], int | None]:
    """The tensors under Hugging Face names, Q/K rows back in HF order; and
    the quantization bits (None if nothing is quantized)."""
    out: dict[str, Any] = {}
    bits = None
    for name, arr in tensors.items():
        stem = name.rpartition(".")[0]
        if stem.endswith(".attn_q"):
            arr = _unpermute(arr, n_head)
        elif stem.endswith(".attn_k"):
            arr = _unpermute(arr, n_head_kv)
        if name.endswith(".scales"):
            packed = tensors[stem + ".weight"]
            # uint32 words hold 32 / bits values; a group holds 32 values
            bits = 32 * packed.shape[1] // (arr.shape[1] * 32)
        out[_hf_name(name)] = arr
    return out, bits


def _config(meta: dict[str, Any], *, bits: int | None, tied: bool) -> dict[str, Any]:
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise ValueError(f"only llama-architecture GGUFs convert; this one is {arch!r}")
    n_embd = int(_scalar(meta, "llama.embedding_length"))
    n_head = int(_scalar(meta, "llama.attention.head_count"))
    config: dict[str, Any] = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": n_embd,
        "intermediate_size": int(_scalar(meta, "llama.feed_forward_length")),
        "num_hidden_layers": int(_scalar(meta, "llama.block_count")),
        "num_attention_heads": n_head,
        "num_key_value_heads": int(_scalar(meta, "llama.attention.head_count_kv", n_head)),
        "head_dim": int(_scalar(meta, "llama.rope.dimension_count", n_embd // n_head)),
        "rms_norm_eps": float(_scalar(meta, "llama.attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(_scalar(meta, "llama.rope.freq_base", 10000.0)),
        "rope_traditional": False,
        "max_position_embeddings": int(_scalar(meta, "llama.context_length", 2048)),
        "vocab_size": len(meta["tokenizer.ggml.tokens"]),
        "tie_word_embeddings": tied,
        "bos_token_id": int(_scalar(meta, "tokenizer.ggml.bos_token_id", 1)),
        "eos_token_id": int(_scalar(meta, "tokenizer.ggml.eos_token_id", 2)),
        "torch_dtype": "float16",
    }
    if bits is not None:
        config["quantization"] = {"group_size": 32, "bits": bits}
    return config


def _tokenizer_files(meta: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """``tokenizer.json`` text and ``tokenizer_config.json`` for a GGUF's BPE vocabulary."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    if meta.get("tokenizer.ggml.model") != "gpt2":
        raise ValueError(f"only byte-level BPE (gpt2) vocabularies convert; this one is "
                         f"{meta.get('tokenizer.ggml.model')!r}")
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in _DIGIT_SPLIT_PRE | _PLAIN_PRE:
        raise ValueError(f"unsupported pre-tokenizer {pre!r}")
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    types = [int(t) for t in meta["tokenizer.ggml.token_type"].tolist()]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.pre_tokenizer = (pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
                         if pre in _DIGIT_SPLIT_PRE else byte_level)
    tok.decoder = decoders.ByteLevel()
    control = [tokens[i] for i, t in enumerate(types) if t in (3, 4)]  # CONTROL, USER_DEFINED
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])

    def name(key: str) -> str | None:
        idx = _scalar(meta, key)
        return tokens[int(idx)] if idx is not None and 0 <= int(idx) < len(tokens) else None

    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": name("tokenizer.ggml.bos_token_id"),
        "eos_token": name("tokenizer.ggml.eos_token_id"),
        "unk_token": name("tokenizer.ggml.unknown_token_id"),
        "pad_token": name("tokenizer.ggml.padding_token_id"),
        "add_bos_token": bool(_scalar(meta, "tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(_scalar(meta, "llama.context_length", 2048)),
        "chat_template": meta.get("tokenizer.chat_template", ""),
        "additional_special_tokens": control,
    }
    return tok.to_str(), config


def convert_gguf(gguf: Path, out: Path) -> Path:
    """Write an MLX model directory for ``gguf`` at ``out`` (replaced whole).

    Raises:
        ValueError: the GGUF is not something this converter handles.
    """
    import mlx.core as mx

    tensors, meta = mx.load(str(gguf), return_metadata=True)
    config = _config(meta, bits=None, tied="output.weight" not in tensors)
    weights, bits = _weights(tensors, config["num_attention_heads"], config["num_key_value_heads"])
    if bits is not None:
        config["quantization"] = {"group_size": 32, "bits": bits}
    tokenizer_json, tokenizer_config = _tokenizer_files(meta)
    partial = out.with_name(out.name + ".part")
    shutil.rmtree(partial, ignore_errors=True)
    make_private_dir(partial)
    mx.save_safetensors(str(partial / "model.safetensors"), weights, metadata={"format": "mlx"})
    files = {
        "config.json": json.dumps(config, indent=2),
        "tokenizer.json": tokenizer_json,
        "tokenizer_config.json": json.dumps(tokenizer_config, indent=2),
        "superfluid-source.json": json.dumps({"gguf": gguf.name, "size": gguf.stat().st_size, "format": _FORMAT}),
    }
    for fname, text in files.items():
        (partial / fname).write_text(text, encoding="utf-8")
    for child in partial.iterdir():
        os.chmod(child, 0o600)
    shutil.rmtree(out, ignore_errors=True)
    partial.replace(out)
    return out


def mlx_test_model_path(*, build: bool = True) -> Path:
    """The MLX directory built from the embedded default GGUF, built on first use.

    Raises:
        FileNotFoundError: not built and ``build`` is false, or mlx is not installed.
    """
    from ._files import cache_dir, default_model_path

    target = cache_dir() / MLX_MODEL_DIR
    stamp = target / "superfluid-source.json"
    if stamp.exists():
        try:
            if json.loads(stamp.read_text()).get("format") == _FORMAT:
                return target
        except ValueError:
            pass
    if not build:
        raise FileNotFoundError(target)
    try:
        import mlx.core  # noqa: F401
    except ImportError:
        raise FileNotFoundError("install the mlx extra: pip install -e '.[mlx]'") from None
    return convert_gguf(default_model_path(), target)

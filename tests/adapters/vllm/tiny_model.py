"""A tiny Llama with random weights and a byte-level BPE tokenizer, made locally (no hub access).

``make_tiny_llama(path)`` writes a model vLLM loads with ``HF_HUB_OFFLINE=1``: 2 layers, 2 KV
heads of 32 dims (the CPU attention backend's smallest head size), fp32 or bf16 weights.
"""

from __future__ import annotations

import json
from pathlib import Path

CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "a paged kv cache keeps keys and values in blocks of tokens",
    "prefix caching shares blocks between requests with the same prompt",
    "kv-canary stamps every slot and verifies it on every read",
] * 8


def make_tiny_llama(path: str | Path, *, layers: int = 2, hidden: int = 128, kv_heads: int = 2, heads: int = 4,
                    vocab: int = 512, max_positions: int = 2048, seed: int = 0, dtype: str = "float32",
                    sliding_window: int = 0) -> Path:
    """Write the model and tokenizer under ``path`` (once; a second call reuses them). With
    ``sliding_window``, a Mistral-style model whose every layer attends to that many tokens."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, PreTrainedTokenizerFast

    path = Path(path)
    if (path / "config.json").exists() and (path / "tokenizer.json").exists():
        return path
    path.mkdir(parents=True, exist_ok=True)
    bpe = Tokenizer(models.BPE(unk_token=None))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(CORPUS, trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>")
    tok.save_pretrained(path)
    torch.manual_seed(seed)
    shape = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                 num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=hidden // heads,
                 max_position_embeddings=max_positions, bos_token_id=0, eos_token_id=1, tie_word_embeddings=False)
    if sliding_window:
        model = MistralForCausalLM(MistralConfig(**shape, sliding_window=sliding_window))
    else:
        model = LlamaForCausalLM(LlamaConfig(**shape))
    model = model.to(getattr(torch, dtype))
    model.save_pretrained(path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["torch_dtype"] = dtype
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    return path

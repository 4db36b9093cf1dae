"""A tiny random Llama, a prompt set with a shared system prompt, and a cache small enough to
force CPU offloading, for the transformers adapter tests (no downloads)."""

from __future__ import annotations

import types

import torch

PAGE = 8
SYSTEM_LEN = 20  # shared by every prompt: two full pages are served from the prefix cache
MAX_NEW_TOKENS = 24


def tiny_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    return LlamaForCausalLM(cfg).eval()


def prompts(num: int = 12, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    system = torch.randint(1, 256, (SYSTEM_LEN,), generator=g).tolist()
    return [system + torch.randint(1, 256, (int(torch.randint(3, 12, (1,), generator=g)),), generator=g).tolist()
            for _ in range(num)]


def generation_config():
    from transformers import GenerationConfig

    return GenerationConfig(max_new_tokens=MAX_NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)


def cb_config():
    """12 pages for ~40 tokens x 12 requests: the scheduler starves and offloads requests to CPU."""
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    from kvcanary.adapters.transformers import page_size_option

    return ContinuousBatchingConfig(**page_size_option(PAGE), num_blocks=12, max_batch_tokens=64,
                                    cpu_offload_space=0.01, use_async_batching=False)


def generate(model, inputs) -> dict[str, list[int]]:
    out = model.generate_batch(inputs, generation_config=generation_config(), continuous_batching_config=cb_config(),
                               progress_bar=False)
    return {k: list(v.generated_tokens) for k, v in out.items()}


class _UnpinnedTorch(types.ModuleType):
    """``torch`` for transformers' offloading module on a CPU-only host: its swap pool asks for pinned
    memory, which needs an accelerator; everything else is torch itself."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def empty(*args, pin_memory=False, **kwargs):
        return torch.empty(*args, pin_memory=pin_memory and torch.cuda.is_available(), **kwargs)

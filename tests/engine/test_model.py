"""The model really reads the paged KV, and its logits are bit-identical across batchings."""

from __future__ import annotations

import pytest
import torch

import kvcanary.engine.engine as engine_module
from kvcanary.engine import ModelConfig, SamplerKind
from kvcanary.engine.attention import AttentionLayout
from kvcanary.engine.grid import to_grid

from ._helpers import RecordingHooks, engine_config, make_engine, random_prompts, run_logits


def target_logits(prompts, target, max_new_tokens=6, **config):
    """Logits of request ``target`` when all ``prompts`` run together under ``config``."""
    engine = make_engine(**config)
    ids = [engine.add_request(p, max_new_tokens) for p in prompts]
    return torch.stack(run_logits(engine)[ids[target]]), engine.output_ids(ids[target])


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_batch_and_chunking_invariance(page_size):
    prompts = random_prompts(seed=1, num=6, min_len=3, max_len=50)
    alone, alone_out = target_logits(prompts[2:3], 0, chunk_size=64, max_tokens_per_step=64)
    for chunk_size, budget in [(1, 8), (5, 12), (16, 64), (64, 512)]:
        batched, batched_out = target_logits(
            prompts, 2, page_size=page_size, chunk_size=chunk_size, max_tokens_per_step=budget
        )
        assert torch.equal(batched, alone), f"chunk {chunk_size} budget {budget}: logits differ"
        assert batched_out == alone_out


def test_chunked_prefill_equals_one_shot_prefill():
    prompt = random_prompts(seed=2, num=1, min_len=45, max_len=45)
    one_shot, out = target_logits(prompt, 0, chunk_size=64)
    for chunk_size in (1, 2, 7, 44):
        chunked, chunked_out = target_logits(prompt, 0, chunk_size=chunk_size)
        assert torch.equal(chunked, one_shot) and chunked_out == out


def test_outputs_depend_on_the_seed_and_vary():
    prompts = random_prompts(seed=3, num=3)
    a = make_engine(model=ModelConfig(seed=0)).generate(prompts, 8)
    b = make_engine(model=ModelConfig(seed=1)).generate(prompts, 8)
    assert a != b
    assert all(len(set(out)) > 1 for out in a.values())


def corrupt_at_decode(mutate):
    """Logits of a single request's decode steps, with ``mutate(engine, batch)`` applied right
    before the forward of step 2 (the second decode step)."""
    prompt = random_prompts(seed=4, num=1, min_len=12, max_len=12)
    hooks = RecordingHooks()
    engine = make_engine(hooks=hooks)
    hooks.on_before = lambda batch: mutate(engine, batch) if hooks.names().count("before_forward") == 3 else None
    engine.add_request(prompt[0], 4)
    return torch.stack(run_logits(engine, check=False)[0])  # the page table is damaged on purpose


def test_a_damaged_pool_slot_changes_the_logits():
    clean = corrupt_at_decode(lambda engine, batch: None)

    def flip(engine, batch):
        slot = int(batch.req_to_token[batch.req_pool_indices[0], 3])
        engine.pool.k_buffers[0][slot].view(torch.uint8)[0, 6] ^= 0x10  # exponent bit of the first element

    damaged = corrupt_at_decode(flip)
    assert torch.equal(damaged[:2], clean[:2]) and not torch.equal(damaged[2], clean[2])


def test_a_wrong_page_table_entry_changes_the_logits():
    clean = corrupt_at_decode(lambda engine, batch: None)

    def repoint(engine, batch):
        row = batch.req_pool_indices[0]
        batch.req_to_token[row, 3] = batch.req_to_token[row, 5]

    damaged = corrupt_at_decode(repoint)
    assert torch.equal(damaged[:2], clean[:2]) and not torch.equal(damaged[2], clean[2])


def test_grid_rounding():
    x = torch.tensor([1.0 + 2**-20, -3.25, 2**-17, 0.1], dtype=torch.float64)
    assert to_grid(x).tolist() == [1.0, -3.25, 0.0, round(0.1 * 2**16) / 2**16]
    half = torch.tensor([1.5], dtype=torch.float16)
    assert to_grid(half) is half  # only float64 goes on the grid


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_batch_and_chunking_invariance():
    prompts = random_prompts(seed=1, num=6, min_len=3, max_len=50)
    alone, _ = target_logits(prompts[2:3], 0, chunk_size=64, device="cuda")
    batched, _ = target_logits(prompts, 2, page_size=4, chunk_size=5, max_tokens_per_step=12, device="cuda")
    assert alone.is_cuda and torch.equal(batched, alone)


@pytest.mark.parametrize("model, overrides", [
    (ModelConfig(), {"chunk_size": 7, "max_tokens_per_step": 24}),
    (ModelConfig(), {"sampler": SamplerKind.ORACLE, "num_draft_tokens": 3, "graph_batch_sizes": (1, 2, 4, 8)}),
    (ModelConfig(num_layers=4, sliding_window=6, window_layers=(0, 2), seed=3), {"chunk_size": 5}),
])
def test_an_eager_forward_takes_its_widths_from_the_host(monkeypatch, model, overrides):
    """Every eager forward's layout gets the widths a device read would give (no host sync in the
    forward), and every token emitted is the one of a forward that reads them from the device."""
    from_batch, seen = AttentionLayout.from_batch.__func__, []

    def spy(cls, batch, window=0, lut=None, max_len=None, max_extend=1):
        seq_lens = batch.prefix_lens + batch.extend_lens
        if batch.extend_lens.numel() and max_len != model_max_ctx:  # not a graph's fixed window
            seen.append(((max_len, max_extend), (int(seq_lens.max()), int(batch.extend_lens.max()))))
        return from_batch(cls, batch, window, lut, max_len, max_extend)

    model_max_ctx = engine_config(**overrides).max_ctx
    prompts = random_prompts(seed=int(torch.randint(0, 1 << 16, ())), num=7, min_len=3, max_len=40, prefix_len=9)
    monkeypatch.setattr(AttentionLayout, "from_batch", classmethod(spy))
    engine = make_engine(model=model, **overrides)
    ids = [engine.add_request(p, 6) for p in prompts]
    emitted = run_logits(engine)
    assert seen and all(got == want for got, want in seen), [(g, w) for g, w in seen if g != w][:4]
    assert len({w[1] for _, w in seen}) > 1  # prefill chunks and decode steps both ran eagerly
    monkeypatch.setattr(engine_module, "_widths", lambda plan: None)  # the forward reads them back
    reread = make_engine(model=model, **overrides)
    for p in prompts:
        reread.add_request(p, 6)
    again = run_logits(reread)
    assert all(torch.equal(torch.stack(emitted[i]), torch.stack(again[i])) for i in ids)
    assert [engine.output_ids(i) for i in ids] == [reread.output_ids(i) for i in ids]

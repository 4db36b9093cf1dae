"""A complete toy paged-KV engine wired to kv-canary through its public API only.

It prefills and decodes requests whose K/V live in a slot pool addressed through a page table,
shares a system prompt through a prefix cache, offloads that prefix to a host tier and loads it
back, sweeps the cached slots, and runs once clean and once per seeded fault:

  page_table_repoint  a page-table entry points at another live slot  -> chain at HEAD
  kv_flip             a byte of a cached prefix slot's K changes       -> fingerprint at TAIL
  host_copy_flip      a host-tier row is damaged before its load-back  -> fingerprint at SWEEP

Prints one line per run; exits 1 if the clean run reports anything or a fault is missed.
Run: ``python examples/toy_engine.py`` (CPU; ``--device cuda`` takes the fused CUDA path, not run in CI).
"""

from __future__ import annotations

import argparse
import sys

import torch

import kvcanary.ops
from kvcanary import Canary, CanaryConfig, ForwardBatch, Half, KVSource, PoolGeometry, SweepRun, Violation

NUM_SLOTS, ROWS, MAX_CTX, LAYERS, HEADS, DIM, VOCAB = 128, 8, 64, 2, 2, 8, 97
EXPECTED = {"page_table_repoint": ("chain", "HEAD"), "kv_flip": ("fingerprint", "TAIL"),
            "host_copy_flip": ("fingerprint", "SWEEP")}


class ToyEngine:
    def __init__(self, device: str, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.device = device
        self.emb = torch.randn(LAYERS, 2, VOCAB, HEADS, DIM, generator=g).to(device)  # per layer: K and V tables
        self.out = torch.randn(HEADS * DIM, VOCAB, generator=g).to(device)
        self.k = [torch.zeros(NUM_SLOTS, HEADS, DIM, device=device) for _ in range(LAYERS)]
        self.v = [torch.zeros(NUM_SLOTS, HEADS, DIM, device=device) for _ in range(LAYERS)]
        self.req_to_token = torch.zeros(ROWS, MAX_CTX, dtype=torch.int32, device=device)  # row 0: padding
        self.free_slots = list(range(1, NUM_SLOTS))  # slot 0 is reserved for padding writes
        self.free_rows = list(range(1, ROWS))
        self.host_k = torch.zeros(NUM_SLOTS, LAYERS, HEADS, DIM)  # host tier: one row per offloaded slot
        self.host_v = torch.zeros_like(self.host_k)
        self.cache: dict[tuple, torch.Tensor] = {}  # prefix cache: token prefix -> its device slots
        sources = [KVSource.from_buffer(buf[layer], half=half, layer=layer)
                   for layer in range(LAYERS) for buf, half in ((self.k, Half.K), (self.v, Half.V))]
        self.canary = Canary(CanaryConfig(sweep_interval=0), PoolGeometry(NUM_SLOTS, ROWS, MAX_CTX, device),
                             sources=sources)
        self.canary.attach_host_tier(NUM_SLOTS)
        self.step, self.violations = 0, []
        self.on_step = lambda engine, row, tokens: None  # fault hook, called before each forward

    def alloc(self, n: int) -> torch.Tensor:
        slots, self.free_slots = self.free_slots[:n], self.free_slots[n:]
        return torch.tensor(slots, dtype=torch.int64, device=self.device)

    def free(self, slots: torch.Tensor) -> None:
        self.free_slots += slots.tolist()
        self.canary.slots_freed(slots)

    def forward(self, row: int, tokens: list[int], prefix_len: int) -> int:
        """Write K/V of ``tokens[prefix_len:]`` and return the next token (greedy)."""
        self.on_step(self, row, tokens)
        dev, n = self.device, len(tokens)
        i64 = lambda xs: torch.tensor(xs, dtype=torch.int64, device=dev)
        positions = torch.arange(prefix_len, n, device=dev)
        out_cache_loc = self.req_to_token[row, prefix_len:n].to(torch.int64)
        truth = i64(tokens)
        batch = ForwardBatch(i64([row]), i64([prefix_len]), i64([n - prefix_len]), self.req_to_token,
                             truth[prefix_len:], positions, out_cache_loc, truth_ids=truth,
                             truth_offsets=kvcanary.ops.offsets_from_lengths(i64([n])), request_ids=(f"row{row}",))
        with self.canary.forward(batch):  # HEAD before the model, TAIL after it
            new = truth[prefix_len:]
            for layer in range(LAYERS):
                self.k[layer][out_cache_loc] = self.emb[layer, 0, new] + positions[:, None, None] / MAX_CTX
                self.v[layer][out_cache_loc] = self.emb[layer, 1, new]
            slots = self.req_to_token[row, :n].to(torch.int64)  # attention reads the paged prefix
            q = self.emb[-1, 0, truth[-1]]
            k, v = self.k[-1][slots], self.v[-1][slots]
            att = torch.softmax(torch.einsum("hd,thd->ht", q, k), dim=-1)
            logits = torch.einsum("ht,thd->hd", att, v).flatten() @ self.out
        self.end_step()
        return int(logits.argmax())

    def end_step(self) -> None:
        self.violations += self.canary.end_step(self.step).violations
        self.step += 1

    def generate(self, prompt: list[int], max_new: int, shared: int) -> list[int]:
        """Serve one request; its first ``shared`` tokens go through the prefix cache."""
        row = self.free_rows.pop()
        key = tuple(prompt[:shared])
        hit = self.cache.get(key)
        prefix_len = len(hit) if hit is not None else 0
        own = self.alloc(len(prompt) + max_new - prefix_len)
        slots = own if hit is None else torch.cat([hit, own])
        self.req_to_token[row, : len(slots)] = slots.to(torch.int32)
        tokens = list(prompt)
        for _ in range(max_new):
            tokens.append(self.forward(row, tokens, prefix_len))
            prefix_len = len(tokens) - 1
        if hit is None:
            self.cache[key] = slots[:shared]
        self.free(slots[shared:])  # the shared prefix stays cached, the rest returns to the pool
        self.req_to_token[row] = 0
        self.free_rows.append(row)
        return tokens[len(prompt):]

    def sweep(self) -> None:
        """Verify every idle cached slot (within the canary's byte budget)."""
        self.canary.sweep([SweepRun(slots, list(key), 0) for key, slots in self.cache.items()])
        self.end_step()

    def offload(self, key: tuple) -> None:
        slots = self.cache.pop(key)
        host_rows = torch.arange(len(slots))
        for layer in range(LAYERS):
            self.host_k[host_rows, layer] = self.k[layer][slots].cpu()
            self.host_v[host_rows, layer] = self.v[layer][slots].cpu()
        self.canary.offload(slots, host_rows)  # the records travel with the K/V rows
        self.free(slots)
        self.host = (key, host_rows)

    def load_back(self) -> None:
        key, host_rows = self.host
        slots = self.alloc(len(host_rows))
        for layer in range(LAYERS):
            self.k[layer][slots] = self.host_k[host_rows, layer].to(self.device)
            self.v[layer][slots] = self.host_v[host_rows, layer].to(self.device)
        self.canary.load_back(host_rows, slots)  # verified as they land (SWEEP)
        self.end_step()
        self.cache[key] = slots


def page_table_repoint(engine: ToyEngine, row: int, tokens: list[int]) -> None:
    if engine.step == 8:  # a decode step of the second request: its position 3 now reads another slot
        engine.req_to_token[row, 3] = engine.req_to_token[row, len(tokens) - 2]


def kv_flip(engine: ToyEngine, row: int, tokens: list[int]) -> None:
    if engine.step == 8:
        engine.k[0][int(engine.req_to_token[row, 5]), 0, 0] += 1.0


def run(fault: str | None, device: str) -> list[Violation]:
    engine = ToyEngine(device)
    gen = torch.Generator().manual_seed(1)
    system = torch.randint(1, VOCAB, (12,), generator=gen).tolist()
    users = [torch.randint(1, VOCAB, (n,), generator=gen).tolist() for n in (4, 3, 5)]
    if fault in ("page_table_repoint", "kv_flip"):
        engine.on_step = globals()[fault]
    engine.generate(system + users[0], 6, shared=len(system))  # prefill + decode; caches the system prompt
    engine.generate(system + users[1], 6, shared=len(system))  # prefix-cache hit
    engine.sweep()
    engine.offload(tuple(system))
    if fault == "host_copy_flip":
        engine.host_k[2, 0, 0, 0] += 1.0
    engine.load_back()
    engine.generate(system + users[2], 6, shared=len(system))  # hit on the loaded-back prefix
    engine.sweep()
    engine.violations += engine.canary.flush(engine.step).violations
    return engine.violations


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    device = parser.parse_args().device
    failed = False
    clean = run(None, device)
    print(f"clean: {len(clean)} violations")
    failed |= bool(clean)
    for fault, (reason, point) in EXPECTED.items():
        found = run(fault, device)
        first = found[0] if found else None
        reasons = [r.name.lower() for r in type(first.reasons) if r & first.reasons] if first else []
        ok = reason in reasons and first.point.name == point
        seen = f"{'+'.join(reasons)} at {first.point.name} step={first.step} slot={first.slot}" if first else "nothing"
        print(f"{fault}: {'detected' if ok else 'MISSED'} expected={reason}@{point} first={seen} "
              f"violations={len(found)}")
        failed |= not ok
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""Sampled-token swap: two requests' last sampled tokens trade places in the next forward's input.

Before HEAD, the input ids of two decoding requests of the batch (each writes the token it
sampled last step) are swapped, as if the sampler's output had been scattered to the wrong rows
of the next input buffer, while each request's history (the engine's ``output_ids``, the
canary's token truth) keeps its own token. The forward writes K/V of the other request's token
at each position, and HEAD stamps that token.

What the canary can see: only token checks. HEAD's write check compares every written token
with the truth and reports write_token for both slots. Everything else is self-consistent:
the stamp's chain is computed from the tokens actually written, so the successors' chain links
hold; positions are right; TAIL records the fingerprint of the K/V actually written. Later
reads report verify_token on the same slots, never chain, position or fingerprint.

Without token truth (``CanaryConfig(truth=False)``) no forward check can see it. A sweep still
compares idle prefix-cache slots with the prefix cache's keys (the engine's token history), so
once a request finished and its slots sit idle in the prefix cache, a sweep that reaches them
reports verify_token there.
"""

from __future__ import annotations

from kvcanary.core.record import LaunchPoint, Reason
from kvcanary.faults._follow import SequenceFault
from kvcanary.faults.base import Expectation, RequestFault
from kvcanary.runtime.batch import ForwardBatch


class SampledTokenSwap(SequenceFault, RequestFault):
    """``request_id``: one of the two requests (None: any decoding request of the batch)."""

    name = "sampled_token_swap"
    expected = Expectation(LaunchPoint.HEAD, Reason.WRITE_TOKEN)

    def before_forward(self, batch: ForwardBatch, step: int) -> None:
        if not self.is_armed(step):
            return
        starts = (batch.extend_lens.cumsum(0) - batch.extend_lens).tolist()
        decoders = []  # (request id, index in input_ids, token it writes)
        for i, rid, prefix, extend in self.batch_requests(batch):
            req = self.engine.requests[rid]
            if extend == 1 and req.output_ids and prefix == req.num_tokens - 1:
                decoders.append((rid, starts[i], int(batch.input_ids[starts[i]])))
        firsts = [d for d in decoders if self.aims_at(d[0])]
        pairs = [(a, b) for a in firsts for b in decoders if a[0] != b[0] and a[2] != b[2]]
        if not pairs:
            self.skip(step, "needs two decoding requests in the batch that sampled different tokens")
            return
        (rid_a, t_a, tok_a), (rid_b, t_b, tok_b) = self.rng.choice(pairs)
        batch.input_ids[t_a], batch.input_ids[t_b] = tok_b, tok_a
        slot_a, slot_b = int(batch.out_cache_loc[t_a]), int(batch.out_cache_loc[t_b])
        pos_a, pos_b = int(batch.positions[t_a]), int(batch.positions[t_b])
        inj = self.record(step, slot_a, f"request={rid_a} position={pos_a} writes token {tok_b} (sampled {tok_a}); "
                                        f"request={rid_b} position={pos_b} slot={slot_b} writes token {tok_a} "
                                        f"(sampled {tok_b})", {slot_b})
        self.follow(inj, rid_a, pos_a)
        self.follow(inj, rid_b, pos_b)

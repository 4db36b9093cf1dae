"""Wrong token at a chunk boundary: the first token of a non-first prefill chunk is replaced
(an off-by-one when slicing the prompt into chunks).

Before HEAD, in a request whose earlier chunk it computed itself (its prefix extends past the
prefix-cache hit) and whose chunk starts inside its prompt, the first input id of the chunk is
replaced by another token; its history is unchanged. HEAD's write check compares the written
token with the token truth and reports write_token for that slot. The stamp chained the token
actually written, so no chain or position check fails; later reads report verify_token on the
slot, and where the request's cached slots (chained from the wrong token) meet a clean copy
of the same prefix in the prefix cache, the seam fails a link (chain; see ``_follow``).

It needs token truth: with ``CanaryConfig(truth=False)`` no forward check sees it, and only
that seam, if a sweep or a reader reaches it, reports chain, long after the request delivered
tokens computed from the wrong one.
"""

from __future__ import annotations

from kvcanary.core.record import LaunchPoint, Reason
from kvcanary.faults._follow import SequenceFault
from kvcanary.faults.base import Expectation, RequestFault
from kvcanary.runtime.batch import ForwardBatch


class ChunkBoundaryToken(SequenceFault, RequestFault):
    """``request_id``: the prefilling request (None: any request of the batch at a chunk boundary)."""

    name = "chunk_boundary_token"
    expected = Expectation(LaunchPoint.HEAD, Reason.WRITE_TOKEN)

    def before_forward(self, batch: ForwardBatch, step: int) -> None:
        if not self.is_armed(step):
            return
        starts = (batch.extend_lens.cumsum(0) - batch.extend_lens).tolist()
        chunks = []
        for i, rid, prefix, extend in self.batch_requests(batch):
            req = self.engine.requests[rid]
            if self.aims_at(rid) and extend > 0 and req.num_prefix_cached < prefix < len(req.prompt_ids):
                chunks.append((i, rid, prefix))
        vocab = self.engine.model_config.vocab_size
        if not chunks or vocab < 2:
            self.skip(step, "no target request starts a non-first prefill chunk in this forward")
            return
        i, rid, prefix = self.rng.choice(chunks)
        t = starts[i]
        old = int(batch.input_ids[t])
        new = (old + 1 + self.rng.randrange(vocab - 1)) % vocab
        batch.input_ids[t] = new
        slot = int(batch.out_cache_loc[t])
        inj = self.record(step, slot, f"request={rid} position={prefix} (first of its chunk) writes token {new} "
                                      f"instead of {old}", set())
        self.follow(inj, rid, prefix)

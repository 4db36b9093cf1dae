"""Tensor-parallel ranks that agree: every rank's canary findings and chain digest are all-reduced
asynchronously each step, divergences between ranks are reported as ``rank_divergence``, and the
policy is applied on every rank in the same step. See ``agreement.py``."""

from kvcanary.distributed.agreement import AgreedStepReport, RankAgreement, RanksOutOfStep
from kvcanary.distributed.divergence import DIVERGENCE_RE, Cause, RankDivergence, RankSignal, find_divergences
from kvcanary.distributed.signal import chain_digest

__all__ = ["DIVERGENCE_RE", "AgreedStepReport", "Cause", "RankAgreement", "RankDivergence", "RankSignal",
           "RanksOutOfStep", "chain_digest", "find_divergences"]

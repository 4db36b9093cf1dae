"""Tensor-parallel ranks that agree: every rank's canary findings and chain digest are built into
one signal row on the device (``signal_row``) and all-reduced with the step (capturable in a CUDA
graph with NCCL), divergences between ranks are reported as ``rank_divergence``, and the policy
is applied on every rank in the same step. See ``agreement.py``."""

from kvcanary.distributed.agreement import AgreedStepReport, RankAgreement, RanksOutOfStep
from kvcanary.distributed.divergence import DIVERGENCE_RE, Cause, RankDivergence, RankSignal, find_divergences
from kvcanary.distributed.signal import SignalBuffers, chain_digest, signal_row

__all__ = ["DIVERGENCE_RE", "AgreedStepReport", "Cause", "RankAgreement", "RankDivergence", "RankSignal",
           "RanksOutOfStep", "SignalBuffers", "chain_digest", "find_divergences", "signal_row"]

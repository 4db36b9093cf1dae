"""The canary's ops, each in its own file: validate -> dispatch (Triton on CUDA, vectorised torch
elsewhere). Every op is exported here under its public name; the modules are internal.

| op                      | file           | what it does                                                 |
|-------------------------|----------------|--------------------------------------------------------------|
| offsets_from_lengths    | scatter.py     | int64[bs+1] offsets of a flat per-request tensor            |
| scatter_req_token_ids   | scatter.py     | flat per-request token ids -> rows of a [rows, max_ctx] table |
| gather_expected_tokens  | gather.py      | the token each written slot must hold, from the token truth  |
| build_plan              | plan.py        | the verify entries of a forward (prefix slot + predecessor)  |
| verify                  | verify.py      | check records against their predecessors; rows to the ring   |
| stamp                   | stamp.py       | write records for the slots a forward writes (prefix scan)   |
| fingerprint             | fingerprint.py | hash the K/V bytes of slots, from one or more KV sources     |
| check_forward           | check.py       | HEAD or TAIL as one fused launch (plan + verify + stamp)     |
| check_writes            | conflicts.py   | HEAD's write conflicts: duplicate targets, targets read/held |
| mark_writes             | landed.py      | HEAD: mark the covered bytes of every write target           |
| check_writes_landed     | landed.py      | TAIL: name the write targets that still hold their mark      |
| BoundCheck              | bound.py       | check_forward with a state's own arguments checked once      |
| BoundMarks              | bound.py       | mark_writes into sources checked once                        |
| BoundVerify             | bound.py       | verify of one plan checked once                              |

The three bound launches serve a caller that launches every step from the host (a Canary's
eager HEAD, TAIL and sweeps on CUDA): what does not change between calls is checked when they
are built, a batch's layout is read as attributes at each call, and a call returns False,
launching nothing, for a batch the op would refuse (call the op: it raises the error).

Every op that reads K/V takes ``sources=`` with ``mode=`` (and their table, ``meta=``), or one
``SourceSet`` (sources.py: the sources with their mode and table, checked once). Every op that
writes records or reports takes ``state=``, one ``DeviceState`` (state.py: records,
violation ring and counter, stats, error flags, workspaces), allocated by ``DeviceState.allocate``.
"""

from __future__ import annotations

from kvcanary.core.record import FingerprintMode
from kvcanary.ops._common import HAS_TRITON, Backend
from kvcanary.ops.bound import BoundCheck, BoundMarks, BoundVerify
from kvcanary.ops.check import check_forward
from kvcanary.ops.conflicts import check_writes
from kvcanary.ops.fingerprint import fingerprint
from kvcanary.ops.gather import gather_expected_tokens
from kvcanary.ops.landed import check_writes_landed, mark_writes
from kvcanary.ops.plan import Plan, build_plan
from kvcanary.ops.scatter import offsets_from_lengths, scatter_req_token_ids
from kvcanary.ops.sources import KVSource, SourceSet
from kvcanary.ops.stamp import stamp
from kvcanary.ops.state import DeviceFlag, DeviceState, Workspace
from kvcanary.ops.verify import verify

__all__ = [
    "HAS_TRITON",
    "Backend",
    "BoundCheck",
    "BoundMarks",
    "BoundVerify",
    "DeviceFlag",
    "DeviceState",
    "FingerprintMode",
    "KVSource",
    "Plan",
    "SourceSet",
    "Workspace",
    "build_plan",
    "check_forward",
    "check_writes",
    "check_writes_landed",
    "fingerprint",
    "gather_expected_tokens",
    "mark_writes",
    "offsets_from_lengths",
    "scatter_req_token_ids",
    "stamp",
    "verify",
]

"""``CanaryConfig.overlap``: three placements, the flag it was before read as two of them, and a
clear error for anything else."""

from __future__ import annotations

import pytest

from kvcanary import CanaryConfig, Overlap
from kvcanary.errors import ConfigError


def test_overlap_defaults_to_the_side_stream_inside_captures_only():
    assert CanaryConfig().overlap is Overlap.CAPTURED


@pytest.mark.parametrize(("given", "taken"), [(True, Overlap.ALWAYS), (False, Overlap.OFF),
                                              (Overlap.OFF, Overlap.OFF), (Overlap.ALWAYS, Overlap.ALWAYS)])
def test_overlap_takes_an_overlap_or_the_flag_it_was(given, taken):
    assert CanaryConfig(overlap=given).overlap is taken


@pytest.mark.parametrize("bad", ["always", 1, None])
def test_overlap_refuses_anything_else_naming_the_option_and_the_value(bad):
    with pytest.raises(ConfigError, match=rf"CanaryConfig.overlap must be an Overlap \(or a bool\), got {bad!r}"):
        CanaryConfig(overlap=bad)

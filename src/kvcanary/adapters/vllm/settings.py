"""The adapter's settings: what ``kv_connector_extra_config`` may hold, validated once at startup.

    {"policy": "log" | "raise" | "recompute",       # default "log"
     "real_kv": "none" | "partial" | "all",          # default: "partial" where the layout allows
     "layers": [0, -1],                              # per KV cache group; default first and last
     "halves": ["k", "v"],                           # default: the halves the layout stores by token
     "sweep_interval": 8, "sweep_budget_bytes": 1048576,
     "stats_period": 0}

Under ``raise`` and ``recompute`` the adapter hands damaged blocks to vLLM's own recovery of bad
blocks (the scheduler's ``kv_load_failure_policy``: ``fail`` fails the requests that read them,
``recompute`` rewinds them), so the two settings must agree; ``kv_transfer_config()`` in this
package writes both.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvcanary import CanaryConfig, Half, Policy
from kvcanary.errors import ConfigError
from kvcanary.ops import FingerprintMode

KEYS = ("policy", "real_kv", "layers", "halves", "sweep_interval", "sweep_budget_bytes", "stats_period")
FAILURE_POLICY = {Policy.RAISE: "fail", Policy.RECOMPUTE: "recompute"}


@dataclass(frozen=True)
class AdapterSettings:
    policy: Policy = Policy.LOG
    real_kv: FingerprintMode | None = None  # None: PARTIAL where some half of the layout is stored by token
    layers: tuple[int, ...] = (0, -1)
    halves: tuple[Half, ...] | None = None  # None: every half the layout stores by token
    sweep_interval: int = 8
    sweep_budget_bytes: int = 1 << 20
    stats_period: int = 0

    @classmethod
    def from_extra_config(cls, extra: dict) -> AdapterSettings:
        unknown = sorted(set(extra) - set(KEYS) - {"force"})
        if unknown:
            raise ConfigError(f"kv_connector_extra_config has unknown kv-canary keys {unknown}; expected some of "
                              f"{list(KEYS)}")
        kw = {}
        if "policy" in extra:
            kw["policy"] = _enum("policy", extra["policy"], Policy, exclude=(Policy.OFF,))
        if "real_kv" in extra:
            kw["real_kv"] = _enum("real_kv", extra["real_kv"], FingerprintMode, by_name=True)
        if "layers" in extra:
            layers = extra["layers"]
            if not isinstance(layers, (list, tuple)) or not layers or not all(
                    isinstance(x, int) and not isinstance(x, bool) for x in layers):
                raise ConfigError(f"kv-canary layers must be a non-empty list of layer indexes (negative from the "
                                  f"end), got {layers!r}")
            kw["layers"] = tuple(dict.fromkeys(layers))
        if "halves" in extra:
            halves = extra["halves"]
            if not isinstance(halves, (list, tuple)) or not halves:
                raise ConfigError(f"kv-canary halves must be a non-empty list of 'k' and 'v', got {halves!r}")
            kw["halves"] = tuple(_enum("halves", h, Half, by_name=True) for h in dict.fromkeys(halves))
        for name in ("sweep_interval", "sweep_budget_bytes", "stats_period"):
            if name in extra:
                v = extra[name]
                if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                    raise ConfigError(f"kv-canary {name} must be an int >= 0, got {v!r}")
                kw[name] = v
        return cls(**kw)

    def coverage(self, fingerprintable: tuple[Half, ...]) -> tuple[FingerprintMode, tuple[Half, ...]]:
        """The fingerprint mode and halves for a layout that stores ``fingerprintable`` by token;
        raises ConfigError where an explicit setting asks for more than the layout allows."""
        halves = self.halves if self.halves is not None else fingerprintable
        mode = self.real_kv if self.real_kv is not None else FingerprintMode.PARTIAL
        if mode is FingerprintMode.NONE:
            return mode, halves or (Half.K, Half.V)
        missing = [h.name.lower() for h in halves if h not in fingerprintable]
        if missing or not halves:
            if self.halves is None and self.real_kv is None:  # the defaults: records only
                return FingerprintMode.NONE, (Half.K, Half.V)
            allowed = [h.name.lower() for h in fingerprintable] or "none"
            raise ConfigError(f"kv-canary real_kv={mode.name.lower()} with halves {[h.name.lower() for h in halves]}: "
                              f"this vLLM cache layout stores {missing or 'no half'} of a token scattered over its "
                              f"block (not as one row); halves the layout allows: {allowed}; or set real_kv=none")
        return mode, halves

    def canary_config(self, mode: FingerprintMode, halves: tuple[Half, ...], layers: tuple[int, ...]) -> CanaryConfig:
        """The Canary's own config. ``raise`` is applied by vLLM's scheduler (it fails the requests),
        so the canary itself runs under ``recompute``, which only names what was damaged."""
        policy = Policy.LOG if self.policy is Policy.LOG else Policy.RECOMPUTE
        return CanaryConfig(policy=policy, real_kv=mode, layers=layers, halves=halves,
                            sweep_interval=self.sweep_interval, sweep_budget_bytes=self.sweep_budget_bytes,
                            stats_period=self.stats_period)

    def to_extra_config(self) -> dict:
        out = {"policy": self.policy.value, "layers": list(self.layers), "sweep_interval": self.sweep_interval,
               "sweep_budget_bytes": self.sweep_budget_bytes, "stats_period": self.stats_period}
        if self.real_kv is not None:
            out["real_kv"] = self.real_kv.name.lower()
        if self.halves is not None:
            out["halves"] = [h.name.lower() for h in self.halves]
        return out


def _enum(name: str, value, enum_cls, by_name: bool = False, exclude=()):
    choices = [m for m in enum_cls if m not in exclude]
    names = [m.name.lower() if by_name else m.value for m in choices]
    if isinstance(value, enum_cls) and value in choices:
        return value
    if isinstance(value, str) and value.lower() in names:
        return choices[names.index(value.lower())]
    raise ConfigError(f"kv-canary {name} must be one of {names}, got {value!r}")

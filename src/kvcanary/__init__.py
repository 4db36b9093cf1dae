"""kv-canary: make KV-cache corruption in LLM inference engines loud."""

from __future__ import annotations

__version__ = "0.1.0"

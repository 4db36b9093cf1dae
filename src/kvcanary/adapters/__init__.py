"""Adapters that attach a canary to third-party inference engines (``kvcanary.adapters.transformers``)."""

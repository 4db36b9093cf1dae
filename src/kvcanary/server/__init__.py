"""HTTP side of kv-canary (top layer; needs the ``server`` extra).

``admin``: the canary's admin routes (status, violations, sweep, slot records, fault injection,
``/metrics``) as a FastAPI router any engine can mount, given an ``AdminTarget``.
``service``: the reference engine stepping in a background thread behind a lock.
``completions``: an OpenAI-compatible ``/v1/completions`` over that service.
``app``: both mounted in one FastAPI app, as ``kv-canary serve`` runs it.
"""

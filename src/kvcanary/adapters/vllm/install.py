"""The one hook the adapter places in vLLM: HEAD and TAIL around the model runner's forward.

A KV connector sees the caches and the scheduler's decisions but not the forward's input ids,
positions and request order, which HEAD needs before the model writes. ``install`` wraps
``GPUModelRunner._model_forward`` (the CPU model runner inherits it; vLLM documents the method as
the place to inspect a model execution) in the worker process; ``uninstall`` puts it back. While
no step message is bound (warm-up, profiling, dummy runs) the wrapper calls the model alone.
"""

from __future__ import annotations

_ARG_NAMES = ("input_ids", "positions", "intermediate_tensors", "inputs_embeds")
_state: dict = {"original": None, "active": None}


def install(worker_side) -> None:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    if _state["original"] is None:
        original = GPUModelRunner.__dict__["_model_forward"]

        def _model_forward(self, *args, **kwargs):
            active = _state["active"]
            kwargs.update(zip(_ARG_NAMES, args, strict=False))
            if active is None:
                return original(self, **kwargs)
            return active.around_forward(self, lambda **kw: original(self, **kw), kwargs)

        _model_forward.__wrapped__ = original
        GPUModelRunner._model_forward = _model_forward
        _state["original"] = original
    _state["active"] = worker_side


def uninstall(worker_side=None) -> None:
    """Put vLLM's method back (only the installation of ``worker_side``, when given)."""
    if worker_side is not None and _state["active"] is not worker_side:
        return
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    if _state["original"] is not None:
        GPUModelRunner._model_forward = _state["original"]
    _state["original"] = _state["active"] = None


def active():
    """The worker side of the installation in this process, or None."""
    return _state["active"]

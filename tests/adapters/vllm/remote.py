"""A real vLLM engine in a process of its own (vLLM allows one engine per process), driven by the tests.

``Remote(model, policy, **settings)`` spawns the process, which builds the engine once; ``call(name,
**kwargs)`` runs ``scenarios.<name>(engine, **kwargs)`` there and returns its (picklable) result.
``policy="off"`` builds the engine without the canary (the fault-free reference).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import traceback

TIMEOUT_S = 600


class RemoteError(AssertionError):
    pass


class Remote:
    def __init__(self, model_path, policy: str, **settings):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_serve, args=(child, str(model_path), policy, settings), daemon=True)
        self.process.start()
        self._expect("ready")

    def _expect(self, what: str):
        waited = 0
        while not self.conn.poll(1.0):
            waited += 1
            if not self.process.is_alive() or waited >= TIMEOUT_S:
                self.close()
                raise RemoteError(f"the vLLM process {'died' if waited < TIMEOUT_S else 'hung'} (waiting for {what}, "
                                  f"exit code {self.process.exitcode})")
        status, value = self.conn.recv()
        if status != "ok":
            raise RemoteError(f"the vLLM process failed ({what}):\n{value}")
        return value

    def call(self, name: str, **kwargs):
        self.conn.send((name, kwargs))
        return self._expect(name)

    def close(self) -> None:
        if self.process.is_alive():
            try:
                self.conn.send(None)
                self.process.join(30)
            except (BrokenPipeError, OSError):
                pass
        if self.process.is_alive():
            self.process.kill()
            self.process.join(10)


def _serve(conn, model_path: str, policy: str, settings: dict) -> None:
    os.environ.pop("TRITON_INTERPRET", None)  # the test suite's switch for kv-canary's own kernels
    os.environ.update(HF_HUB_OFFLINE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    try:
        from . import scenarios

        engine = scenarios.start(model_path, policy, **settings)
        conn.send(("ok", None))
    except BaseException:  # noqa: BLE001 - reported to the test
        conn.send(("error", traceback.format_exc()))
        return
    while True:
        request = conn.recv()
        if request is None:
            return
        name, kwargs = request
        try:
            conn.send(("ok", getattr(scenarios, name)(engine, **kwargs)))
        except BaseException:  # noqa: BLE001
            conn.send(("error", traceback.format_exc()))

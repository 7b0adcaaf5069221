"""A reference rollout server inside this process: uvicorn in a thread, on a free local port (tests, tools).

    engine = ReferenceEngine(model_path)
    with serve_in_thread(engine) as url:              # e.g. "http://127.0.0.1:24817"
        RolloutClient(url).generate_many([...])       # real HTTP, SGLang's API (moerl.rollout.server)
        engine.pause_after_steps(3)                   # the test hooks of the engine stay reachable

Unlike a ``python -m moerl.rollout.server`` child, the engine object is shared with the caller, so
tests can use its hooks (:meth:`ReferenceEngine.pause_after_steps`, ``step_hook``) while clients
talk HTTP to it; several such URLs can sit behind sglang-router as a RolloutCluster's
``extra_worker_urls`` (``num_servers=0``: the cluster then starts the router only).
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Iterator, Optional

from moerl.rollout.server import ReferenceEngine, create_app


@contextlib.contextmanager
def serve_in_thread(engine: ReferenceEngine, *, host: str = "127.0.0.1", port: Optional[int] = None,
                    server_args: Optional[dict] = None, startup_timeout_s: float = 30.0) -> Iterator[str]:
    """Serve ``create_app(engine, server_args)`` with uvicorn in a daemon thread; yields the base URL.

    Args:
        port: TCP port (None: a free one below the ephemeral range, see
            moerl.rollout.launcher.free_port_below_ephemeral).
    On exit the server stops (uvicorn's graceful shutdown: open requests get 2 s); the engine is
    not closed.

    Raises:
        RuntimeError: uvicorn did not start within ``startup_timeout_s`` or its thread died (e.g.
            the port is taken).
    """
    import uvicorn

    from moerl.rollout.launcher import free_port_below_ephemeral

    port = free_port_below_ephemeral(host) if port is None else port
    config = uvicorn.Config(create_app(engine, server_args), host=host, port=port, log_config=None,
                            access_log=False, log_level="warning", timeout_graceful_shutdown=2)
    server = uvicorn.Server(config)  # in a non-main thread uvicorn installs no signal handlers
    thread = threading.Thread(target=server.run, name=f"moerl-reference-server-{port}", daemon=True)
    thread.start()
    deadline = time.monotonic() + startup_timeout_s
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            raise RuntimeError(f"in-process reference server on {host}:{port} did not start "
                               f"(thread alive: {thread.is_alive()}, waited {startup_timeout_s:g} s)")
        time.sleep(0.01)
    try:
        yield f"http://{host}:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10.0)

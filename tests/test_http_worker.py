"""moerl.rollout.http_worker: the producer's HTTP attempts made in a child process.

Reference: the same requests made from this process by RolloutClient's own aiohttp path, against the real
reference server (tiny model, served in a thread); failures are the ones RolloutClient already handles.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

from moerl.rollout.client import RolloutClient  # noqa: E402
from moerl.rollout.errors import RolloutRequestError  # noqa: E402
from moerl.rollout.http_worker import HttpWorker  # noqa: E402
from moerl.rollout.inprocess import serve_in_thread  # noqa: E402
from moerl.rollout.server import ReferenceEngine  # noqa: E402
from moerl.rollout.testing import refusing_port  # noqa: E402


@pytest.fixture(scope="module")
def served(ckpts):
    engine = ReferenceEngine(ckpts[0])
    with serve_in_thread(engine) as url:
        yield engine, url
    engine.close()


def _body(i: int, max_new: int = 6) -> dict:
    return {"input_ids": [4, 5, 13, 6], "return_logprob": True, "rid": f"r{i}",
            "sampling_params": {"temperature": 1.0, "max_new_tokens": max_new, "sampling_seed": 100 + i}}


def _strip(out: dict) -> tuple[dict, list[float]]:
    """The answer without its latency, and its output log-probs apart (float32, compared within 1e-5: the
    reference engine batches the requests that arrive together, and a different batch changes the last bits)."""
    meta = dict(out["meta_info"])
    meta.pop("e2e_latency", None)
    lps = [lp for lp, _, _ in meta["output_token_logprobs"]]
    meta["output_token_logprobs"] = [[tok, text] for _, tok, text in meta["output_token_logprobs"]]
    return dict(out, meta_info=meta), lps


def test_worker_answers_equal_the_in_process_client_and_errors_match(served):
    _, url = served

    async def run():
        plain = RolloutClient(url, timeout_s=60, max_retries=0)
        via = RolloutClient(url, timeout_s=60, max_retries=0)
        via.worker = HttpWorker(timeout_s=60)
        try:
            a = await asyncio.gather(*(plain.post("/generate", _body(i)) for i in range(8)))
            b = await asyncio.gather(*(via.post("/generate", _body(i)) for i in range(8)))
            sa, sb = [_strip(x) for x in a], [_strip(x) for x in b]
            assert [x for x, _ in sa] == [x for x, _ in sb]
            for (_, la), (_, lb) in zip(sa, sb):
                assert la == pytest.approx(lb, abs=1e-5)
            assert [x["meta_info"]["id"] for x in b] == [f"r{i}" for i in range(8)]
            assert len({tuple(x["output_ids"]) for x in b}) > 1  # the seeds differ: not one answer repeated
            # an HTTP 400 is refused, not retried, with the server's message, on both paths
            for c in (plain, via):
                with pytest.raises(RolloutRequestError, match="was refused: HTTP 400"):
                    await c.post("/pause_generation", {"mode": "stop"})
            assert via.worker.starts == 1
        finally:
            await plain.aclose()
            await via.aclose()
            via.worker.close()
        assert via.worker.proc is None

    asyncio.run(run())


def test_connection_errors_are_retried_then_raised_naming_the_attempts():
    with refusing_port() as port:  # nothing answers there for the whole test

        async def run():
            c = RolloutClient(f"http://127.0.0.1:{port}", timeout_s=5, max_retries=1, backoff_s=0.01)
            c.worker = HttpWorker(timeout_s=5)
            try:
                with pytest.raises(RolloutRequestError, match=r"failed after 2 attempts; last error: ClientConnector"):
                    await c.post("/generate", _body(0))
            finally:
                c.worker.close()

        asyncio.run(run())


def test_a_killed_worker_fails_its_request_and_the_retry_restarts_it(served, capfd):
    engine, url = served

    def slow(step, rids):
        time.sleep(0.02)

    async def run():
        c = RolloutClient(url, timeout_s=60, max_retries=2, backoff_s=0.01)
        c.worker = HttpWorker(timeout_s=60)
        try:
            want = await c.post("/generate", _body(1, max_new=20))
            first_pid = c.worker.proc.pid
            engine.step_hook = slow  # the next request takes ~0.4 s: kill the worker meanwhile
            task = asyncio.ensure_future(c.post("/generate", _body(1, max_new=20)))
            await asyncio.sleep(0.15)
            os.kill(first_pid, signal.SIGKILL)
            got = await task
            assert c.worker.starts == 2 and c.worker.proc.pid != first_pid  # restarted by the retry
            assert got["output_ids"] == want["output_ids"]  # same rid and seed: same answer
            err = capfd.readouterr().err  # the restart is said, naming both pids and the signal
            assert (f"rollout HTTP worker (pid {first_pid}) died (signal SIGKILL); its requests in flight are "
                    f"retried; restarted as pid {c.worker.proc.pid}") in err, err
        finally:
            engine.step_hook = None
            c.worker.close()

    asyncio.run(run())


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="timeout_s must be > 0"):
        HttpWorker(timeout_s=0)
    with pytest.raises(ValueError, match="max_connections must be >= 1"):
        HttpWorker(max_connections=0)


def test_ctrl_c_is_the_trainers_the_worker_neither_dies_nor_prints_a_traceback(served, capfd):
    """A terminal's Ctrl-C sends SIGINT to its whole foreground process group. The worker is not in the
    trainer's group (its own session, as the servers), and a SIGINT sent to it anyway is ignored: it
    keeps answering, and no KeyboardInterrupt traceback reaches the terminal (the trainer's SIGINT
    handler stops the run; the worker then exits with its socket). Before: the worker shared the
    group, died of the Ctrl-C and printed a traceback under the trainer's one-line exit message."""
    engine, url = served

    async def run():
        c = RolloutClient(url, timeout_s=60, max_retries=0)
        c.worker = HttpWorker(timeout_s=60)
        try:
            want = await c.post("/generate", _body(2))
            proc = c.worker.proc
            assert os.getpgid(proc.pid) != os.getpgid(0)  # not reached by the terminal's Ctrl-C
            os.kill(proc.pid, signal.SIGINT)
            await asyncio.sleep(0.5)
            assert proc.poll() is None and c.worker.starts == 1  # still the first worker, alive
            got = await c.post("/generate", _body(2))  # max_retries=0: the same worker answers
            assert got["output_ids"] == want["output_ids"]
        finally:
            c.worker.close()
        assert proc.poll() == 0  # exited by itself when its socket closed

    asyncio.run(run())
    assert "KeyboardInterrupt" not in capfd.readouterr().err

"""A sandboxed process pool that scores rollout groups: ``RewardPool``.

Reward code is user code: it can hang, raise, leak or kill its process. Each task runs in a worker
process under a wall-clock limit; a task that runs past it gets ``error_value`` and its worker is killed
(SIGKILL) and replaced; a raising function gets ``error_value``; a worker that dies (``os._exit``,
segfault, OOM kill) gets ``error_value`` for its task and is replaced. Other samples keep their scores.
Nothing here uses ``signal.alarm``: one dispatcher thread of the process that owns the pool (the trainer,
or a ``RewardBroker``'s child process: moerl.rewards.broker) watches deadlines and pipes.

Tasks: with a group function, one task per group (limit ``timeout_s``). With a per-sample function, a
group's n responses go out as ``min(n, num_workers)`` tasks of contiguous chunks (sizes differ by at most
one; limit ``timeout_s`` x the chunk's size), each scored one response at a time by its worker, which
answers one message with a per-response outcome, so a raising response gets ``error_value`` alone. One
task per response (a pickled message each way) made the dispatcher thread 25-30 % of the rollout
producer's CPU; ``tools/bench_rewards.py`` (16 groups x 8 responses, 2 workers: 32 tasks per step instead
of 128), on a 2-core machine: the calling process's CPU 4.3-4.9 ms per step instead of 15.8-16.0, the
workers' 1.7-2.0 ms instead of 5.7-6.0.

When a chunk of several responses times out or kills its worker, the culprit is unknown: the pool logs
one line for the chunk and scores its responses again one per task (limit ``timeout_s`` each), so the
results and the counted events are those of scoring every response alone, with one difference: the limit
is the chunk's, so a response slower than ``timeout_s`` still counts as scored when the chunk as a whole
finishes within its limit (k responses of 12, 1, 1, 1 s with timeout_s 10: the 12 s one is scored). A hang
holds a worker for the chunk's limit plus one response's ((k + 1) x timeout_s).

Workers are fresh interpreters (``subprocess.Popen`` of ``moerl.rewards._worker``: fork + exec, the
semantics of multiprocessing's "spawn"; never a bare fork of the threaded trainer) that resolve the
``reward.function`` string themselves with the trainer's ``sys.path``. Start cost: ``Popen`` returns
in milliseconds and the worker becomes ready in the background (about 0.1-0.3 s for a rule worker:
an interpreter plus ``moerl.rewards``; the first ``math`` / ``reasoning_gym`` call in a worker then
imports math-verify / reasoning-gym, about 0.5-1 s; the reward-model worker imports torch and
transformers and loads the checkpoint, seconds). A replacement worker starts the same way, so a
timeout or crash costs the failing sample ``timeout_s`` (or nothing) and the pool one worker for that
start time. ``wait_ready()`` blocks until every worker is up (call it at start-up to see bad specs
or a bad reward model before the first step).
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import os
import selectors
import socket
import subprocess
import sys
import threading
import time
from concurrent import futures
from concurrent.futures import Future
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any, Callable, Iterable, Optional, Sequence

from moerl.rewards.errors import RewardConfigError
from moerl.rewards.registry import as_metadata, resolve_reward_fn
from moerl.runtime.procs import child_env, current_cpu_affinity, pdeathsig_preexec

_MOERL_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_MAX_START_FAILURES = 3  # consecutive workers dying before "ready": the pool is broken


@dataclass
class RewardResult:
    """The reward of one sample.

    Attributes:
        score: the reward (float); ``error_value`` when ``error`` is set (with a reward model: the
            rule part is ``error_value``, see ``RewardPool``).
        metrics: extra numeric metrics by bare name (the trainer logs them as ``reward/<name>``): the
            extra entries of a dict-returning function; with a reward model also ``rule`` and ``model``.
        error: None, or ``"timeout"``, ``"exception: <repr>"``, ``"worker died (exit code N)"``
            (N negative for a signal, e.g. -9 for SIGKILL, -11 for a segfault).
    """

    score: float
    metrics: dict[str, float] = field(default_factory=dict)
    error: Optional[str] = None


class _Task:
    """One message's work for a worker. ``what`` names it in log lines (``uid``, ``uid[i]``, a chunk's
    ``uid[a..b]``); ``names`` (a ``"samples"`` task only) names each response of the chunk (``uid[i]``).
    Its future's result: ``(value, error)`` for kinds sample / group / model, and for kind samples a list of
    one ``(value, error)`` per response."""

    __slots__ = ("tid", "kind", "payload", "what", "future", "timeout", "names")

    def __init__(self, tid: int, kind: str, payload: tuple, what: str, timeout: Optional[float],
                 names: Optional[list[str]] = None):
        self.tid, self.kind, self.payload, self.what, self.timeout = tid, kind, payload, what, timeout
        self.names = names
        self.future: Future = Future()
        # running from the start: a cancelled awaiting task (asyncio.wrap_future) cannot cancel it, so the
        # dispatcher's set_result / set_exception never meet a cancelled future (InvalidStateError)
        self.future.set_running_or_notify_cancel()

    @property
    def chunk(self) -> bool:
        """A "samples" task of several responses: if it times out or kills its worker the culprit is unknown,
        so it is scored again one response per task."""
        return self.kind == "samples" and len(self.names) > 1


def _chunks(n: int, k: int) -> list[tuple[int, int]]:
    """``[a, b)`` bounds of ``min(n, k)`` contiguous chunks of ``range(n)`` whose sizes differ by at most
    one, larger first (n=8, k=3: (0, 3), (3, 6), (6, 8)); ``[]`` for n=0. ``k`` >= 1."""
    m = min(n, k)
    if m == 0:
        return []
    q, r = divmod(n, m)
    out, a = [], 0
    for j in range(m):
        b = a + q + (1 if j < r else 0)
        out.append((a, b))
        a = b
    return out


def start_child(module: str, init: dict, cpu_affinity: Optional[Iterable[int]] = None
                ) -> tuple[subprocess.Popen, Connection]:
    """Start ``python -c "from <module> import main; main(FD)"`` (a fresh interpreter: fork + exec) with one
    end of a socket pair as FD, send it ``init`` and return (the process, the parent's Connection). The child
    gets SIGKILL when the calling THREAD exits (PR_SET_PDEATHSIG tracks the forking thread; it works even if
    the child's own code holds its GIL): call this from a thread that lives as long as the child should. The
    child is no rank of a torchrun job (``child_env``) and finds moerl on its PYTHONPATH. ``cpu_affinity``:
    the child's cores (None: the calling thread's).

    Raises:
        OSError: the process could not be started.
    """
    parent, child = socket.socketpair()
    env = child_env()
    env["PYTHONPATH"] = os.pathsep.join([_MOERL_ROOT] + [p for p in [env.get("PYTHONPATH")] if p])
    try:
        popen = subprocess.Popen([sys.executable, "-c", f"from {module} import main; main({child.fileno()})"],
                                 pass_fds=(child.fileno(),), env=env, stdin=subprocess.DEVNULL,
                                 preexec_fn=pdeathsig_preexec(os.getpid(), cpu_affinity=cpu_affinity))
    except BaseException:
        parent.close()
        raise
    finally:
        child.close()
    conn = Connection(parent.detach())
    conn.send(init)
    return popen, conn


class _Proc:
    """One worker process and the parent's end of its socket."""

    def __init__(self, kind: str, init: dict, cpu_affinity: Optional[Iterable[int]] = None):
        self.popen, self.conn = start_child("moerl.rewards._worker", init, cpu_affinity)
        self.kind = kind
        self.ready = False
        self.task: Optional[_Task] = None
        self.deadline: Optional[float] = None

    def kill(self) -> None:
        try:
            self.popen.kill()
        except OSError:
            pass
        self.conn.close()
        threading.Thread(target=self.popen.wait, daemon=True).start()  # reap without blocking

    def exit_code(self) -> Optional[int]:
        try:
            return self.popen.wait(timeout=2.0)
        except subprocess.TimeoutExpired:
            return None


class RewardPool:
    """Score rollout groups with ``reward.function`` in sandboxed worker processes, optionally plus a
    reward model.

    Args:
        function: ``reward.function``: a registered name, ``package.module:function`` or
            ``/path/to/file.py:function`` (see ``resolve_reward_fn``); resolved here first, so a bad spec
            raises ``RewardConfigError`` at construction.
        group: ``reward.group``: ``function`` scores a whole group.
        num_workers: rule worker processes; 0 = run ``function`` inline in the calling thread (no
            timeout, no crash isolation: for tests and debugging; the reward model is then loaded
            in-process on first use).
        timeout_s: wall-clock limit per response (per group with ``group=True``), in seconds. A task gets
            the sum of its responses' limits (a chunk of k responses: ``k * timeout_s``), counted from the
            moment a worker starts it; a chunk that runs past it is scored again one response per task
            (module docstring), so a hanging response gets ``error_value`` after at most its chunk's
            limit plus ``timeout_s`` (plus the wait for a free worker). Not applied to reward-model tasks.
        error_value: the score of a response (a group, with ``group=True``) that timed out, raised or
            crashed its worker.
        model_path: optional local HF sequence-classification checkpoint (``RewardModel``), scored in
            one dedicated worker process. With it, a sample's score is
            ``rule_weight * rule + model_weight * model`` (rule = ``error_value`` on a rule error) and
            ``metrics`` has ``rule`` and ``model``. Without it, the score is the rule reward itself
            (``rule_weight`` and ``model_weight`` are not used).
        model_weight, rule_weight: see ``model_path``.
        model_batch_size: reward-model forward batch size.
        model_device: torch device for the reward model (default ``"cpu"``).
        log: ``log(str)`` called once per timeout / exception / crash, with the sample uid, and once per
            chunk that timed out or crashed before its responses are scored again one at a time.

    Errors: a reward-model failure (exception or its worker dying) raises ``RuntimeError`` from the
    scoring call (a run must not silently train on a broken reward model); the model worker is
    restarted for the next call. Workers that cannot start (``init_error``, or dying at start-up
    three times in a row) make every scoring call raise ``RewardConfigError`` / ``RuntimeError``.

    Thread-safe: any number of threads may call ``score_group`` / ``score`` at once; ``ascore_group``
    awaits without blocking its event loop. Use as a context manager or call ``close()``.
    """

    def __init__(self, function: str, *, group: bool = False, num_workers: int = 2, timeout_s: float = 10.0,
                 error_value: float = 0.0, model_path: Optional[str] = None, model_weight: float = 1.0,
                 rule_weight: float = 1.0, model_batch_size: int = 16, model_device: str = "cpu",
                 log: Callable[[str], Any] = print):
        if num_workers < 0:
            raise RewardConfigError(f"reward.num_workers must be >= 0, got {num_workers}")
        if not timeout_s > 0:
            raise RewardConfigError(f"reward.timeout_s must be > 0, got {timeout_s}")
        if model_path is not None and not os.path.isdir(model_path):
            raise RewardConfigError(f"reward.model_path={model_path!r} is not a directory; give a local HF "
                                    "sequence-classification checkpoint")
        self._fn = resolve_reward_fn(function, group=group)  # refuses a bad spec now, in this process
        self.function, self.group, self.num_workers = function, bool(group), int(num_workers)
        self.timeout_s, self.error_value = float(timeout_s), float(error_value)
        self.model_path, self.model_weight, self.rule_weight = model_path, float(model_weight), float(rule_weight)
        self.model_batch_size, self.model_device = int(model_batch_size), model_device
        self._log = log
        # the workers' cores: those of the thread creating the pool (moerl.train.components.reward_pool
        # creates it on rollout.cpu_affinity), also for a worker the dispatcher thread replaces later
        self._cpu_affinity = current_cpu_affinity()
        self._lock = threading.Lock()
        self._ready_cv = threading.Condition(self._lock)
        self._stats = {"scored": 0, "timeouts": 0, "exceptions": 0, "crashes": 0, "respawns": 0, "tasks": 0,
                       "seconds": 0.0}
        self._tids = itertools.count()
        self._closed = False
        self._broken: Optional[Exception] = None
        self._inline_model: Any = None
        self._queues: dict[str, collections.deque] = {"rule": collections.deque(), "model": collections.deque()}
        self._procs: list[_Proc] = []
        self._start_failures = 0
        self._thread: Optional[threading.Thread] = None
        if self.num_workers == 0:
            return
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)  # a full buffer already holds a pending wake-up
        for _ in range(self.num_workers):
            self._procs.append(self._spawn("rule"))
        if model_path is not None:
            self._procs.append(self._spawn("model"))
        self._thread = threading.Thread(target=self._dispatch_loop, name="moerl-reward-pool", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ public API

    def stats(self) -> dict[str, float]:
        """Counters since construction: ``scored`` (samples given a result, errors included),
        ``timeouts``, ``exceptions``, ``crashes`` (events; one per culprit response, or per group task with
        ``group=True``; a chunk of several responses that times out or crashes is not counted itself, its
        responses are scored again and the culprit counts), ``respawns`` (workers replaced, including
        those of a failed chunk), ``tasks`` (task messages sent to worker processes: a chunk of a group's
        responses, a group, an evaluation item, a response scored again, a reward-model call; 0 inline),
        ``seconds`` (summed wall time of the scoring calls)."""
        with self._lock:
            return dict(self._stats)

    def wait_ready(self, timeout: Optional[float] = None) -> None:
        """Block until every worker has started (spec resolved, reward model loaded).

        Raises:
            RewardConfigError / RuntimeError: a worker could not start (the message says why).
            TimeoutError: not ready within ``timeout`` seconds.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._ready_cv:
            while True:
                if self._broken is not None:
                    raise self._broken
                if self._closed:  # close() notifies: no wait for workers that will never start
                    raise RuntimeError("RewardPool is closed")
                if all(p.ready for p in self._procs):
                    return
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(f"reward workers not ready after {timeout} s")
                self._ready_cv.wait(left)

    def score_group(self, uid: str, prompt: Any, responses: Sequence[str], label: str,
                    metadata: Any = None) -> list[RewardResult]:
        """Score the responses of one prompt (blocking). One ``RewardResult`` per response, in order.

        Args:
            uid: the group's id, used in log lines (``uid[i]`` names sample i, ``uid[a..b]`` a chunk of
                samples a to b sent as one task).
            prompt: the prompt text or chat messages; only the reward model reads it.
            responses: the group's decoded responses (``n_samples_per_prompt`` of them).
            label: the gold answer / label text.
            metadata: dict or JSON object string (see ``as_metadata``), passed to the function.

        Raises:
            RewardValueError: ``metadata`` is neither a dict nor a JSON object string.
            RuntimeError: the pool is closed, or the reward model failed.
            RewardConfigError: the workers could not start.
        """
        t0 = time.perf_counter()
        if self.num_workers == 0:
            out = self._score_inline(uid, prompt, list(responses), label, as_metadata(metadata))
        else:
            rule, model = self._submit_group(uid, prompt, list(responses), label, as_metadata(metadata))
            futures.wait(rule)  # one wake-up when the last one is done (f.result() in turn: one per sample)
            out = self._collect(uid, len(responses), [f.result() for f in rule],
                                None if model is None else model.result())
        self._add_seconds(time.perf_counter() - t0)
        return out

    async def ascore_group(self, uid: str, prompt: Any, responses: Sequence[str], label: str,
                           metadata: Any = None) -> list[RewardResult]:
        """``score_group`` for an asyncio event loop: awaits the workers' results without blocking the
        loop (inline mode runs in the loop's default executor). Same arguments, result and errors."""
        if self.num_workers == 0:
            return await asyncio.get_running_loop().run_in_executor(
                None, self.score_group, uid, prompt, responses, label, metadata)
        t0 = time.perf_counter()
        rule, model = self._submit_group(uid, prompt, list(responses), label, as_metadata(metadata))
        rule_out = await asyncio.gather(*(asyncio.wrap_future(f) for f in rule))
        model_out = None if model is None else await asyncio.wrap_future(model)
        out = self._collect(uid, len(responses), list(rule_out), model_out)
        self._add_seconds(time.perf_counter() - t0)
        return out

    def score(self, items: Sequence[tuple[str, str, Any]]) -> list[RewardResult]:
        """Score ``(response, label, metadata)`` items (evaluation: one greedy response per prompt).
        The reward model is not applied (items have no prompt); samples are named ``eval[i]`` in logs.
        With ``group=True`` each item is scored as a group of one response (``fn([response], label,
        metadata)``), since an evaluation prompt has only one.

        Raises:
            RuntimeError / RewardValueError: as ``score_group``.
        """
        t0 = time.perf_counter()
        kind = "group" if self.group else "sample"
        items = [(([r] if self.group else r), l, as_metadata(m)) for r, l, m in items]
        if self.num_workers == 0:
            raw = [self._run_inline(kind, item, f"eval[{i}]") for i, item in enumerate(items)]
        else:
            futs = [self._submit("rule", kind, item, f"eval[{i}]", self.timeout_s) for i, item in enumerate(items)]
            raw = [f.result() for f in futs]
        if self.group:  # one value per group of one
            raw = [(None, err) if err else (v[0], None) for v, err in raw]
        out = [RewardResult(self.error_value, {}, err) if err else RewardResult(v[0], dict(v[1]))
               for v, err in raw]
        with self._lock:
            self._stats["scored"] += len(out)
        self._add_seconds(time.perf_counter() - t0)
        return out

    def close(self) -> None:
        """Stop the workers (closing their pipes, SIGKILL for any still running after 1 s) and fail
        pending calls with ``RuntimeError``. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._ready_cv.notify_all()
        if self._thread is not None:
            self._wake()
            self._thread.join()
            self._wake_r.close()
            self._wake_w.close()

    def __enter__(self) -> "RewardPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    # ------------------------------------------------------------------ submitting and collecting

    def _submit(self, queue: str, kind: str, payload: tuple, what: str, timeout: Optional[float],
                names: Optional[list[str]] = None) -> Future:
        task = _Task(next(self._tids), kind, payload, what, timeout, names)
        with self._lock:
            if self._closed:
                raise RuntimeError("RewardPool is closed")
            if self._broken is not None:
                raise self._broken
            self._queues[queue].append(task)
        self._wake()
        return task.future

    def _submit_group(self, uid, prompt, responses, label, metadata) -> tuple[list[Future], Optional[Future]]:
        model = None
        if self.model_path is not None:
            model = self._submit("model", "model", ([prompt] * len(responses), responses), uid, None)
        if self.group:
            rule = [self._submit("rule", "group", (responses, label, metadata), uid, self.timeout_s)]
        else:
            rule = []
            for a, b in _chunks(len(responses), self.num_workers):
                names = [f"{uid}[{i}]" for i in range(a, b)]
                what = names[0] if b - a == 1 else f"{uid}[{a}..{b - 1}]"
                rule.append(self._submit("rule", "samples", (responses[a:b], label, metadata), what,
                                         self.timeout_s * (b - a), names))
        return rule, model

    def _collect(self, uid: str, n: int, rule: list, model: Optional[tuple]) -> list[RewardResult]:
        """Turn raw task outcomes into n RewardResults: ``rule`` is ``[(value, error)]`` of the group task
        (group=True) or the chunks' lists of per-response ``(value, error)``, in order; + the model's."""
        if self.group:
            value, err = rule[0]
            pairs = [(None, err)] * n if err else [(v, None) for v in value]
        else:
            pairs = [p for chunk in rule for p in chunk]
        out = [RewardResult(self.error_value, {}, err) if err else RewardResult(v[0], dict(v[1]))
               for v, err in pairs]
        if model is not None:
            scores, err = model
            if err:
                raise RuntimeError(f"reward model reward.model_path={self.model_path!r} failed on group {uid}: {err}")
            for r, m in zip(out, scores):
                r.metrics.update(rule=r.score, model=m)
                r.score = self.rule_weight * r.score + self.model_weight * m
        with self._lock:
            self._stats["scored"] += n
        return out

    def _add_seconds(self, s: float) -> None:
        with self._lock:
            self._stats["seconds"] += s

    # ------------------------------------------------------------------ inline mode (num_workers=0)

    def _run_inline(self, kind: str, payload: tuple, what: str) -> tuple[Any, Optional[str]]:
        from moerl.rewards._worker import call_reward

        try:
            return call_reward(self._fn, kind, payload), None
        except Exception as e:  # noqa: BLE001 - a raising reward gets error_value
            err = f"exception: {e!r}"[:2000]
            self._event("exceptions", f"reward: {what} raised {e!r}; score = error_value {self.error_value:g}")
            return None, err

    def _score_inline(self, uid, prompt, responses, label, metadata) -> list[RewardResult]:
        if self.group:
            rule = [self._run_inline("group", (responses, label, metadata), uid)]
        else:  # the workers' code path: one "samples" task for the whole group
            from moerl.rewards._worker import call_reward

            outcomes = call_reward(self._fn, "samples", (responses, label, metadata))
            rule = [self._sample_pairs([f"{uid}[{i}]" for i in range(len(responses))], outcomes)]
        model = None
        if self.model_path is not None:
            try:
                if self._inline_model is None:
                    from moerl.rewards.model import RewardModel

                    self._inline_model = RewardModel(self.model_path, self.model_batch_size, device=self.model_device)
                model = (self._inline_model.score([prompt] * len(responses), responses), None)
            except RewardConfigError:
                raise
            except Exception as e:  # noqa: BLE001
                model = (None, f"exception: {e!r}")
        return self._collect(uid, len(responses), rule, model)

    # ------------------------------------------------------------------ the dispatcher thread

    def _event(self, counter: str, message: str) -> None:
        with self._lock:
            self._stats[counter] += 1
        self._say(message)

    def _say(self, message: str) -> None:
        try:
            self._log(message)
        except Exception:  # noqa: BLE001 - a broken logger must not lose a reward
            pass

    def _sample_pairs(self, names: list[str], outcomes: list[tuple[str, Any]]) -> list[tuple[Any, Optional[str]]]:
        """A "samples" task's per-response outcomes (``score_samples``) as ``(value, error)`` pairs; one
        "exceptions" event (counted and logged with the response's name) per raising response."""
        pairs: list[tuple[Any, Optional[str]]] = []
        for name, (status, value) in zip(names, outcomes):
            if status == "ok":
                pairs.append((value, None))
            else:
                self._event("exceptions", f"reward: {name} raised {value}; score = error_value {self.error_value:g}")
                pairs.append((None, f"exception: {value}"))
        return pairs

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"x")
        except (BlockingIOError, OSError):
            pass  # the buffer is full of wake-ups already, or the pool is closing

    def _spawn(self, kind: str) -> _Proc:
        init = {"kind": kind, "function": self.function, "group": self.group, "model_path": self.model_path,
                "batch_size": self.model_batch_size, "device": self.model_device, "sys_path": list(sys.path),
                "parent_pid": os.getpid()}
        return _Proc(kind, init, self._cpu_affinity)

    def _replace(self, proc: _Proc) -> None:
        with self._lock:
            if proc in self._procs:
                self._procs.remove(proc)
            if self._closed or self._broken is not None:
                return
        new = self._spawn(proc.kind)
        with self._lock:
            self._procs.append(new)
            self._stats["respawns"] += 1

    def _finish(self, proc: _Proc, result: Any) -> None:
        """Hand ``result`` (see ``_Task``) to the future of ``proc``'s task; the worker is free again."""
        task, proc.task, proc.deadline = proc.task, None, None
        if task is not None and not task.future.done():
            task.future.set_result(result)

    def _fail(self, proc: _Proc, err: str) -> None:
        """``proc``'s task timed out or its worker died (already logged, counted and replaced): the task
        gets ``err``, except a chunk of several responses, which is scored again one response per task."""
        task = proc.task
        if task is not None and task.chunk:
            proc.task, proc.deadline = None, None
            self._rescore(task)
        elif task is not None and task.kind == "samples":
            self._finish(proc, [(None, err)])
        else:
            self._finish(proc, (None, err))

    def _rescore(self, chunk: _Task) -> None:
        """Queue the responses of a failed ``chunk`` again, one "samples" task of one response each (limit
        ``timeout_s``), ahead of the waiting tasks; the chunk's future gets their pairs, in order, once all
        are done (or the first exception among them, should the pool close or break meanwhile)."""
        responses, label, metadata = chunk.payload
        subs = [_Task(next(self._tids), "samples", ([r], label, metadata), name, self.timeout_s, [name])
                for r, name in zip(responses, chunk.names)]
        left = [len(subs)]
        lock = threading.Lock()

        def one_done(_: Future) -> None:
            with lock:
                left[0] -= 1
                if left[0]:
                    return
            try:
                out = [p for t in subs for p in t.future.result()]
            except BaseException as e:  # noqa: BLE001 - the pool closed or broke: the caller sees why
                chunk.future.set_exception(e)
                return
            chunk.future.set_result(out)

        for t in subs:
            t.future.add_done_callback(one_done)
        with self._lock:
            stop = RuntimeError("RewardPool is closed") if self._closed else self._broken
            if stop is None:
                self._queues["rule"].extendleft(reversed(subs))
        if stop is not None:
            for t in subs:
                t.future.set_exception(stop)

    def _set_broken(self, exc: Exception) -> None:
        with self._ready_cv:
            self._broken = exc
            self._ready_cv.notify_all()
            pending = [t for q in self._queues.values() for t in q]
            for q in self._queues.values():
                q.clear()
        for t in pending:
            t.future.set_exception(exc)
        for p in list(self._procs):
            if p.task is not None:
                p.task.future.set_exception(exc)
                p.task = None
            p.kill()
        with self._lock:
            self._procs.clear()

    def _on_death(self, proc: _Proc) -> None:
        code = proc.exit_code()
        task = proc.task
        chunk = task is not None and task.chunk
        if task is None and not proc.ready and not self._closed:
            self._start_failures += 1
            if self._start_failures >= _MAX_START_FAILURES:
                self._set_broken(RuntimeError(
                    f"reward {proc.kind} workers exit during start-up (exit code {code}, {self._start_failures} times "
                    "in a row); see their stderr above"))
                return
        if task is not None and task.kind == "model":
            self._log(f"reward: the reward-model worker died (exit code {code}) while scoring {task.what}; "
                      "restarting it")
        elif chunk:  # the culprit is unknown: not counted here; rescoring finds and counts it
            self._say(f"reward: worker died (exit code {code}) while scoring the chunk {task.what} "
                      f"({len(task.names)} samples); replaced; scoring them again one at a time")
        elif task is not None:
            self._event("crashes", f"reward: worker died (exit code {code}) while scoring {task.what}; "
                                   f"replaced; score = error_value {self.error_value:g}")
        proc.kill()
        self._replace(proc)  # before the result is handed out, so stats() already counts the respawn
        self._fail(proc, f"worker died (exit code {code})")

    def _on_message(self, proc: _Proc) -> None:
        try:
            msg = proc.conn.recv()
        except (EOFError, OSError):
            self._on_death(proc)
            return
        if msg[0] == "ready":
            self._start_failures = 0
            with self._ready_cv:
                proc.ready = True
                self._ready_cv.notify_all()
            return
        if msg[0] == "init_error":
            key = "reward.model_path" if proc.kind == "model" else "reward.function"
            self._set_broken(RewardConfigError(f"a reward worker could not start ({key}): {msg[1]}"))
            return
        tid, status, value = msg
        task = proc.task
        if task is None or task.tid != tid:
            return  # a stale answer (cannot happen with one task per worker at a time)
        if task.kind == "samples":
            if status == "ok":
                self._finish(proc, self._sample_pairs(task.names, value))
            elif task.chunk:  # the task itself raised (not one response): score them one at a time
                self._say(f"reward: the chunk {task.what} ({len(task.names)} samples) raised {value}; "
                          "scoring them again one at a time")
                self._fail(proc, f"exception: {value}")
            else:
                self._finish(proc, self._sample_pairs(task.names, [(status, value)]))
        elif status == "ok":
            self._finish(proc, (value, None))
        else:
            if task.kind != "model":
                self._event("exceptions", f"reward: {task.what} raised {value}; score = error_value "
                                          f"{self.error_value:g}")
            self._finish(proc, (None, f"exception: {value}"))

    def _assign(self) -> None:
        for proc in list(self._procs):
            if not proc.ready or proc.task is not None:
                continue
            with self._lock:
                queue = self._queues[proc.kind]
                if not queue:
                    continue
                task = queue.popleft()
            try:
                proc.conn.send((task.tid, task.kind, task.payload))
            except (OSError, ValueError):  # died while idle: give the task back, replace the worker
                with self._lock:
                    self._queues[proc.kind].appendleft(task)
                self._on_death(proc)
                continue
            proc.task = task
            proc.deadline = None if task.timeout is None else time.monotonic() + task.timeout
            with self._lock:
                self._stats["tasks"] += 1

    def _expire(self) -> None:
        now = time.monotonic()
        for proc in list(self._procs):
            if proc.deadline is not None and now >= proc.deadline:
                task = proc.task
                proc.kill()
                if task.chunk:  # the culprit is unknown: rescoring counts it
                    self._say(f"reward: the chunk {task.what} ({len(task.names)} samples) timed out after "
                              f"{task.timeout:g} s (reward.timeout_s x {len(task.names)}); worker killed and "
                              "replaced; scoring them again one at a time")
                else:
                    self._event("timeouts", f"reward: {task.what} timed out after {task.timeout:g} s "
                                            f"(reward.timeout_s); worker killed and replaced; score = error_value "
                                            f"{self.error_value:g}")
                self._replace(proc)
                self._fail(proc, "timeout")

    def _selector(self, sel: Optional[selectors.BaseSelector], procs: tuple) -> tuple[selectors.BaseSelector, tuple]:
        """The dispatcher's selector over the wake-up socket and the workers' pipes, rebuilt only when the
        worker list changed (a replacement): one persistent selector instead of a new one per wait (which
        was most of the dispatcher's CPU: one per message, two messages per sample)."""
        now = tuple(self._procs)
        if sel is not None and now == procs:
            return sel, procs
        if sel is not None:
            sel.close()
        sel = selectors.DefaultSelector()
        sel.register(self._wake_r, selectors.EVENT_READ, None)
        for p in now:
            if not p.conn.closed:
                sel.register(p.conn, selectors.EVENT_READ, p)
        return sel, now

    def _dispatch_loop(self) -> None:
        sel: Optional[selectors.BaseSelector] = None
        procs: tuple = ()
        try:
            while not self._closed:
                self._assign()
                deadlines = [p.deadline for p in self._procs if p.deadline is not None]
                timeout = None if not deadlines else max(0.0, min(deadlines) - time.monotonic())
                sel, procs = self._selector(sel, procs)
                for key, _ in sel.select(timeout):
                    proc = key.data
                    if proc is None:  # the wake-up socket
                        try:
                            while self._wake_r.recv(4096):
                                pass
                        except (BlockingIOError, OSError):
                            pass
                    elif proc in self._procs and not proc.conn.closed:  # not replaced by an earlier message
                        self._on_message(proc)
                self._expire()
        except BaseException as e:  # noqa: BLE001 - never leave callers waiting forever
            self._set_broken(RuntimeError(f"reward pool dispatcher failed: {e!r}"))
            raise
        finally:
            if sel is not None:
                sel.close()
            self._shutdown()

    def _shutdown(self) -> None:
        closed = RuntimeError("RewardPool is closed")
        with self._lock:
            pending = [t for q in self._queues.values() for t in q]
            for q in self._queues.values():
                q.clear()
        for t in pending:
            if not t.future.done():
                t.future.set_exception(closed)
        with self._lock:
            procs, self._procs = list(self._procs), []
        for p in procs:
            if p.task is not None and not p.task.future.done():
                p.task.future.set_exception(closed)
            try:
                p.conn.send(None)
            except (OSError, ValueError):
                pass
        end = time.monotonic() + 1.0
        for p in procs:
            try:
                p.popen.wait(timeout=max(0.0, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            p.kill()


def reward_pool_from_config(r, cls=None, log: Callable[[str], Any] = print):
    """A RewardPool (or ``cls``: moerl.rewards.RewardBroker, same arguments) of the recipe's ``reward``
    section ``r`` (function, group, num_workers, timeout_s, error_value, model_path, model_weight,
    rule_weight, model_batch_size). Raises what the pool's constructor raises (RewardConfigError)."""
    return (cls or RewardPool)(r.function, group=r.group, num_workers=r.num_workers, timeout_s=r.timeout_s,
                               error_value=r.error_value, model_path=r.model_path, model_weight=r.model_weight,
                               rule_weight=r.rule_weight, model_batch_size=r.model_batch_size, log=log)

"""RolloutManager: the one place that talks to the rollout servers for RL, in every train.mode.

It draws prompt groups, generates their ``n_samples_per_prompt`` responses (rollout.group_requests: one
batched request per group straight to a server, the default with the reference backend; else one request per
sample through the router, or with routing replay R3 straight to the servers), scores them, and hands the
trainer whole batches of groups;
it also wraps every weight update (pause / drain, push, continue). sync, one_step_off and async are the
same producer with a different *gate* (when may the next group start) and a different weight-update
wrapper:

==============  ==========================================  ===========================================
train.mode      a group for batch b may start when          a weight update after step k
==============  ==========================================  ===========================================
sync            the trainer asked for batch b               pushes (nothing is in flight)
one_step_off    b <= k_done + 1 + max_staleness             waits until no group is in flight, pushes
async (wait)    b <= k_done + 1 + max_staleness             holds new requests; with a group in flight
                                                            pauses the servers (rollout.pause_mode),
                                                            pushes, continues; with abort, cut responses
                                                            resume from their prefix
async (drop)    b <= k_done + 2 + max_staleness             same as async (wait)
==============  ==========================================  ===========================================

``k_done`` is the number of steps whose update has been pushed, and a group's batch b is bounded by
``batches taken + groups ahead of it in the FIFO // rollout_batch_size + 1`` (every batch takes at least
rollout_batch_size groups). A group that starts under version V_now therefore trains at a step whose
weights are at most ``b - 1 - k_done <= max_staleness`` versions newer: the ``wait`` gate alone keeps the
bound (AReaL's capacity rule, arXiv 2505.24298 sec. 5). ``drop`` lets the producer run one batch further
ahead (the servers wait less for the trainer); what exceeds the bound when it is taken is dropped and
replaced by the next group in the FIFO, so every step still trains rollout_batch_size groups, at the cost
of the dropped generations (counted). Both check every group when it is taken (staleness = trainer
version - oldest version among its trained tokens; over the bound: dropped and counted), the last line
of defence. A trainer that waits for a batch whose
groups are not started yet always gets them started (they train at the current version: staleness 0).

Groups are consumed in draw order (FIFO): batch b is the next rollout_batch_size groups (or, with
rollout.dynamic_sampling, the next groups until rollout_batch_size of them have reward variance, at most
max_oversample_factor * rollout_batch_size drawn). So the same seed gives the same batches in every mode
up to which weights generated them, and async with max_staleness 0 reproduces sync step for step.

Partial rollouts (async): a weight update aborts the running requests (SGLang ``/pause_generation``
mode abort); each cut response is continued after ``/continue_generation`` from its prefix (prompt +
tokens so far) with the remaining ``max_new_tokens`` budget. Every response token keeps the behaviour
log-prob and the weight version of the segment that produced it (``Sample.token_versions``). With
train.partial_rollout_mask_old tokens older than the response's newest version leave the loss. A response
is scored only when it finished (stop token or length); a cut one is never scored as complete.

Per-request sampling seeds are ``sampling_seed(seed, draw, group, sample)`` (the first segment, as the
synchronous loop always used) and ``sampling_seed(seed, draw, group, sample, prefix_length)`` for
continuations of a response that already has tokens;
request ids ``s{draw}-g{group}-{sample}`` (+ ``-r{segment}``), unique, so a retried request (failover) is
neither lost nor counted twice.

Checkpoints (``state_dict``): the buffer and the requests in flight are NOT saved: a resume drops them
and regenerates them from the oldest group not yet taken (the sampler state before its draw and its index
in the draw are saved), with the same seeds. Sync mode has nothing in flight at a checkpoint, so kill -9 +
resume is bit-identical there; in async mode the regenerated groups use the resumed weights, and no group
is taken twice or skipped.

Threads: the producer is an asyncio loop in one daemon thread of the process that holds the manager: the
trainer's rank 0, or with rollout.producer_process (null: in one_step_off / async) a child process of it
(moerl.rollout.producer_process drives ``get_batch``, ``begin_push`` / ``hold_for_push`` / ``end_push`` and
``state_dict`` there); ``get_batch`` and ``update_weights`` are called from the training thread.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import json
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

from moerl.rollout.client import (SAMPLING_PARAM_FIELDS, RolloutClient, check_result_id, check_result_ids,
                                  parse_generate_item)
from moerl.rollout.errors import RolloutRequestError, RolloutRequestRefusedError
from moerl.types import Sample

#: continuations allowed per response before its group is given up (counted, never trained)
MAX_SEGMENTS = 16
#: the trainer process's GIL switch interval (s) while the producer thread overlaps training (one_step_off /
#: async; Python's default is 5 ms; restored by close()). The trainer's main thread releases the GIL around
#: every torch op; the producer (asyncio loop: request building, reward dispatch) takes it and keeps it up to
#: the interval before the main thread gets it back. tools/bench_async.py (pinned, 40 steps, async staleness
#: 1): the update took 1.34x as long as in sync with 5 ms (one run), 1.16-1.21x with 0.5 ms (two runs) and
#: 1.17-1.27x with 0.1 ms (three runs): noisy single runs that do not separate 0.1 from 0.5 ms, so the
#: milder 0.5 ms. (Measured while the producer thread ran on the rollout core; it now stays on the trainer's,
#: see moerl.runtime.procs.pinned, and the interval was not measured again.)
PRODUCER_SWITCH_INTERVAL_S = 0.0005


def sampling_seed(seed: int, *keys: int) -> int:
    """A stable 31-bit per-request sampling seed from the run seed and integer keys (draw, group,
    sample[, segment]): the same run reproduces the same samples whichever server serves a request."""
    import hashlib

    h = hashlib.sha256(("/".join(str(k) for k in (seed,) + keys)).encode()).digest()
    return int.from_bytes(h[:4], "little") & 0x7FFFFFFF


def background_push(cfg) -> bool:
    """rollout.background_push resolved: null = on in one_step_off / async, except with an NCCL weight-update
    group (its broadcast on the push thread could run concurrently with the trainer's own NCCL collectives:
    unordered communicators may deadlock); never in sync."""
    ro = cfg.rollout
    bg = getattr(ro, "background_push", None)
    if bg is None:
        bg = not (getattr(ro, "weight_sync", None) == "distributed"
                  and getattr(ro, "weight_sync_backend", "gloo") == "nccl")
    return bool(bg) and cfg.train.mode != "sync"


def pause_mode(ro) -> str:
    """rollout.pause_mode resolved: auto = in_place with the reference backend, abort with sglang."""
    mode = getattr(ro, "pause_mode", "abort")
    if mode == "auto":
        return "in_place" if getattr(ro, "backend", "reference") == "reference" else "abort"
    return mode


def _version_int(v: Any, fallback: int) -> int:
    try:
        return int(v)
    except (TypeError, ValueError):
        return fallback


@dataclass
class _Partial:
    """One response being generated: its tokens, behaviour log-probs and per-token versions so far, the
    segments (requests) that produced them, and the last answer (item, raw result)."""

    tokens: list = field(default_factory=list)
    lps: list = field(default_factory=list)
    versions: list = field(default_factory=list)
    segments: int = 0
    item: Any = None
    out: Any = None


@dataclass
class _Group:
    draw: int  # 1-based draw of rollout_batch_size prompts (== step when every batch is one draw)
    index: int  # group index inside its draw
    row: dict
    prompt_ids: list[int]
    samples: Optional[list[Sample]] = None  # set when every response finished (or the group failed)
    failed: Optional[str] = None  # why the group cannot be trained (e.g. MAX_SEGMENTS continuations)

    @property
    def uid(self) -> str:
        return f"{self.draw}-{self.index}"


@dataclass
class RolloutBatch:
    """What ``RolloutManager.get_batch`` hands the trainer for one step.

    groups: the taken groups, each a list of n_samples_per_prompt scored Samples (draw order);
    trainer_version: the weight version the update starts from (int);
    metrics: rollout metrics of this batch (python floats; see RolloutManager.get_batch).
    """

    groups: list[list[Sample]]
    trainer_version: int
    metrics: dict = field(default_factory=dict)

    @property
    def samples(self) -> list[Sample]:
        return [s for g in self.groups for s in g]

    def write_jsonl(self, path, step: int) -> None:
        """Append one line per sample to ``path`` (log.samples): step, uid (draw-group-sample), reward,
        status, trainer version, per-token weight versions and loss mask, segments (1 + resumptions), pid
        (the process: a resumed run writes its steps again under another pid)."""
        with open(path, "a") as f:
            for s in self.samples:
                f.write(json.dumps({"step": step, "uid": s.metadata.get("uid"), "reward": s.reward,
                                    "status": s.status, "trainer_version": self.trainer_version,
                                    "token_versions": s.token_versions, "loss_mask": s.loss_mask,
                                    "segments": s.metadata.get("segments", 1), "pid": os.getpid()}) + "\n")


class _PushWaiter:
    """wait_weights() of an object whose background weight push runs on ``self._push_thread`` and leaves
    its error in ``self._push_error``."""

    _push_thread: Optional[threading.Thread] = None
    _push_error: Optional[BaseException] = None

    def wait_weights(self) -> None:
        """Block until a background weight push has landed (no-op without one). Call before the next
        export, a checkpoint or an eval. Raises what the push raised (once)."""
        t = self._push_thread
        if t is not None:
            t.join()
            self._push_thread = None
        err, self._push_error = self._push_error, None
        if err is not None:
            raise err


def paused_push(cluster, pause_mode: str, push: Callable[[], Any], t0: float) -> tuple[Any, tuple[float, float, float]]:
    """One weight push, with the servers paused around it when ``cluster`` is given (async; None: no pause):
    ``cluster.pause_generation(pause_mode)``, ``push()``, ``cluster.continue_generation()``. ``t0``: when the
    update started (monotonic s; the pause time counts from it). Returns (push()'s version, (pause_s, push_s,
    continue_s)).

    Raises:
        what the pause, the push or the continue raised; after a failed pause or push the servers are
        continued (best effort: the first error is the one raised).
    """
    try:
        if cluster is not None:
            cluster.pause_generation(pause_mode)
        t1 = time.monotonic()
        version = push()
        t2 = time.monotonic()
    except BaseException:
        if cluster is not None:
            try:
                cluster.continue_generation()
            except Exception:
                pass
        raise
    if cluster is not None:
        cluster.continue_generation()
    return version, (t1 - t0, t2 - t1, time.monotonic() - t2)


class RolloutManager(_PushWaiter):
    """Buffer, producer, weight versions and pause/continue for every train.mode (module docstring).

    Args:
        client: RolloutClient on the router (``cluster`` is its failover-aware cluster or None).
        cluster: RolloutCluster (or None): pause_generation / continue_generation / live_server_urls.
        sampler: PromptSampler of the RL prompts (rollout_batch_size rows per draw).
        encode, decode: prompt text -> token ids; response ids -> text.
        reward_fn: a moerl.rewards.RewardPool (``ascore_group``: sandboxed, timed out, group functions,
            reward models), or a plain (response text, label) -> float.
        cfg: the RecipeConfig (rollout, train, algorithm, data sections are read).
        eos_id: stop token id.
        num_steps: last step that takes a batch (no group is drawn beyond it).
        version: weight version of the servers now (int).
        steps_done: steps already trained and pushed (resume).
        state: ``state_dict()`` of a checkpoint, or None.
        routing_shape: (num_hidden_layers, num_experts_per_tok) to record routed experts (R3), or None.
        log: line printer.
    Raises:
        ValueError: train.mode async / one_step_off with rollout.placement colocated.
    """

    def __init__(self, *, client, cluster, sampler, encode: Callable[[str], list[int]],
                 decode: Callable[[list[int]], str], reward_fn: Callable[[str, str], float], cfg, eos_id: int,
                 num_steps: int, version: int, steps_done: int = 0, state: Optional[dict] = None,
                 routing_shape: Optional[tuple[int, int]] = None, log: Callable[[str], None] = print):
        tr, ro = cfg.train, cfg.rollout
        if tr.mode != "sync" and ro.placement == "colocated":
            raise ValueError(f"train.mode={tr.mode} overlaps rollout and training, which needs separate devices: "
                             "set rollout.placement=disaggregated or train.mode=sync")
        algo = getattr(cfg, "algorithm", None)
        if tr.mode != "sync" and tr.max_staleness > 0 and getattr(algo, "off_policy_correction", "none") == "none":
            versions = "version" if tr.max_staleness == 1 else "versions"
            log(f"WARNING: train.mode={tr.mode} trains on tokens up to {tr.max_staleness} {versions} old without an "
                "importance correction (algorithm.off_policy_correction=none); on the demo that cost 5-7 points of "
                "greedy accuracy at staleness 1 (tools/bench_async.py); consider algorithm.off_policy_correction="
                "icepop, tis or decoupled")
        self.client, self.cluster, self.sampler = client, cluster, sampler
        self.encode, self.decode, self.reward_fn, self.log = encode, decode, reward_fn, log
        self.mode, self.policy = tr.mode, tr.staleness_policy
        self.max_staleness = 0 if tr.mode == "sync" else tr.max_staleness
        self.mask_old = tr.partial_rollout_mask_old
        self.n, self.B = ro.n_samples_per_prompt, ro.rollout_batch_size
        self.dynamic = ro.dynamic_sampling
        # groups one batch may draw: dynamic sampling's cap, else room to replace stale / failed groups
        self.max_draw = max(self.B, int(ro.max_oversample_factor * self.B)) if self.dynamic else 4 * self.B
        # rollout.max_inflight_groups (AReaL's max_concurrent_rollouts): groups generating at once, null =
        # rollout_batch_size (every group in flight finishes, so a held group always starts eventually)
        cap = getattr(ro, "max_inflight_groups", None)
        self.max_inflight = self.B if cap is None else int(cap)
        # rollout.aligned_batches: a draw's groups start together (see the schema); null = reference backend
        aligned = getattr(ro, "aligned_batches", None)
        if aligned is None:
            aligned = getattr(ro, "backend", "reference") == "reference"
        self.aligned = bool(aligned) and tr.mode != "sync" and self.max_inflight >= self.B  # below B: waves
        self._started_draw = 0  # draw of the last group started
        self.prompt_key, self.label_key = cfg.data.prompt_key, cfg.data.label_key
        self.seed, self.max_new = cfg.seed, ro.max_new_tokens
        self.sampling_params = dict(temperature=ro.temperature, top_p=ro.top_p, top_k=ro.top_k,
                                    max_new_tokens=ro.max_new_tokens, stop_token_ids=[eos_id])
        assert set(self.sampling_params) <= SAMPLING_PARAM_FIELDS
        self.routing_shape = routing_shape
        self._direct: dict[str, RolloutClient] = {}  # clients of single servers (closed with the producer)
        # rollout.group_requests: one batched /generate per group, straight to a server (see _to_server);
        # null = on with the reference backend (its per-request HTTP cost is most of a step's rollout CPU)
        group = getattr(ro, "group_requests", None)
        self.group_requests = (getattr(ro, "backend", "reference") == "reference") if group is None else bool(group)
        self.failover_wait_s = 2.0 * float(getattr(ro, "startup_timeout_s", 120.0))  # see _to_server
        # how a weight update pauses the servers in async mode (rollout.pause_mode): abort cuts running
        # responses (resumed from their prefix: partial rollouts); in_place suspends the reference server's
        # running batch at its next decode step and goes on under the new weights after the push (the
        # server reports each token's version; SGLang's in_place would mix versions inside a response
        # unseen, so the schema refuses it with backend sglang); auto = in_place with the reference
        # backend, abort with sglang
        self.pause_mode = pause_mode(ro)
        # rollout.cpu_affinity: the cores of the producer's HTTP worker process. The producer and push THREADS
        # stay on the trainer's cores: they share its interpreter lock, and a thread holding it while a
        # server preempts it on the rollout core stalls training (moerl.runtime.procs.pinned)
        self.cpu_affinity = list(getattr(ro, "cpu_affinity", None) or [])
        # rollout.client_process: the producer's HTTP attempts in a child process (moerl.rollout.http_worker)
        use = getattr(ro, "client_process", None)
        self.client_process = tr.mode != "sync" if use is None else bool(use)
        self._worker = None  # the HttpWorker while the producer runs
        # rollout.background_push: a weight update's pause / push / continue on a thread of its own while the
        # trainer goes on (one at a time; wait_weights() joins it)
        self.background_push = background_push(cfg)
        self._push_thread: Optional[threading.Thread] = None
        self._push_error: Optional[BaseException] = None
        self._pushing = False  # a background push has not landed yet (steps_done lags self.version)
        self.num_steps = num_steps
        self.version = int(version)
        self.steps_done = steps_done  # steps trained and pushed (k_done)
        self.batches_taken = steps_done
        self.requested = steps_done  # highest batch get_batch asked for
        # FIFO of groups not yet taken (draw order); rows of the current draw not yet made groups
        self._fifo: collections.deque[_Group] = collections.deque()
        self._rows: collections.deque[tuple[int, int, dict]] = collections.deque()
        self._draw = steps_done  # draws made so far (one per step unless dynamic sampling; see state)
        self._snapshots: dict[int, dict] = {}  # draw -> sampler state before it (for the resume cursor)
        if state:
            sampler.load_state_dict(state["sampler"])
            self._draw = int(state["draw"]) - 1
            self._skip = int(state["skip"])
        else:
            self._skip = 0
        self._cv = threading.Condition()
        self._need = self.B  # groups the batch in progress (or the next one) still takes at least
        self._waiting = False  # the trainer waits in get_batch
        self._inflight = 0  # groups started and not finished
        self._active_requests = 0
        self._counters = collections.Counter()
        self._busy_since: Optional[float] = None  # server-side activity (some request in flight)
        self._busy_s = 0.0
        self._t0 = time.monotonic()
        self._error: Optional[BaseException] = None
        self._closed = False
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._unpaused: Optional[asyncio.Event] = None
        self._wake: Optional[asyncio.Event] = None
        self._thread: Optional[threading.Thread] = None
        self._switch_interval_before: Optional[float] = None  # sys.getswitchinterval() before start()

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> "RolloutManager":
        """Start the producer thread (returns self). In one_step_off / async it lowers the process's GIL
        switch interval to :data:`PRODUCER_SWITCH_INTERVAL_S` (``sys.setswitchinterval``) if it is longer,
        until :meth:`close`."""
        ready = threading.Event()
        if self.mode != "sync" and sys.getswitchinterval() > PRODUCER_SWITCH_INTERVAL_S:
            self._switch_interval_before = sys.getswitchinterval()
            sys.setswitchinterval(PRODUCER_SWITCH_INTERVAL_S)

        def run() -> None:
            loop = asyncio.new_event_loop()
            asyncio.set_event_loop(loop)
            self._loop = loop
            self._unpaused, self._wake = asyncio.Event(), asyncio.Event()
            self._unpaused.set()
            try:
                if self.client_process and isinstance(self.client, RolloutClient):
                    from moerl.rollout.http_worker import HttpWorker

                    self._worker = HttpWorker(timeout_s=self.client.timeout_s, cpu_affinity=self.cpu_affinity).start()
                    self.client.worker = self._worker
            except BaseException as e:  # surfaces in get_batch
                self._error = e
            ready.set()
            try:
                if self._error is None:
                    loop.run_until_complete(self._produce())
            except BaseException as e:  # surfaces in get_batch
                with self._cv:
                    self._error = self._error or e
                    self._cv.notify_all()
            finally:
                try:
                    pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
                    for t in pending:
                        t.cancel()
                    loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
                    for c in [self.client, *self._direct.values()]:
                        closer = getattr(c, "aclose", None)
                        if closer is not None:
                            loop.run_until_complete(closer())
                    if self._worker is not None:
                        self._worker.close()
                        if getattr(self.client, "worker", None) is self._worker:
                            self.client.worker = None
                finally:
                    loop.close()

        self._thread = threading.Thread(target=run, name="moerl-rollout-producer", daemon=True)
        self._thread.start()
        ready.wait()
        return self

    def close(self) -> None:
        """Stop the producer (requests in flight are abandoned; their groups are never trained) after a
        background push in flight has landed (its error, if any, is logged: the run is ending anyway)."""
        try:
            self.wait_weights()
        except Exception as e:
            if e is not self._error:  # not already raised by get_batch
                self.log(f"WARNING: the last weight push failed: {type(e).__name__}: {e}")
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._kick()
        if self._producing():  # a producer parked on a pause must see the close too
            self._loop.call_soon_threadsafe(self._unpaused.set)
        if self._thread is not None:
            self._thread.join(timeout=30)
        before, self._switch_interval_before = self._switch_interval_before, None
        if before is not None and abs(sys.getswitchinterval() - PRODUCER_SWITCH_INTERVAL_S) < 1e-9:  # still ours
            sys.setswitchinterval(before)

    def __enter__(self) -> "RolloutManager":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def _kick(self) -> None:
        if self._loop is not None and self._wake is not None and not self._loop.is_closed():
            try:
                self._loop.call_soon_threadsafe(self._wake.set)
            except RuntimeError:  # loop already closed
                pass

    # ------------------------------------------------------------------ gate
    def _limit(self) -> int:
        """Highest batch a new group may belong to under the staleness rule (module docstring)."""
        if self.mode == "sync":
            return self.requested
        ahead = 1 if self.policy == "drop" and self.mode == "async" else 0
        return self.steps_done + 1 + self.max_staleness + ahead

    def _next_batch_bound(self) -> int:
        """Under self._cv: the highest batch the next new group can end up in. The batch in progress
        (batches_taken + 1) still takes at least ``self._need`` groups from the FIFO and every later
        batch at least rollout_batch_size, so a group with ``ahead`` groups before it lands at most in
        batch batches_taken + 1 + max(0, ahead - need + B) // B."""
        ahead = len(self._fifo)
        return self.batches_taken + 1 + max(0, ahead - self._need + self.B) // self.B

    def _may_start(self) -> bool:
        """Called under self._cv."""
        if self.mode == "one_step_off" and self._pushing:  # one_step_off pushes with nothing in flight
            return False
        # the trainer waits for unstarted groups: start them (under its weights: not while a push is in flight)
        demand = self._waiting and len(self._fifo) < self._need and not self._pushing
        bound = self._next_batch_bound()
        if bound > self.num_steps:
            return demand
        if self._inflight >= self.max_inflight:  # rollout.max_inflight_groups (a finishing group frees a slot)
            return False
        if self.aligned and self._inflight > max(0, self.max_inflight - self.B) and self._starts_a_draw():
            return False  # rollout.aligned_batches: a draw's first group waits until the whole draw can start
        return bound <= self._limit() or demand

    async def _produce(self) -> None:
        held_since: Optional[float] = None  # the staleness gate holds the next group back since then
        while True:
            self._wake.clear()  # cleared before the check: a kick after it is never lost
            with self._cv:
                if self._closed:
                    return
                grp = None
                if self._may_start():
                    grp = self._next_group()
                    self._fifo.append(grp)
                    self._inflight += 1
                    if held_since is not None:
                        self._counters["waited_groups"] += 1
                        self._counters["wait_s"] += time.monotonic() - held_since
                        held_since = None
                elif held_since is None and self._held_by_staleness():
                    held_since = time.monotonic()
            if grp is None:
                await self._wake.wait()
                continue
            await self._unpaused.wait()
            asyncio.ensure_future(self._run_group(grp))

    def _starts_a_draw(self) -> bool:
        """Under self._cv: the next group would be the first started of its draw."""
        return (self._rows[0][0] if self._rows else self._draw + 1) != self._started_draw

    def _held_by_staleness(self) -> bool:
        """Under self._cv: only the staleness bound (not sync demand or the end of the run) holds the
        next group back."""
        return self.mode != "sync" and self._next_batch_bound() <= self.num_steps

    def _next_group(self) -> _Group:
        while not self._rows:
            self._draw += 1
            self._snapshots[self._draw] = self.sampler.state_dict()
            rows = self.sampler.next_batch()
            skip, self._skip = self._skip, 0
            self._rows.extend((self._draw, g, r) for g, r in enumerate(rows) if g >= skip)
        draw, g, row = self._rows.popleft()
        self._started_draw = draw
        return _Group(draw, g, row, self.encode(row[self.prompt_key]))

    # ------------------------------------------------------------------ generation
    def _busy(self, delta: int) -> None:
        now = time.monotonic()
        with self._cv:
            if self._active_requests == 0 and delta > 0:
                self._busy_since = now
            self._active_requests += delta
            if self._active_requests == 0 and self._busy_since is not None:
                self._busy_s += now - self._busy_since
                self._busy_since = None

    async def _post(self, body: dict, grp: _Group) -> dict:
        self._busy(+1)
        try:
            if self.routing_shape is None:
                return await self.client.post("/generate", body)
            return await self._post_direct(body, grp)
        finally:
            self._busy(-1)

    def _server_urls(self) -> list[str]:
        """The /generate servers a request may be sent to directly: the cluster's live servers, then the
        ones it fronts but did not start (other nodes, rollout.external_urls); [] without a cluster."""
        live = getattr(self.cluster, "live_server_urls", None)
        urls = list(live() if callable(live) else getattr(self.cluster, "server_urls", None) or [])
        return urls + [u for u in getattr(self.cluster, "extra_worker_urls", None) or [] if u not in urls]

    def _direct_client(self, url: str) -> RolloutClient:
        """One client per server URL, closed with the producer; its attempts go through the HTTP worker
        process when there is one."""
        c = self._direct.get(url)
        if c is None:
            c = self._direct[url] = RolloutClient(url, timeout_s=self.client.timeout_s,
                                                  max_retries=self.client.max_retries)
            c.worker = self._worker
        return c

    async def _post_direct(self, body: dict, grp: _Group) -> dict:
        """R3 (moe.routing_replay=r3) without group requests: sglang-router drops return_routed_experts, so
        the request goes straight to a server, chosen, waited for and re-sent as by :meth:`_to_server`."""
        if not self._lists_servers():  # a router-like test double without a server list: its own URL
            return await self.client.post("/generate", body)
        return await self._to_server(body, grp, lambda out: out)

    async def _post_batch(self, bodies: list[dict], grp: _Group) -> list[dict]:
        """rollout.group_requests: the samples of ``bodies`` (one group's) as ONE batched /generate (SGLang's
        batch form: a list of input_ids, one sampling_params dict and one rid per prompt) sent straight to a
        server by :meth:`_to_server` (sglang-router refuses list sampling_params). Results in the order of
        ``bodies``.

        Raises:
            as :meth:`_to_server`.
        """
        body: dict = {"input_ids": [b["input_ids"] for b in bodies],
                      "sampling_params": [b["sampling_params"] for b in bodies],
                      "return_logprob": True, "rid": [b["rid"] for b in bodies]}
        if self.routing_shape is not None:
            body["return_routed_experts"] = True
        self._busy(+1)
        try:
            if not self._lists_servers():  # a router-like test double without a server list: its own URL
                return check_result_ids(body, await self.client.post("/generate", body))
            return await self._to_server(body, grp, lambda out: check_result_ids(body, out))
        finally:
            self._busy(-1)

    async def _to_server(self, body: dict, grp: _Group, check_result: Callable[[Any], Any]) -> Any:
        """POST ``body`` to /generate of one rollout server (never the router), groups round-robin over
        :meth:`_server_urls`; returns ``check_result(response)``. A server that fails (connection error or
        timeout after the client's retries) gets the same body re-sent to the next live server (the rids
        and seeds are the same, so no sample is lost or generated twice); with failover, while no server is
        live (all being restarted) the group waits for one, for at most 2 x rollout.startup_timeout_s (the
        cluster's own give-up, failover's max_restarts, ends it sooner through check_alive).

        Raises:
            RolloutServerDiedError: (cluster.check_alive) a server died and the cluster does not fail over,
                or failover gave up on it.
            RolloutRequestRefusedError: a server refused the request (HTTP 4xx).
            RolloutRequestError: the server failed without failover, or no server took the request in time.
        """
        check = getattr(self.cluster, "check_alive", None)
        failover = bool(getattr(self.cluster, "failover", False))
        deadline = time.monotonic() + self.failover_wait_s
        attempt = 0
        while True:
            if check is not None:
                check()  # raises for a dead server without failover, or when failover gave up
            urls = self._server_urls()
            if not urls:  # every server down: with failover they are being restarted, wait for one
                if not failover or time.monotonic() > deadline:
                    raise RolloutRequestError(f"group {grp.uid}: no live rollout server to send it to")
                await asyncio.sleep(0.2)
                continue
            url = urls[(grp.draw * self.B + grp.index + attempt) % len(urls)]
            try:
                return check_result(await self._direct_client(url).post("/generate", body))
            except RolloutRequestRefusedError:
                raise
            except RolloutRequestError as e:
                if check is not None:  # a dead server is named (RolloutServerDiedError) unless it fails over
                    check()
                if not failover or time.monotonic() > deadline:
                    raise
                attempt += 1
                self.log(f"WARNING: a request of group {grp.uid} failed on {url} ({e}); sending it to another server")
                with self._cv:
                    self._counters["failover_resends"] += 1
                await asyncio.sleep(min(2.0, 0.1 * 2 ** min(attempt, 5)))  # the monitor notices the death

    def _lists_servers(self) -> bool:
        """The cluster says which servers there are (RolloutCluster), as opposed to a bare client double."""
        c = self.cluster
        return callable(getattr(c, "live_server_urls", None)) or bool(getattr(c, "server_urls", None)) \
            or bool(getattr(c, "extra_worker_urls", None))

    def _body(self, grp: _Group, k: int, part: "_Partial") -> dict:
        """The /generate body of sample ``k``'s next segment (prompt + its tokens so far, the rest of the
        token budget; see the module docstring for seeds and rids)."""
        sp = dict(self.sampling_params, max_new_tokens=self.max_new - len(part.tokens))
        # keyed by the prefix length: a request cut before its first token is drawn again as if uncut
        keys = (grp.draw, grp.index, k) + ((len(part.tokens),) if part.tokens else ())
        sp["sampling_seed"] = sampling_seed(self.seed, *keys)
        body = {"input_ids": grp.prompt_ids + part.tokens, "sampling_params": sp, "return_logprob": True,
                "rid": f"s{grp.draw}-g{grp.index}-{k}" + (f"-r{part.segments}" if part.segments else "")}
        if self.routing_shape is not None:
            body["return_routed_experts"] = True
        return body

    def _absorb(self, part: "_Partial", out: dict) -> bool:
        """Add one segment's answer ``out`` to ``part``; True when the response is finished (stop token,
        length, or cut exactly at the token budget), False when it was cut (abort) and goes on."""
        item = parse_generate_item(out)
        had = len(part.tokens)
        part.tokens += item.response_ids
        part.lps += item.rollout_log_probs
        # per token when the response spanned a weight update (in_place pause), else one version for all
        per_token = item.token_versions or [item.weight_version] * len(item.response_ids)
        part.versions += [_version_int(v, self.version) for v in per_token]
        if part.segments and had:  # continued a response that had tokens
            self._counters["resumed_segments"] += 1
        part.segments += 1
        part.item, part.out = item, out
        if item.status != "aborted":
            return True
        if len(part.tokens) >= self.max_new:  # cut exactly at the budget: it ended by length
            item.status = "truncated"
            return True
        return False

    def _sample_of(self, grp: _Group, k: int, part: "_Partial") -> Sample:
        item = part.item
        s = Sample(index=0, group_id=0, prompt=grp.row[self.prompt_key], label=str(grp.row[self.label_key]),
                   prompt_ids=grp.prompt_ids, response_ids=part.tokens, rollout_log_probs=part.lps,
                   loss_mask=[1] * len(part.tokens),
                   weight_version=str(max(part.versions)) if part.versions else item.weight_version,
                   status=item.status, metadata={"finish_reason": item.finish_reason, "uid": f"{grp.uid}-{k}",
                                                 "segments": part.segments})
        s.token_versions = part.versions
        if self.routing_shape is not None:
            s.routed_experts = routed_experts_of(part.out, s, self.routing_shape)
        return s

    async def _run_sample(self, grp: _Group, k: int) -> Sample:
        """One request per sample (through the router): segment after segment until it finished."""
        part = _Partial()
        while part.segments < MAX_SEGMENTS:
            await self._unpaused.wait()
            body = self._body(grp, k, part)
            out = await self._post(body, grp)
            check_result_id(body, out)
            if self._absorb(part, out):
                return self._sample_of(grp, k, part)
        raise _GiveUp(f"response {grp.uid}-{k} was cut {MAX_SEGMENTS} times")

    async def _run_group_batched(self, grp: _Group) -> list[Sample]:
        """rollout.group_requests: the group's samples as one batched request per round; the responses a
        weight update cut go on together in the next round (each from its own prefix)."""
        parts = [_Partial() for _ in range(self.n)]
        todo = list(range(self.n))
        while todo:
            if parts[todo[0]].segments >= MAX_SEGMENTS:  # every one in todo was cut in every round
                raise _GiveUp(f"response {grp.uid}-{todo[0]} was cut {MAX_SEGMENTS} times")
            await self._unpaused.wait()
            outs = await self._post_batch([self._body(grp, k, parts[k]) for k in todo], grp)
            todo = [k for k, out in zip(todo, outs) if not self._absorb(parts[k], out)]
        return [self._sample_of(grp, k, part) for k, part in enumerate(parts)]

    async def _score(self, grp: _Group, samples: Sequence[Sample]) -> None:
        """Reward of every finished response of ``grp`` (stop token or length; a cut one never gets
        here): through the RewardPool (``ascore_group``: sandboxed workers with a timeout, extra metrics
        per sample in ``metadata["reward_metrics"]``) or a plain ``reward_fn(text, label)``."""
        t0 = time.monotonic()
        texts = [self.decode(s.response_ids) for s in samples]
        label = str(grp.row[self.label_key])
        if hasattr(self.reward_fn, "ascore_group"):
            from moerl.data.tasks import row_metadata

            results = await self.reward_fn.ascore_group(grp.uid, grp.row[self.prompt_key], texts, label,
                                                        row_metadata(grp.row))
            for s, r in zip(samples, results):
                s.reward = float(r.score)
                s.metadata["reward_metrics"] = dict(r.metrics)
                if r.error is not None:
                    s.metadata["reward_error"] = r.error
        else:
            for s, text in zip(samples, texts):
                s.reward = float(self.reward_fn(text, label))
        with self._cv:
            self._counters["reward_s"] += time.monotonic() - t0

    async def _run_group(self, grp: _Group) -> None:
        try:
            if self.group_requests:
                samples = await self._run_group_batched(grp)
            else:
                samples = await asyncio.gather(*(self._run_sample(grp, k) for k in range(self.n)))
            await self._score(grp, samples)
            grp.samples = list(samples)
        except _GiveUp as e:
            grp.failed = str(e)
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # a dead server (failover off), a malformed answer: surfaces in get_batch
            with self._cv:
                self._error = self._error or e
                self._cv.notify_all()
            return
        with self._cv:
            self._inflight -= 1
            self._cv.notify_all()
        self._kick()

    # ------------------------------------------------------------------ trainer side
    def get_batch(self, step: int) -> RolloutBatch:
        """The groups of ``step`` (blocks until they are generated and scored).

        Metrics (floats): reward_mean, accuracy, response_length, truncated_frac, num_samples;
        rollout/{drawn_groups, dropped_stale_groups, dropped_no_signal_groups, failed_groups,
        resumed_segments, reward_s (wall seconds spent scoring the groups finished since the previous batch), reward_errors
        (samples whose verifier timed out, raised or crashed: scored reward.error_value), waited_groups, wait_s,
        trainer_wait_s, server_busy_frac, buffer_groups, failover_resends (requests re-sent to another server:
        a group's with rollout.group_requests, a sample's with moe.routing_replay=r3), pause_s / push_s /
        continue_s (wall seconds of the weight updates since the previous batch: pausing the servers
        (one_step_off: waiting until nothing is in flight), the push, continuing), paused_pushes (async:
        the updates since the previous batch that paused the servers: a group was in flight)}; reward/<name>: means of
        a reward function's extra metrics;
        staleness/{mean, max, tokens_<v>} over trained tokens (tokens_<v>: how many are v versions old); token versions per sample are in
        ``Sample.token_versions``.

        Raises:
            whatever stopped the producer (e.g. RolloutServerDiedError), and RuntimeError past num_steps.
        """
        if step > self.num_steps:
            raise RuntimeError(f"batch {step} asked for, but the run has {self.num_steps} steps")
        t0 = time.monotonic()
        groups: list[list[Sample]] = []
        drawn = stale = no_signal = failed = 0
        with self._cv:
            self.requested = max(self.requested, step)
            self._kick()
            try:
                while True:
                    if self._error is not None:
                        raise self._error
                    # a group dropped as stale or failed is replaced by the next one (the batch stays full);
                    # at most max_draw groups in all (dynamic sampling: max_oversample_factor * B)
                    need = min(self.B - len(groups), self.max_draw - drawn)
                    self._need = need
                    if need <= 0:
                        break
                    if not self._fifo or self._fifo[0].samples is None and self._fifo[0].failed is None:
                        self._waiting = True
                        self._kick()
                        self._cv.wait(timeout=1.0)
                        continue
                    grp = self._fifo.popleft()
                    drawn += 1
                    if grp.failed is not None:
                        failed += 1
                        self.log(f"WARNING: group {grp.uid} dropped: {grp.failed}")
                        continue
                    samples = grp.samples
                    self._mask_old(samples)
                    age = max(self.version - min(self._trained_versions(s), default=self.version) for s in samples)
                    if age > self.max_staleness:
                        stale += 1
                        continue
                    if self.dynamic and len({s.reward for s in samples}) < 2:
                        no_signal += 1
                        continue
                    groups.append(samples)
            finally:
                self._waiting = False
                self._need = self.B
            self.batches_taken = step
            buffered = sum(g.samples is not None for g in self._fifo)
            counters, self._counters = self._counters, collections.Counter()
            busy = self._busy_s + ((time.monotonic() - self._busy_since) if self._busy_since else 0.0)
            wall = time.monotonic() - self._t0
            self._busy_s, self._t0 = 0.0, time.monotonic()
            if self._busy_since is not None:
                self._busy_since = self._t0
        self._kick()
        return self._finish_batch(step, groups, dict(
            drawn_groups=drawn, dropped_stale_groups=stale, dropped_no_signal_groups=no_signal,
            failed_groups=failed, resumed_segments=counters["resumed_segments"], reward_s=counters["reward_s"],
            waited_groups=counters["waited_groups"], wait_s=counters["wait_s"],
            trainer_wait_s=time.monotonic() - t0, server_busy_frac=busy / max(wall, 1e-9),
            buffer_groups=buffered, pause_s=counters["pause_s"], push_s=counters["push_s"],
            continue_s=counters["continue_s"], paused_pushes=counters["paused_pushes"],
            failover_resends=counters["failover_resends"]))

    def _trained_versions(self, s: Sample) -> list[int]:
        return [v for v, m in zip(s.token_versions, s.loss_mask) if m]

    def _mask_old(self, samples: Sequence[Sample]) -> None:
        if not self.mask_old:
            return
        for s in samples:
            if s.token_versions:
                newest = max(s.token_versions)
                s.loss_mask = [m if v == newest else 0 for m, v in zip(s.loss_mask, s.token_versions)]

    def _finish_batch(self, step: int, groups: list[list[Sample]], rollout: dict) -> RolloutBatch:
        samples = [s for g in groups for s in g]
        for gi, g in enumerate(groups):
            for s in g:
                s.group_id = gi
        for i, s in enumerate(samples):
            s.index = i
        m: dict = {f"rollout/{k}": float(v) for k, v in rollout.items()}
        m["num_samples"] = float(len(samples))
        if samples:
            m["reward_mean"] = sum(s.reward for s in samples) / len(samples)
            m["accuracy"] = sum(s.reward >= 1.0 for s in samples) / len(samples)
            m["response_length"] = sum(s.response_length for s in samples) / len(samples)
            m["truncated_frac"] = sum(s.status == "truncated" for s in samples) / len(samples)
            m["rollout/reward_errors"] = float(sum("reward_error" in s.metadata for s in samples))
            extra: dict[str, list[float]] = collections.defaultdict(list)
            for s in samples:
                for k, v in s.metadata.get("reward_metrics", {}).items():
                    extra[k].append(float(v))
            m.update({f"reward/{k}": sum(v) / len(v) for k, v in extra.items()})
            ages = [self.version - v for s in samples for v in self._trained_versions(s)]
            if ages:
                m["staleness/mean"] = sum(ages) / len(ages)
                m["staleness/max"] = float(max(ages))
                for a in sorted(set(ages)):
                    m[f"staleness/tokens_{a}"] = float(sum(x == a for x in ages))
        return RolloutBatch(groups, self.version, m)

    def update_weights(self, push: Optional[Callable[[], Any]], step: int, version: Optional[int] = None) -> None:
        """Wrap one weight update after ``step`` (push() sends the exported weights and returns the new
        version, int or str; None: the update was skipped, the weights did not change): sync pushes;
        one_step_off waits until no group is in flight, then pushes; async holds new requests and, when a
        group is in flight (:meth:`hold_for_push`), pauses every server (abort: running requests return
        what they have, and resume after continue), pushes, continues.

        With rollout.background_push this runs on a thread of its own and returns at once: the trainer's
        version is ``version`` (the exported one, int; None: the current version + 1) from now on (the
        staleness of the batches it takes is counted against it), while ``step`` counts as done for the
        staleness gate only once the push has landed. A previous background push is waited for first.
        Marks ``step`` done either way.

        Raises:
            whatever the push (or a previous background push) raised.
        """
        self.wait_weights()
        if push is None or not self.background_push:
            self._update_now(push, step)
            return
        self.begin_push(self.version + 1 if version is None else int(version))

        def run() -> None:
            try:
                self._update_now(push, step)
            except BaseException as e:  # surfaces in wait_weights and get_batch
                with self._cv:
                    self._push_error = e
                    self._error = self._error or e
            finally:
                with self._cv:
                    self._pushing = False
                    self._cv.notify_all()
                self._kick()

        self._push_thread = threading.Thread(target=run, name="moerl-weight-push", daemon=True)
        self._push_thread.start()

    def _update_now(self, push: Optional[Callable[[], Any]], step: int) -> None:
        if push is None:
            self.end_push(step)
            return
        t0 = time.monotonic()
        paused = self.hold_for_push()
        try:
            version, seconds = paused_push(self.cluster if paused else None, self.pause_mode, push, t0)
        finally:
            self._resume_producer()  # async held the requests (paused or not)
        self.end_push(step, version, seconds)

    # the three steps of a weight update, also driven from another process (moerl.rollout.producer_process)
    def begin_push(self, version: int) -> None:
        """A background push of ``version`` (int) starts: the trainer's version from now on; the staleness
        gate counts the step as done only at :meth:`end_push`."""
        with self._cv:
            self.version, self._pushing = int(version), True

    def hold_for_push(self) -> bool:
        """Before a push: one_step_off waits until no group is in flight; async stops starting requests
        (they wait for :meth:`end_push`). Returns True when the servers must be paused for the push: async
        with a cluster and a group in flight, the caller's job (``cluster.pause_generation(self.pause_mode)``,
        then ``continue_generation()`` after the push). With no group in flight once requests are held
        (checked in the producer's event loop, after the hold: a group started later waits for
        :meth:`end_push` before it sends anything), nothing of this producer runs on the servers and the
        pause is skipped (``rollout/paused_pushes`` counts the pushes that paused; a request still running
        for a group that already failed counts as in flight): at staleness 1 the
        batch the trainer takes next is usually complete when it pushes, and a pause and continue were
        4-10 ms of every update's latency on the 2-core demo."""
        if self.mode == "one_step_off":
            with self._cv:
                while self._inflight and self._error is None:
                    self._cv.wait(timeout=1.0)
        if not (self.mode == "async" and self.cluster is not None and self._producing()):
            return False

        async def hold() -> bool:  # in the loop: no request starts between the clear and the count
            self._unpaused.clear()
            with self._cv:  # a group in flight, or a request still running (a failed group's other samples)
                return self._inflight > 0 or self._active_requests > 0

        try:
            fut = asyncio.run_coroutine_threadsafe(hold(), self._loop)
        except RuntimeError:  # the loop closed meanwhile (the producer stopped): nothing runs
            return False
        while True:
            try:
                busy = fut.result(timeout=0.5)
                break
            except concurrent.futures.TimeoutError:
                if not self._producing():  # the loop stopped without running it (its teardown drops it)
                    fut.cancel()
                    return False
            except concurrent.futures.CancelledError:  # cancelled by the loop's teardown: nothing runs
                return False
        if busy:
            with self._cv:
                self._counters["paused_pushes"] += 1
        return busy

    def end_push(self, step: int, version: Any = None, seconds: Optional[Sequence[float]] = None,
                 failed: bool = False) -> None:
        """After a push (or a skipped update: ``seconds`` None): requests start again; with ``seconds`` =
        (pause_s, push_s, continue_s) the version becomes ``version`` (int or str; None or not a number:
        the current one + 1) and the times are counted; ``step`` counts as done (unless ``failed``: the
        push raised, the version stays)."""
        self._resume_producer()
        with self._cv:
            if seconds is not None and not failed:
                self.version = _version_int(version, self.version + 1)
                for k, v in zip(("pause_s", "push_s", "continue_s"), seconds):
                    self._counters[k] += v
            if not failed:
                self.steps_done = max(self.steps_done, step)
            elif self._error is None:  # as a failed background push here: the producer stops, get_batch raises
                self._error = RuntimeError(f"the weight push after step {step} failed (the trainer reports why)")
            self._pushing = False
            self._cv.notify_all()
        self._kick()

    def _resume_producer(self) -> None:
        if self._producing():
            self._loop.call_soon_threadsafe(self._unpaused.set)

    def _producing(self) -> bool:
        return self._loop is not None and not self._loop.is_closed() and self._thread is not None \
            and self._thread.is_alive()

    def state_dict(self) -> dict:
        """Resume cursor: the sampler state before the draw of the oldest group not yet taken, and that
        group's index in its draw (the buffer and in-flight requests are regenerated on resume). Waits
        for a background weight push first (a checkpoint is taken with its weights on the servers)."""
        self.wait_weights()
        with self._cv:
            if self._fifo:
                head = self._fifo[0]
                draw, skip = head.draw, head.index
            elif self._rows:
                draw, skip = self._rows[0][0], self._rows[0][1]
            else:
                draw, skip = self._draw + 1, 0
                self._snapshots[draw] = self.sampler.state_dict()
            for d in [d for d in self._snapshots if d < draw]:
                del self._snapshots[d]
            return {"sampler": dict(self._snapshots[draw]), "draw": draw, "skip": skip}


def routed_experts_of(out: dict, sample: Sample, routing_shape: tuple[int, int]):
    """Decode meta_info.routed_experts of one /generate item (moerl.moe.routing_replay wire format).

    Raises:
        RolloutRequestError: missing (the server was not started with routing recording: real SGLang
            needs --enable-return-routed-experts) or of the wrong length.
    """
    from moerl.moe.routing_replay import decode_routed_experts
    from moerl.rollout.errors import RolloutRequestError

    payload = out.get("meta_info", {}).get("routed_experts")
    if payload is None:
        raise RolloutRequestError("moe.routing_replay=r3 but the server returned no meta_info.routed_experts "
                                  "(SGLang must run with --enable-return-routed-experts; sglang-router 0.3.2 drops "
                                  "the request field, so send R3 requests to the servers directly)")
    try:
        routed = decode_routed_experts(payload, *routing_shape)
    except ValueError as e:
        raise RolloutRequestError(str(e)) from None
    want = len(sample.prompt_ids) + len(sample.response_ids) - 1
    if routed.shape[0] != want:
        raise RolloutRequestError(f"meta_info.routed_experts has {routed.shape[0]} positions, expected "
                                  f"prompt + completion - 1 = {want}")
    return routed


class _GiveUp(Exception):
    """A response that could not be finished (cut MAX_SEGMENTS times): its group is dropped, counted."""

"""One interpreter for every schedule of :mod:`moerl.pipeline.schedules`, over torch.distributed P2P.

Each rank walks its action list in order.  Before an action it posts (``torch.distributed.batch_isend_irecv``)
the sends of the previous action (asynchronously; buffers kept alive until they complete) and receives,
blocking, the activations / gradients the action needs from other ranks.  Tensors between chunks of the
same rank are handed over locally.  No message relies on its tag (all tags are 0): NCCL ignores tags and
matches the messages between a pair of ranks strictly in posting order, so every rank follows the FIFO
plan of :func:`moerl.pipeline.schedules.comm_plan`: it receives each peer's messages in exactly the order
that peer sent them, taking early (and buffering) a message sent before the one it needs.  The plan is
checked by :func:`~moerl.pipeline.schedules.validate_fifo` (FIFO matching, asynchronous sends), and every
header carries the message id, so a mismatch raises instead of corrupting data.  Tested on gloo only
(where tag-0 messages of a pair match in posting order too).

Transport (``p2p=``): NCCL runs all p2p ops of one communicator in stream order and a send may block until
its receive is posted (rendezvous), so over ONE shared communicator the ranks follow the stricter model of
``validate_fifo(blocking_sends=True)``, in which zb1p, dualpipe and dualpipev deadlock.  ``p2p="directed"``
(the default on NCCL) gives each *direction* of each communicating rank pair its own 2-rank process group
(:func:`make_p2p_channels`; on NCCL its own communicator and stream): messages ``a -> b`` travel only on
channel ``(a, b)``, whose sender posts per round one header group then one tensor group, exactly the groups
the receiver posts for that channel.  A blocked send then only delays later sends of the same direction,
which the receiver takes in the same FIFO order; the host waits only on receives (and on all sends at the
end of :meth:`PipelineInterpreter.run`).  A receive group of a channel completes as soon as its sender
posted the matching send group (the channel's earlier groups are posted by both sides already), which is
the asynchronous-send model that ``validate_fifo(blocking_sends=False)`` proves deadlock-free for every
schedule.  Caveat (NCCL's documentation on concurrent communicators): the channels' kernels must be able to
run concurrently on the GPU (a few p2p kernels per rank; the channels' communicators are created eagerly so
no lazy init blocks the host mid-step).  ``p2p="shared"`` (the default on gloo, whose sends never block)
keeps everything on the pipeline group.

Backward is split as in zero-bubble pipelining (Qi et al. 2023):

- ``B``: ``torch.autograd.grad(out, [inp], grad_out, retain_graph=True)`` -- only the input gradient, sent
  upstream at once;
- ``W``: ``torch.autograd.grad(out, params, grad_out)`` later, accumulated into ``param.grad`` (or
  Megatron DDP's ``param.main_grad``).
- ``BW`` (unsplit) computes both in one autograd call.

That generic split (``split_backward="retrace"``) re-traverses the chunk's graph in W, so W costs about a
full backward; ``split_backward="torch"`` uses torch.distributed.pipelining's graph split instead (B keeps
the gradients at the weight-side nodes, W starts from them).  The default, ``split_backward="store"``, is
layer-level (:mod:`moerl.pipeline.wgrad_store`, DualPipe's WeightGradStore idea): the forwards of split
micro-batches run with the store armed, Megatron's linear layers then compute only their input gradients in
B and queue ``(input, grad_output)``; W runs exactly those weight GEMMs.  B is
``torch.autograd.grad(out, [inp, *params], grad_out)`` without ``retain_graph`` (the parameters the store
does not cover -- norms, router, embedding -- get their gradients there; they are logged at construction),
so B + W costs one backward.  Modules without Megatron linears get nothing deferred (W empty): use the
other modes for them.

``FB`` actions run the forward, then the backward (correct on CPU).  With an ``executor``
(:class:`ChunkExecutor`, e.g. :class:`moerl.pipeline.overlap.MegatronOverlapExecutor`) every training F, B and
FB goes through it instead; an FB then overlaps one chunk's forward with the other chunk's backward (on GPU:
Megatron-Core's fine-grained schedule plans, MoE all-to-all of one on a communication CUDA stream while the
other computes).  An executor that cannot split the backward runs the whole backward in ``B`` (``W`` is
then empty).

The tensors exchanged between chunks must be a single floating tensor (a chunk's output); the first chunk's
input (``inputs[m]``) and the criterion's labels can be anything the user's callables accept.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, NamedTuple, Optional, Sequence, Union

import torch
import torch.distributed as dist

from moerl.pipeline.schedules import P2P, Action, Schedule, _plan_actions, comm_plan, validate_schedule
from moerl.pipeline.wgrad_store import WeightGradStore, accumulate_grad, check_fifo_weight_order

SPLIT_BACKWARD = ("store", "retrace", "torch")

__all__ = ["SPLIT_BACKWARD", "Channel", "ChunkExecutor", "P2PChannels", "PipelineInterpreter", "PipelineResult", "make_p2p_channels",
           "sync_mirrored_grads", "uses_nccl"]

_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
_MAXDIM = 8
_HDR = 5 + _MAXDIM  # header: dtype code, ndim, what (0 act, 1 grad), chunk, micro-batch, up to 8 dims
_WHAT = ("act", "grad")


class Channel(NamedTuple):
    """This rank's end of one directed p2p channel: a 2-rank process group used for ONE direction only.

    Attributes:
        group: the process group (members: the two ranks; on NCCL its own communicator and stream).
        group_peer: the other rank's rank in ``group`` (0 or 1).
        peer: the other rank's global rank (what ``torch.distributed.P2POp(peer=...)`` takes).
    """

    group: Any
    group_peer: int
    peer: int


@dataclass(frozen=True)
class P2PChannels:
    """The directed channels of one rank of a pipeline (built by :func:`make_p2p_channels`).

    Attributes:
        pp_rank: this rank's index in the pipeline group.
        global_ranks: global rank of every pp rank of this pipeline (index = pp rank).
        channels: ``(src pp rank, dst pp rank) -> Channel`` for every direction of the schedule's layout
            that involves this rank (``src == pp_rank``: sends; ``dst == pp_rank``: receives).  The channels
            ``(a, b)`` and ``(b, a)`` are different groups.
    """

    pp_rank: int
    global_ranks: tuple[int, ...]
    channels: Mapping[tuple[int, int], Channel]

    def get(self, src: int, dst: int) -> Channel:
        """The channel carrying messages from pp rank ``src`` to pp rank ``dst``.

        Raises:
            ValueError: no such channel (the schedule's layout never sends ``src -> dst``, or this rank is
                neither end): build the channels from the schedule that runs."""
        ch = self.channels.get((src, dst))
        if ch is None:
            raise ValueError(f"p2p channels of pp rank {self.pp_rank}: no channel {src} -> {dst} (have "
                             f"{sorted(self.channels)}); build them with make_p2p_channels(schedule) of the "
                             f"schedule that runs")
        return ch


def channel_pairs(schedule: Schedule) -> list[tuple[int, int]]:
    """The directed pp-rank pairs ``(src, dst)`` that need a channel for ``schedule``: both directions of
    every pair of ranks holding consecutive chunks of a route (activations one way, gradients the other)
    or mirrored copies of one stage (:func:`sync_mirrored_grads`).  Depends on the chunk layout only (not on
    the action order), so every micro-batch count of a schedule name with the same layout shares them."""
    pairs = set()
    for route in schedule.routes:
        for a, b in zip(route, route[1:]):
            pairs.add((schedule.chunk_rank[a], schedule.chunk_rank[b]))
    for a in range(schedule.num_chunks):
        for b in range(schedule.num_chunks):
            if a != b and schedule.chunk_stage[a] == schedule.chunk_stage[b]:
                pairs.add((schedule.chunk_rank[a], schedule.chunk_rank[b]))
    return sorted({p for a, b in pairs if a != b for p in ((a, b), (b, a))})


def uses_nccl(group: Optional[dist.ProcessGroup] = None) -> bool:
    """Whether point-to-point messages of ``group`` (default: the world) travel over NCCL: its backend is
    ``nccl`` or a device map naming it (``"cpu:gloo,cuda:nccl"``).  False when torch.distributed is not
    initialised."""
    return dist.is_initialized() and "nccl" in str(dist.get_backend(group)).lower()


def make_p2p_channels(schedule: Schedule, group: Optional[dist.ProcessGroup] = None) -> P2PChannels:
    """Create the directed p2p channels (one 2-rank process group per direction of each communicating pair
    of :func:`channel_pairs`) of every pipeline of the world and return this rank's.

    COLLECTIVE over the whole world: every rank must call it at the same point (``torch.distributed.new_group``
    must be called by all ranks in the same order, members or not), each with its own pipeline ``group``
    (the pipeline group may be a subgroup of a larger world with tp/ep/dp).  The ranks exchange their
    pipelines' directed pairs in global ranks (``all_gather_object``), then create the union, sorted, with the
    world's backend.  On NCCL each member then runs a 1-element ``all_reduce`` on each of its channels in the
    same global order, so the communicators exist before the pipeline runs (no host-blocking lazy init at a
    first send; the pairwise order cannot deadlock).

    Args:
        schedule: any schedule with the chunk layout that will run (``num_ranks`` = pp size).
        group: this rank's pipeline group (default: the world).

    Returns:
        :class:`P2PChannels` of this rank.

    Raises:
        RuntimeError: torch.distributed is not initialised.
        ValueError: the pipeline group's size is not ``schedule.num_ranks``.
    """
    if not dist.is_initialized():
        raise RuntimeError("make_p2p_channels: torch.distributed is not initialised (init_process_group first)")
    size = dist.get_world_size(group)
    if size != schedule.num_ranks:
        raise ValueError(f"make_p2p_channels: schedule has {schedule.num_ranks} ranks but the pipeline group has "
                         f"{size} processes: build it with num_ranks = pp size")
    mine = tuple(dist.get_global_rank(group, i) if group is not None else i for i in range(size))
    wanted = sorted((mine[a], mine[b]) for a, b in channel_pairs(schedule))
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, wanted)
    every = sorted({tuple(p) for lst in gathered for p in lst})
    backend = dist.get_backend()
    me = dist.get_rank()
    created = []
    for src, dst in every:  # the same order on every rank
        g = dist.new_group([src, dst], backend=backend)
        if (src, dst) in wanted and me in (src, dst):
            created.append((src, dst, g))
    channels = {}
    for src, dst, g in created:
        other = dst if me == src else src
        channels[(mine.index(src), mine.index(dst))] = Channel(g, dist.get_group_rank(g, other), other)
    if uses_nccl(group) and torch.cuda.is_available():
        dev = torch.device("cuda", torch.cuda.current_device())
        for _, _, g in created:
            dist.all_reduce(torch.zeros(1, device=dev), group=g)
        torch.cuda.synchronize(dev)
    return P2PChannels(mine.index(me), mine, channels)


@dataclass
class PipelineResult:
    """What one rank got out of :meth:`PipelineInterpreter.run`.

    Attributes:
        losses: micro-batch index -> detached scalar loss, for the micro-batches whose loss this rank
            computed (the ranks holding a route's last chunk).
        outputs: micro-batch index -> detached output of the last chunk (forward-only, or when
            ``return_outputs=True``), on the same ranks.
        timeline: with ``record_timeline=True``: per action ``(t_wait, t_start, t_end, action)`` in seconds
            (``time.perf_counter``): the action began waiting for its receives at ``t_wait``, computed from
            ``t_start`` (receives done) to ``t_end`` (sends posted).
    """

    losses: dict[int, torch.Tensor] = field(default_factory=dict)
    outputs: dict[int, torch.Tensor] = field(default_factory=dict)
    timeline: list[tuple[float, float, float, Action]] = field(default_factory=list)


class PipelineInterpreter:
    """Run a :class:`~moerl.pipeline.schedules.Schedule` on this process.

    Args:
        schedule: the schedule (validated here).
        modules: chunk id -> ``nn.Module`` for every chunk this rank holds
            (``schedule.chunks_of_rank(pp_rank)``).  For DualPipe two chunks on different ranks run the same
            stage (mirrored copies): give them identical weights and call :func:`sync_mirrored_grads` after
            :meth:`run`.
        criterion: ``criterion(output, label) -> scalar loss`` on the last chunk of a route; the loss is
            back-propagated as is (scale by 1/num_microbatches inside it if you want a mean).
        pp_rank: this process's index in the pipeline (default: rank in ``group``).
        group: the pipeline process group (default: the world).
        stage_fn: ``stage_fn(chunk, module, x, microbatch) -> output`` (default ``module(x)``); lets a
            stage read per-micro-batch side inputs (masks, positions).
        executor: a :class:`ChunkExecutor` that runs the training forward / backward of every chunk and
            overlaps the two halves of ``FB`` actions (default None: ``stage_fn`` and ``torch.autograd.grad``,
            FB sequential).  Forward-only runs always use ``stage_fn``.
        split_backward: how a split ``B``/``W`` pair computes the weight gradients: ``"store"`` (default:
            :class:`~moerl.pipeline.wgrad_store.WeightGradStore` installed on the modules -- patched in place --
            B queues the weight GEMMs of Megatron's linear layers, W runs them; uncovered parameters' gradients
            in B, logged once here), ``"retrace"`` (W runs
            ``autograd.grad`` w.r.t. the parameters over the retained graph: always correct, W costs about
            a full backward) or ``"torch"`` (``torch.distributed.pipelining._backward``'s
            ``stage_backward_input``/``stage_backward_weight``: B keeps the gradients at the nodes that
            lead to weights and W starts from them, so B + W costs about one backward; a private torch API).
        p2p: the transport of the plan's messages (module docstring): ``"directed"`` (one 2-rank process
            group per direction of each communicating pair, created here by :func:`make_p2p_channels` --
            COLLECTIVE over the whole world), ``"shared"`` (everything on ``group``), or prebuilt
            :class:`P2PChannels` (reuse them across interpreters: group creation is collective and slow).
            Default None: directed on NCCL (a shared communicator can deadlock zb1p/dualpipe/dualpipev),
            shared otherwise (gloo sends never block).

    Raises:
        ValueError: a held chunk has no module, or a module is given for a chunk of another rank; ``p2p`` is
            not one of the above, or its channels belong to another pp rank or lack a direction of the plan.
    """

    def __init__(
        self,
        schedule: Schedule,
        modules: Mapping[int, torch.nn.Module],
        criterion: Optional[Callable[[torch.Tensor, Any], torch.Tensor]] = None,
        *,
        pp_rank: Optional[int] = None,
        group: Optional[dist.ProcessGroup] = None,
        stage_fn: Optional[Callable[[int, torch.nn.Module, Any, int], torch.Tensor]] = None,
        executor: Optional["ChunkExecutor"] = None,
        split_backward: str = "store",
        p2p: Union[str, "P2PChannels", None] = None,
    ):
        validate_schedule(schedule)
        if split_backward not in SPLIT_BACKWARD:
            raise ValueError(f"split_backward must be one of {SPLIT_BACKWARD}, got {split_backward!r}")
        self.split_backward = split_backward
        self.schedule = schedule
        self.group = group
        if pp_rank is None:
            pp_rank = dist.get_rank(group) if dist.is_initialized() else 0
        if dist.is_initialized() and dist.get_world_size(group) != schedule.num_ranks:
            raise ValueError(f"schedule has {schedule.num_ranks} ranks but the pipeline group has "
                             f"{dist.get_world_size(group)} processes: build it with num_ranks = pp size")
        self.pp_rank = pp_rank
        held = schedule.chunks_of_rank(pp_rank)
        missing = [c for c in held if c not in modules]
        extra = [c for c in modules if c not in held]
        if missing or extra:
            raise ValueError(f"modules: pp rank {pp_rank} holds chunks {held} of schedule {schedule.name}; "
                             f"missing {missing}, not held {extra}")
        self.modules = dict(modules)
        self.criterion = criterion
        self.stage_fn = stage_fn or (lambda chunk, module, x, mb: module(x))
        self.executor = executor
        self._M = schedule.num_microbatches
        self._C = schedule.num_chunks
        # NCCL moves CUDA tensors only: headers and receive buffers live on the current CUDA device there
        nccl = uses_nccl(group)
        self._device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
        self._plans = {fo: comm_plan(schedule, forward_only=fo)[pp_rank] for fo in (False, True)}
        self.channels = self._make_channels(p2p, nccl)
        # (chunk, micro-batch) pairs whose backward is a separate B and W on this rank
        self._split = {(a.chunk, a.microbatch) for a in schedule.actions[pp_rank] if a.kind == "W"}
        self.wgrad_store: Optional[WeightGradStore] = None
        if split_backward == "store" and self._split and executor is None:
            self.wgrad_store = WeightGradStore()
            for c in held:
                self.wgrad_store.install(self.modules[c], chunk=c)
            if any(self.wgrad_store._te.values()):
                check_fifo_weight_order(schedule, pp_rank)

    # ------------------------------------------------------------------------------------------ p2p
    def _make_channels(self, p2p, nccl: bool) -> Optional[P2PChannels]:
        """The directed channels of ``p2p`` (None: shared group), checked against the plans."""
        if p2p is None:
            p2p = "directed" if nccl else "shared"
        if isinstance(p2p, str):
            if p2p not in ("directed", "shared"):
                raise ValueError(f"p2p must be 'directed', 'shared' or P2PChannels, got {p2p!r}")
            if p2p == "shared" or not dist.is_initialized():
                if p2p == "directed":
                    raise ValueError("p2p='directed' needs torch.distributed initialised; use p2p='shared'")
                return None
            p2p = make_p2p_channels(self.schedule, self.group)
        if not isinstance(p2p, P2PChannels):
            raise TypeError(f"p2p must be 'directed', 'shared' or P2PChannels, got {type(p2p).__name__}")
        if p2p.pp_rank != self.pp_rank or len(p2p.global_ranks) != self.schedule.num_ranks:
            raise ValueError(f"p2p: channels of pp rank {p2p.pp_rank} of a {len(p2p.global_ranks)}-rank pipeline "
                             f"given to pp rank {self.pp_rank} of {self.schedule.num_ranks}")
        for plan in self._plans.values():
            for batch in plan:
                for sends, recvs in batch:
                    for x in sends:
                        p2p.get(self.pp_rank, x.peer)
                    for x in recvs:
                        p2p.get(x.peer, self.pp_rank)
        return p2p

    def _post(self, items: list[tuple[Callable, torch.Tensor, int, int]]) -> list:
        """Post ``(op, tensor, src pp rank, dst pp rank)`` items (tag 0) and return their works.  Shared:
        one ``batch_isend_irecv`` over the pipeline group, items in the given order; directed: one per
        channel, each channel's items in the given order (``batch_isend_irecv`` needs one group per call)."""
        if not items:
            return []
        if self.channels is None:
            return dist.batch_isend_irecv([dist.P2POp(op, t, self._peer(dst if src == self.pp_rank else src),
                                                      self.group, 0) for op, t, src, dst in items])
        by_dir: dict[tuple[int, int], list] = {}
        for op, t, src, dst in items:
            ch = self.channels.get(src, dst)
            by_dir.setdefault((src, dst), []).append(dist.P2POp(op, t, ch.peer, ch.group, 0))
        return [w for ops in by_dir.values() for w in dist.batch_isend_irecv(ops)]

    def _peer(self, pp_rank: int) -> int:
        return dist.get_global_rank(self.group, pp_rank) if self.group is not None else pp_rank

    def _post_sends(self, sends: tuple[P2P, ...]) -> None:
        """Post the sends of one plan round asynchronously (tag 0): all headers, then all tensors, so that
        every pair sees them in the order the receiver's header group and tensor group expect.  Shared: one
        ``batch_isend_irecv``; directed: per channel one header group, then one tensor group -- the very
        groups the receiver posts for that channel.  The host never waits on them (until the end of run)."""
        hdrs, ops_t, keep = [], [], []
        me = self.pp_rank
        for x in sends:
            t = self._outbox.pop((x.what, x.chunk, x.microbatch))
            h = torch.zeros(_HDR, dtype=torch.int64)
            ids = [_DTYPES.index(t.dtype), t.dim(), _WHAT.index(x.what), x.chunk, x.microbatch, *t.shape]
            h[:len(ids)] = torch.tensor(ids, dtype=torch.int64)
            h = h.to(self._device)
            hdrs.append((dist.isend, h, me, x.peer))
            ops_t.append((dist.isend, t, me, x.peer))
            keep += [h, t]
        works = self._post(hdrs + ops_t) if self.channels is None else self._post(hdrs) + self._post(ops_t)
        self._pending_sends.append((works, keep))
        # drop finished sends so their buffers can be freed
        self._pending_sends = [(ws, k) for ws, k in self._pending_sends if not all(w.is_completed() for w in ws)]

    def _recv_round(self, recvs: tuple[P2P, ...]) -> None:
        """Blocking receive of one plan round (tag 0): the headers, then the tensors; every received tensor
        goes to the local buffer under (what, chunk, micro-batch).

        Raises:
            RuntimeError: a header names another message than the plan expects (FIFO order broken)."""
        me = self.pp_rank
        hdrs = [torch.zeros(_HDR, dtype=torch.int64, device=self._device) for _ in recvs]
        for work in self._post([(dist.irecv, h, x.peer, me) for h, x in zip(hdrs, recvs)]):
            work.wait()
        bufs = []
        for h, x in zip(hdrs, recvs):
            h = h.tolist()
            got = (_WHAT[h[2]] if 0 <= h[2] < 2 else h[2], h[3], h[4])
            if got != (x.what, x.chunk, x.microbatch):
                raise RuntimeError(f"pipeline p2p: pp rank {self.pp_rank} expected {x.what} of (chunk {x.chunk}, "
                                   f"micro-batch {x.microbatch}) from pp rank {x.peer} but got {got}: the ranks "
                                   f"run different schedules or plans")
            bufs.append(torch.empty(h[5:5 + h[1]], dtype=_DTYPES[h[0]], device=self._device))
        for work in self._post([(dist.irecv, b, x.peer, me) for b, x in zip(bufs, recvs)]):
            work.wait()
        for b, x in zip(bufs, recvs):
            self._local[(x.what, x.chunk, x.microbatch)] = b

    def _communicate(self, batch) -> None:
        """Run one batch of the FIFO plan: per round, post its sends, then receive its messages."""
        for sends, recvs in batch:
            if sends:
                self._post_sends(sends)
            if recvs:
                self._recv_round(recvs)
        if self._outbox:
            raise AssertionError(f"internal: sends {sorted(self._outbox)} not in the FIFO plan")

    def _send(self, items: list[tuple[int, str, int, int, torch.Tensor]]) -> None:
        """Queue tensors for the next plan batch: items are (peer pp rank, what, chunk, microbatch, tensor)."""
        for p, w, c, m, t in items:
            if t.dtype not in _DTYPES:
                raise TypeError(f"pipeline p2p: chunk {c} produced a {t.dtype} {w}; chunks must exchange a "
                                f"floating tensor (one of {_DTYPES})")
            if t.dim() > _MAXDIM:
                raise ValueError(f"pipeline p2p: tensors of at most {_MAXDIM} dims, got {tuple(t.shape)}")
            self._outbox[(w, c, m)] = t.detach().contiguous()

    # ------------------------------------------------------------------------------------------ run
    def run(
        self,
        inputs: Optional[Sequence[Any]] = None,
        labels: Optional[Sequence[Any]] = None,
        *,
        forward_only: bool = False,
        return_outputs: bool = False,
        record_timeline: bool = False,
    ) -> PipelineResult:
        """Run one step (all micro-batches) of the schedule.

        Args:
            inputs: ``num_microbatches`` first-chunk inputs; needed on ``schedule.input_ranks()``
                (entries of micro-batches whose route starts elsewhere may be None).
            labels: ``num_microbatches`` criterion labels; needed on ``schedule.loss_ranks()`` when a
                criterion is set.
            forward_only: run only the F parts (no graph kept, no gradients); the last chunks' outputs are
                returned, and the losses too when a criterion and labels are given.
            return_outputs: also return the last chunks' outputs in training mode.
            record_timeline: time every action (``PipelineResult.timeline``).

        Returns:
            :class:`PipelineResult` of this rank; parameter gradients are accumulated into ``param.grad``.

        Raises:
            ValueError: inputs/labels missing or of the wrong length on a rank that needs them.
        """
        s, r, M = self.schedule, self.pp_rank, self._M
        if r in s.input_ranks() and (inputs is None or len(inputs) != M):
            raise ValueError(f"inputs: pp rank {r} feeds a first chunk and needs {M} micro-batch inputs, got "
                             f"{None if inputs is None else len(inputs)}")
        need_labels = self.criterion is not None and (not forward_only or labels is not None)
        if need_labels and r in s.loss_ranks() and (labels is None or len(labels) != M):
            raise ValueError(f"labels: pp rank {r} computes the loss and needs {M} micro-batch labels, got "
                             f"{None if labels is None else len(labels)}")
        if not forward_only and self.criterion is None:
            raise ValueError("criterion is required for training (forward_only=False)")
        self._inputs, self._labels = inputs, labels
        self._forward_only, self._return_outputs = forward_only, return_outputs or forward_only
        self._compute_loss = self.criterion is not None and (not forward_only or labels is not None)
        self._local: dict[tuple[str, int, int], torch.Tensor] = {}
        self._saved: dict[tuple[int, int], tuple] = {}  # (chunk, mb) -> (x, y) after F
        self._wsaved: dict[tuple[int, int], tuple] = {}  # (chunk, mb) -> (y, grad_out) after B
        self._pending_sends = []
        self._outbox: dict[tuple[str, int, int], torch.Tensor] = {}
        self._result = PipelineResult()
        self._record = record_timeline
        if self.wgrad_store is not None:
            self.wgrad_store.clear()  # a step that raised may have left GEMMs queued
        plan = self._plans[forward_only]
        acts = _plan_actions(s, r, forward_only)
        for i, a in enumerate(acts):
            t_wait = time.perf_counter() if self._record else 0.0
            self._communicate(plan[i])
            t_start = time.perf_counter() if self._record else 0.0
            self._compute(a)
            if self._record:
                self._result.timeline.append((t_wait, t_start, time.perf_counter(), a))
        self._communicate(plan[len(acts)])
        for works, _ in self._pending_sends:
            for w in works:
                w.wait()
        self._pending_sends = []
        if self._saved or self._wsaved or self._local or (self.wgrad_store and self.wgrad_store.pending()):
            raise AssertionError("internal: activations, received tensors or weight GEMMs left after the schedule")
        return self._result

    # ------------------------------------------------------------------------------------------ actions
    def _compute(self, a: Action) -> None:
        if a.kind == "F":
            self._forward(a.chunk, a.microbatch)
        elif a.kind == "B":
            self._backward(a.chunk, a.microbatch, weights=False)
        elif a.kind == "W":
            self._weights(a.chunk, a.microbatch)
        elif a.kind == "BW":
            self._backward(a.chunk, a.microbatch, weights=True)
        elif self.executor is not None:
            self._exec_forward_backward(a.chunk, a.microbatch, a.chunk_b, a.microbatch_b)
        else:
            self._forward(a.chunk, a.microbatch)
            self._backward(a.chunk_b, a.microbatch_b, weights=True)

    def _forward(self, c: int, m: int) -> None:
        if self.executor is not None and not self._forward_only:
            return self._exec_forward_backward(c, m, None, None)
        s = self.schedule
        x = self._chunk_input(c, m)
        arm = (self.wgrad_store.arm() if self.wgrad_store is not None and not self._forward_only
               and (c, m) in self._split else contextlib.nullcontext())
        with torch.set_grad_enabled(not self._forward_only), arm:
            y = self.stage_fn(c, self.modules[c], x, m)
            if s.is_last(c, m):
                if self._return_outputs:
                    self._result.outputs[m] = y.detach()
                if self._compute_loss:
                    y = self.criterion(y, self._labels[m])
                    self._result.losses[m] = y.detach()
        if not s.is_last(c, m):
            self._pass_activation(c, m, y)
        if not self._forward_only:
            self._saved[(c, m)] = (x, y)

    def _chunk_input(self, c: int, m: int) -> Any:
        """Chunk c's input for micro-batch m: the user's input on a first chunk, else the received (or
        locally handed over) activation -- a leaf with ``requires_grad`` when training."""
        s = self.schedule
        if s.is_first(c, m):
            return self._inputs[m]
        x = self._local.pop(("act", s.prev_chunk(c, m), m))
        return x if self._forward_only else x.detach().requires_grad_(True)

    def _pass_activation(self, c: int, m: int, y: torch.Tensor) -> None:
        """Hand chunk c's output for micro-batch m to the next chunk of its route: locally when this rank
        holds it, else queued for the plan's next send (the activation counterpart of
        :meth:`_send_input_grad`)."""
        s = self.schedule
        n = s.next_chunk(c, m)
        if s.chunk_rank[n] == self.pp_rank:
            self._local[("act", c, m)] = y.detach()
        else:
            self._send([(s.chunk_rank[n], "act", c, m, y)])

    def _grad_out(self, c: int, m: int) -> Optional[torch.Tensor]:
        if self.schedule.is_last(c, m):
            return None  # y is the scalar loss
        return self._local.pop(("grad", c, m))

    def _params(self, c: int) -> list[torch.nn.Parameter]:
        return [p for p in self.modules[c].parameters() if p.requires_grad]

    def _accumulate(self, params, grads) -> None:
        """Add weight gradients to ``param.main_grad`` (Megatron DDP's buffer, when present; its autograd
        hooks do not fire for ``torch.autograd.grad``) or ``param.grad`` (:func:`accumulate_grad`)."""
        for p, g in zip(params, grads):
            accumulate_grad(p, g)

    def _send_input_grad(self, c: int, m: int, dx: Optional[torch.Tensor]) -> None:
        s = self.schedule
        p = s.prev_chunk(c, m)
        if p is None:
            return
        if dx is None:
            raise RuntimeError(f"chunk {c}'s output does not depend on its input (micro-batch {m})")
        if s.chunk_rank[p] == self.pp_rank:
            self._local[("grad", p, m)] = dx
        else:
            self._send([(s.chunk_rank[p], "grad", p, m, dx)])

    def _backward(self, c: int, m: int, weights: bool) -> None:
        if self.executor is not None:
            return self._exec_forward_backward(None, None, c, m)
        x, y = self._saved.pop((c, m))
        g = self._grad_out(c, m)
        has_input = not self.schedule.is_first(c, m)
        params = self._params(c)
        store = self.wgrad_store if (c, m) in self._split else None
        if weights or store is not None:
            # unsplit (BW), or B of the store split: the covered linears queue their weight GEMMs on the
            # store, the other parameters get their gradients here
            targets = ([x] if has_input else []) + params
            with store.capture((c, m)) if store is not None else contextlib.nullcontext():
                grads = torch.autograd.grad(y, targets, g, allow_unused=True)
            if has_input:
                self._send_input_grad(c, m, grads[0])
                grads = grads[1:]
            self._accumulate(params, grads)
            if store is not None:
                self._wsaved[(c, m)] = ("store", None, None)
            elif self.wgrad_store is not None:
                self.wgrad_store.after_unsplit(c)
            return
        if not has_input:  # nothing to send upstream: the whole backward runs in W
            self._wsaved[(c, m)] = ("retrace", y, g)
            return
        if self.split_backward == "torch":
            from torch.distributed.pipelining._backward import stage_backward_input

            dxs, groups = stage_backward_input([y], None if g is None else [g], [x], iter(params))
            x.grad = None
            self._send_input_grad(c, m, dxs[0])
            self._wsaved[(c, m)] = ("torch", groups, None)
            return
        (dx,) = torch.autograd.grad(y, [x], g, retain_graph=True, allow_unused=True)
        self._send_input_grad(c, m, dx)
        self._wsaved[(c, m)] = ("retrace", y, g)

    def _weights(self, c: int, m: int) -> None:
        if self.executor is not None:
            if self.executor.splits_backward:
                raise NotImplementedError("executors that split B and W are not supported yet")
            return  # the executor's B computed the weight gradients already
        how, a, b = self._wsaved.pop((c, m))
        if how == "store":
            self.wgrad_store.run((c, m))
            return
        params = self._params(c)
        if how == "retrace":
            grads = torch.autograd.grad(a, params, b, allow_unused=True)
            self._accumulate(params, grads)
            return
        from torch.distributed.pipelining._backward import stage_backward_weight

        # stage_backward_weight accumulates into .grad: collect this micro-batch's share separately
        saved = [p.grad for p in params]
        for p in params:
            p.grad = None
        stage_backward_weight(iter(params), a)
        grads = [p.grad for p in params]
        for p, old in zip(params, saved):
            p.grad = old
        self._accumulate(params, grads)

    def _exec_forward_backward(self, fc: Optional[int], fm: Optional[int], bc: Optional[int],
                               bm: Optional[int]) -> None:
        """Training forward of (fc, fm) and/or full backward of (bc, bm) through the executor, overlapped
        when both are given (an ``FB`` action).  The last chunk's criterion runs here, on a detached copy of
        the executor's output, so the executor's backward starts from the gradient w.r.t. that output."""
        s, ex = self.schedule, self.executor
        b_state = g = None
        if bc is not None:
            b_state, leaf, loss = self._saved.pop((bc, bm))
            g = torch.autograd.grad(loss, [leaf])[0] if s.is_last(bc, bm) else self._grad_out(bc, bm)
        x = self._chunk_input(fc, fm) if fc is not None else None
        if fc is not None and bc is not None:
            y, f_state, dx = ex.forward_backward(fc, self.modules[fc], x, fm, bc, b_state, g)
        elif fc is not None:
            (y, f_state), dx = ex.forward(fc, self.modules[fc], x, fm), None
        else:
            y = f_state = None
            dx = ex.backward(bc, b_state, g)
        if bc is not None:
            self._send_input_grad(bc, bm, dx)
        if fc is None:
            return
        leaf = loss = None
        if s.is_last(fc, fm):
            if self._return_outputs:
                self._result.outputs[fm] = y.detach()
            leaf = y.detach().requires_grad_(True)
            loss = self.criterion(leaf, self._labels[fm])
            self._result.losses[fm] = loss.detach()
        else:
            self._pass_activation(fc, fm, y)
        self._saved[(fc, fm)] = (f_state, leaf, loss)


class ChunkExecutor:
    """How :class:`PipelineInterpreter` runs a chunk's training forward and backward when given
    ``executor=``: the interface (subclass it or duck-type it).

    ``splits_backward = False``: ``backward`` computes input AND weight gradients (the schedule's ``W`` is
    then empty).  Weight gradients are accumulated by ``torch.autograd.backward`` into ``param.grad`` (or by
    Megatron DDP's hooks into ``param.main_grad``).

    Methods (``x``: the chunk's input -- the user's input on a first chunk, else a leaf float tensor with
    ``requires_grad``; ``m``: micro-batch index; ``state``: whatever ``forward`` returned for the backward):

    - ``forward(chunk, module, x, m) -> (y, state)``: ``y`` the chunk output (hidden states, or the last
      chunk's output that the criterion takes);
    - ``backward(chunk, state, grad_y) -> dx``: ``dx`` = gradient w.r.t. ``x`` (None on a first chunk);
    - ``forward_backward(f_chunk, f_module, x, f_m, b_chunk, b_state, b_grad_y) -> (y, f_state, dx)``: both,
      overlapped.
    """

    splits_backward = False

    def forward(self, chunk: int, module: torch.nn.Module, x: Any, m: int):
        raise NotImplementedError

    def backward(self, chunk: int, state: Any, grad_y: torch.Tensor) -> Optional[torch.Tensor]:
        raise NotImplementedError

    def forward_backward(self, f_chunk: int, f_module: torch.nn.Module, x: Any, f_m: int, b_chunk: int,
                         b_state: Any, b_grad_y: torch.Tensor):
        y, f_state = self.forward(f_chunk, f_module, x, f_m)
        return y, f_state, self.backward(b_chunk, b_state, b_grad_y)


def sync_mirrored_grads(schedule: Schedule, modules: Mapping[int, torch.nn.Module], *,
                        pp_rank: Optional[int] = None, group: Optional[dist.ProcessGroup] = None,
                        grad_attr: str = "grad", channels: Optional[P2PChannels] = None) -> None:
    """Sum the gradients of the mirrored copies of each stage (DualPipe) so both copies hold the total.

    For every pair of chunks that run the same stage on two ranks, the ranks exchange their ``param.grad``
    tensors (``batch_isend_irecv``, tag 0, posted in stage order on both sides so that NCCL's
    posting-order matching pairs them right) and each adds the other's; addition is commutative, so both
    copies end up bitwise identical.  A no-op for schedules without mirrored copies.  Parameters with ``grad is None``
    are treated as zero gradients.  ``grad_attr="main_grad"`` sums Megatron DDP's gradient buffers instead.

    Transport: without ``channels`` all sends and receives go in ONE ``batch_isend_irecv`` on ``group`` --
    safe on NCCL's shared communicator too, since each side's send and receive of a pair sit in one NCCL
    group (fused, progressed together).  With ``channels`` (:func:`make_p2p_channels`, e.g. the
    interpreter's ``.channels``) each send goes on its ``(me, peer)`` channel and each receive on
    ``(peer, me)``, one ``batch_isend_irecv`` per channel; the host waits on all of them at the end.

    Raises:
        ValueError: bad ``grad_attr``; two copies of a stage on one rank; ``channels`` of another pp rank.
    """
    if grad_attr not in ("grad", "main_grad"):
        raise ValueError(f"grad_attr must be 'grad' or 'main_grad', got {grad_attr!r}")
    if pp_rank is None:
        pp_rank = channels.pp_rank if channels is not None else dist.get_rank(group) if dist.is_initialized() else 0
    if channels is not None and channels.pp_rank != pp_rank:
        raise ValueError(f"sync_mirrored_grads: channels of pp rank {channels.pp_rank} given to pp rank {pp_rank}")
    peer_of = (lambda q: dist.get_global_rank(group, q)) if group is not None else (lambda q: q)
    sends, recvs, adds = [], [], []
    # NCCL matches a pair's messages in posting order (tags ignored): both sides go by stage
    for c in sorted(schedule.chunks_of_rank(pp_rank), key=lambda c: schedule.chunk_stage[c]):
        stage = schedule.chunk_stage[c]
        twins = [t for t in range(schedule.num_chunks) if t != c and schedule.chunk_stage[t] == stage]
        for t in twins:
            peer = schedule.chunk_rank[t]
            if peer == pp_rank:
                raise ValueError("sync_mirrored_grads: two copies of one stage on one rank are not supported")
            params = [p for p in modules[c].parameters() if p.requires_grad]
            for p in params:
                if getattr(p, grad_attr, None) is None:
                    setattr(p, grad_attr, torch.zeros_like(p))
            grads = [getattr(p, grad_attr) for p in params]
            flat = torch.cat([g.reshape(-1) for g in grads]) if grads else torch.zeros(0)
            buf = torch.empty_like(flat)
            if channels is None:
                sends.append(dist.P2POp(dist.isend, flat, peer_of(peer), group, 0))
                recvs.append(dist.P2POp(dist.irecv, buf, peer_of(peer), group, 0))
            else:
                out, inc = channels.get(pp_rank, peer), channels.get(peer, pp_rank)
                sends.append([dist.P2POp(dist.isend, flat, out.peer, out.group, 0)])
                recvs.append([dist.P2POp(dist.irecv, buf, inc.peer, inc.group, 0)])
            adds.append((grads, buf))
    if not sends:
        return
    if channels is None:
        works = dist.batch_isend_irecv(sends + recvs)
    else:  # one batch per message, in stage order on both sides (FIFO per channel)
        works = [w for ops in sends + recvs for w in dist.batch_isend_irecv(ops)]
    for w in works:
        w.wait()
    for grads, buf in adds:
        off = 0
        for g in grads:
            n = g.numel()
            g.add_(buf[off:off + n].view_as(g).to(g.dtype))
            off += n

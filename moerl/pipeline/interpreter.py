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

Backward is split as in zero-bubble pipelining (Qi et al. 2023):

- ``B``: ``torch.autograd.grad(out, [inp], grad_out, retain_graph=True)`` -- only the input gradient, sent
  upstream at once;
- ``W``: ``torch.autograd.grad(out, params, grad_out)`` later, accumulated into ``param.grad`` (or
  Megatron DDP's ``param.main_grad``).
- ``BW`` (unsplit) computes both in one autograd call.

This generic split (``split_backward="retrace"``) re-traverses the chunk's graph in W, so W costs about a
full backward; ``split_backward="torch"`` uses torch.distributed.pipelining's graph split instead (B keeps
the gradients at the weight-side nodes, W starts from them).  A layer-level split that stores the
weight-grad GEMM inputs (as DualPipe's WeightGradStore does) would be cheaper still.

``FB`` actions call ``overlap(run_forward, run_backward)``; the default runs them one after the other
(correct on CPU).  A GPU stage can pass an ``overlap`` that runs them on two CUDA streams.

The tensors exchanged between chunks must be a single floating tensor (a chunk's output); the first chunk's
input (``inputs[m]``) and the criterion's labels can be anything the user's callables accept.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Sequence

import torch
import torch.distributed as dist

from moerl.pipeline.schedules import P2P, Action, Schedule, _plan_actions, comm_plan, validate_schedule

__all__ = ["PipelineInterpreter", "PipelineResult", "sync_mirrored_grads"]

_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
_MAXDIM = 8
_HDR = 5 + _MAXDIM  # header: dtype code, ndim, what (0 act, 1 grad), chunk, micro-batch, up to 8 dims
_WHAT = ("act", "grad")


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
        overlap: ``overlap(run_forward, run_backward)`` for ``FB`` actions (default: forward, then backward).
        split_backward: how a split ``B``/``W`` pair computes the weight gradients: ``"retrace"`` (W runs
            ``autograd.grad`` w.r.t. the parameters over the retained graph: always correct, W costs about
            a full backward) or ``"torch"`` (``torch.distributed.pipelining._backward``'s
            ``stage_backward_input``/``stage_backward_weight``: B keeps the gradients at the nodes that
            lead to weights and W starts from them, so B + W costs about one backward; a private torch API).

    Raises:
        ValueError: a held chunk has no module, or a module is given for a chunk of another rank.
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
        overlap: Optional[Callable[[Callable[[], None], Callable[[], None]], None]] = None,
        split_backward: str = "retrace",
    ):
        validate_schedule(schedule)
        if split_backward not in ("retrace", "torch"):
            raise ValueError(f"split_backward must be 'retrace' or 'torch', got {split_backward!r}")
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
        self.overlap = overlap or (lambda f, b: (f(), b()))
        self._M = schedule.num_microbatches
        self._C = schedule.num_chunks
        # NCCL moves CUDA tensors only: headers and receive buffers live on the current CUDA device there
        nccl = dist.is_initialized() and dist.get_backend(group) == "nccl"
        self._device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
        self._plans = {fo: comm_plan(schedule, forward_only=fo)[pp_rank] for fo in (False, True)}

    # ------------------------------------------------------------------------------------------ p2p
    def _peer(self, pp_rank: int) -> int:
        return dist.get_global_rank(self.group, pp_rank) if self.group is not None else pp_rank

    def _post_sends(self, sends: tuple[P2P, ...]) -> None:
        """Post the sends of one plan round asynchronously (tag 0): all headers, then all tensors, so that
        every pair sees them in the order the receiver's header group and tensor group expect."""
        hdrs, ops_t, keep = [], [], []
        for x in sends:
            t = self._outbox.pop((x.what, x.chunk, x.microbatch))
            h = torch.zeros(_HDR, dtype=torch.int64)
            ids = [_DTYPES.index(t.dtype), t.dim(), _WHAT.index(x.what), x.chunk, x.microbatch, *t.shape]
            h[:len(ids)] = torch.tensor(ids, dtype=torch.int64)
            h = h.to(self._device)
            hdrs.append(dist.P2POp(dist.isend, h, self._peer(x.peer), self.group, 0))
            ops_t.append(dist.P2POp(dist.isend, t, self._peer(x.peer), self.group, 0))
            keep += [h, t]
        self._pending_sends.append((dist.batch_isend_irecv(hdrs + ops_t), keep))
        # drop finished sends so their buffers can be freed
        self._pending_sends = [(ws, k) for ws, k in self._pending_sends if not all(w.is_completed() for w in ws)]

    def _recv_round(self, recvs: tuple[P2P, ...]) -> None:
        """Blocking receive of one plan round (tag 0): the headers, then the tensors; every received tensor
        goes to the local buffer under (what, chunk, micro-batch).

        Raises:
            RuntimeError: a header names another message than the plan expects (FIFO order broken)."""
        hdrs = [torch.zeros(_HDR, dtype=torch.int64, device=self._device) for _ in recvs]
        ops = [dist.P2POp(dist.irecv, h, self._peer(x.peer), self.group, 0) for h, x in zip(hdrs, recvs)]
        for work in dist.batch_isend_irecv(ops):
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
        ops = [dist.P2POp(dist.irecv, b, self._peer(x.peer), self.group, 0) for b, x in zip(bufs, recvs)]
        for work in dist.batch_isend_irecv(ops):
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
        if self._saved or self._wsaved or self._local:
            raise AssertionError("internal: activations or received tensors left after the schedule")
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
        else:
            self.overlap(lambda: self._forward(a.chunk, a.microbatch),
                         lambda: self._backward(a.chunk_b, a.microbatch_b, weights=True))

    def _forward(self, c: int, m: int) -> None:
        s = self.schedule
        if s.is_first(c, m):
            x = self._inputs[m]
        else:
            x = self._local.pop(("act", s.prev_chunk(c, m), m))
            if not self._forward_only:
                x = x.detach().requires_grad_(True)
        with torch.set_grad_enabled(not self._forward_only):
            y = self.stage_fn(c, self.modules[c], x, m)
            if s.is_last(c, m):
                if self._return_outputs:
                    self._result.outputs[m] = y.detach()
                if self._compute_loss:
                    y = self.criterion(y, self._labels[m])
                    self._result.losses[m] = y.detach()
        if not s.is_last(c, m):
            n = s.next_chunk(c, m)
            if s.chunk_rank[n] == self.pp_rank:
                self._local[("act", c, m)] = y.detach()
            else:
                self._send([(s.chunk_rank[n], "act", c, m, y)])
        if not self._forward_only:
            self._saved[(c, m)] = (x, y)

    def _grad_out(self, c: int, m: int) -> Optional[torch.Tensor]:
        if self.schedule.is_last(c, m):
            return None  # y is the scalar loss
        return self._local.pop(("grad", c, m))

    def _params(self, c: int) -> list[torch.nn.Parameter]:
        return [p for p in self.modules[c].parameters() if p.requires_grad]

    def _accumulate(self, params, grads) -> None:
        """Add weight gradients to ``param.main_grad`` (Megatron DDP's buffer, when present; its autograd
        hooks do not fire for ``torch.autograd.grad``) or ``param.grad``."""
        for p, g in zip(params, grads):
            if g is None:
                continue
            if getattr(p, "main_grad", None) is not None:
                p.main_grad.add_(g)
            elif p.grad is None:
                p.grad = g.detach().clone()
            else:
                p.grad.add_(g)

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
        x, y = self._saved.pop((c, m))
        g = self._grad_out(c, m)
        has_input = not self.schedule.is_first(c, m)
        params = self._params(c)
        if weights:
            targets = ([x] if has_input else []) + params
            grads = torch.autograd.grad(y, targets, g, allow_unused=True)
            if has_input:
                self._send_input_grad(c, m, grads[0])
                grads = grads[1:]
            self._accumulate(params, grads)
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
        how, a, b = self._wsaved.pop((c, m))
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


def sync_mirrored_grads(schedule: Schedule, modules: Mapping[int, torch.nn.Module], *,
                        pp_rank: Optional[int] = None, group: Optional[dist.ProcessGroup] = None,
                        grad_attr: str = "grad") -> None:
    """Sum the gradients of the mirrored copies of each stage (DualPipe) so both copies hold the total.

    For every pair of chunks that run the same stage on two ranks, the ranks exchange their ``param.grad``
    tensors (``batch_isend_irecv``, tag 0, posted in stage order on both sides so that NCCL's
    posting-order matching pairs them right) and each adds the other's; addition is commutative, so both
    copies end up bitwise identical.  A no-op for schedules without mirrored copies.  Parameters with ``grad is None``
    are treated as zero gradients.  ``grad_attr="main_grad"`` sums Megatron DDP's gradient buffers instead.
    """
    if grad_attr not in ("grad", "main_grad"):
        raise ValueError(f"grad_attr must be 'grad' or 'main_grad', got {grad_attr!r}")
    if pp_rank is None:
        pp_rank = dist.get_rank(group) if dist.is_initialized() else 0
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
            sends.append(dist.P2POp(dist.isend, flat, peer_of(peer), group, 0))
            recvs.append(dist.P2POp(dist.irecv, buf, peer_of(peer), group, 0))
            adds.append((grads, buf))
    if not sends:
        return
    for w in dist.batch_isend_irecv(sends + recvs):
        w.wait()
    for grads, buf in adds:
        off = 0
        for g in grads:
            n = g.numel()
            g.add_(buf[off:off + n].view_as(g).to(g.dtype))
            off += n

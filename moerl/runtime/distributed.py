"""Process groups, Megatron-Core parallel_state and seeds for one moerl worker process.

``init_distributed`` works under torchrun (reads RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
MASTER_PORT; after a ``--max-restarts`` restart, TORCHELASTIC_RESTART_COUNT namespaces the
rendezvous keys so the new workers do not meet the dead ones' stale gloo addresses) and as a plain single process (world size 1 on a free 127.0.0.1 port). It uses gloo
without CUDA and NCCL with it, installs the CPU compatibility patches on CPU
(``moerl.runtime.cpu_compat``), builds Megatron's tensor/pipeline/expert/data-parallel groups with
``megatron.core.parallel_state.initialize_model_parallel`` and seeds python, numpy, torch and
Megatron's RNG tracker (``tensor_parallel.model_parallel_cuda_manual_seed``).
"""

from __future__ import annotations

import os
import random
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from moerl.runtime import cpu_compat
from moerl.runtime.procs import die_with_torchrun_agent

__all__ = ["DistInfo", "init_distributed", "destroy_distributed", "validate_layout", "fault_injection_point",
           "FAULT_ENV"]

# True when init_distributed created the default process group (and so destroy_distributed
# must destroy it); False when the caller had already initialised torch.distributed.
_OWNS_PROCESS_GROUP = False


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits in the parallel layout.

    Attributes:
        rank: global rank in [0, world_size).
        world_size: number of processes.
        local_rank: rank on this node (torchrun LOCAL_RANK; 0 single-process).
        dp_size: data-parallel size = world_size / (tp_size * pp_size) (cp_size is 1).
        tp_size, pp_size, ep_size: tensor / pipeline / expert model-parallel sizes.
        etp_size: expert tensor-parallel size (Megatron's expert_tensor_parallel_size).
        tp_rank, pp_rank, ep_rank, dp_rank: this process's rank in each group.
        backend: "gloo" (CPU) or "nccl" (CUDA).
        device: torch.device the model lives on ("cpu" or "cuda:<local_rank>").
        seed: the base seed given to init_distributed.
    """

    rank: int
    world_size: int
    local_rank: int
    dp_size: int
    tp_size: int
    pp_size: int
    ep_size: int
    etp_size: int
    tp_rank: int
    pp_rank: int
    ep_rank: int
    dp_rank: int
    backend: str
    device: torch.device
    seed: int

    @property
    def is_main(self) -> bool:
        """True on global rank 0."""
        return self.rank == 0


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int >= 1, got {value!r} ({type(value).__name__})")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    return int(value)


def validate_layout(world_size: int, tp_size: int, pp_size: int, ep_size: int, etp_size: int) -> int:
    """Check that the parallel sizes tile ``world_size`` the way Megatron-Core requires.

    Rules (megatron.core.parallel_state.initialize_model_parallel, cp_size = 1):
      * world_size % (tp_size * pp_size) == 0; dp_size = world_size / (tp_size * pp_size);
      * world_size % (etp_size * ep_size * pp_size) == 0 (expert layer: the expert data-parallel
        size is world_size / (etp_size * ep_size * pp_size)).

    Returns:
        dp_size.

    Raises:
        TypeError / ValueError: a size is not a positive int, or the layout is impossible; the
            message states the rule and the sizes.
    """
    world_size = _positive_int("world_size", world_size)
    tp_size = _positive_int("tp_size", tp_size)
    pp_size = _positive_int("pp_size", pp_size)
    ep_size = _positive_int("ep_size", ep_size)
    etp_size = _positive_int("etp_size", etp_size)
    if world_size % (tp_size * pp_size) != 0:
        raise ValueError(
            f"world_size={world_size} is not divisible by tp_size*pp_size={tp_size * pp_size} "
            f"(tp_size={tp_size}, pp_size={pp_size}): the number of processes must be a multiple "
            "of tp_size*pp_size (dp_size = world_size / (tp_size*pp_size)); change tp_size/pp_size "
            "or the number of processes"
        )
    if world_size % (etp_size * ep_size * pp_size) != 0:
        raise ValueError(
            f"world_size={world_size} is not divisible by etp_size*ep_size*pp_size="
            f"{etp_size * ep_size * pp_size} (etp_size={etp_size}, ep_size={ep_size}, "
            f"pp_size={pp_size}): expert layers need world_size to be a multiple of "
            "expert_tensor_parallel_size*ep_size*pp_size; lower ep_size, or set etp_size=1 when "
            "combining tp_size>1 with ep_size>1"
        )
    return world_size // (tp_size * pp_size)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env_int(name: str) -> Optional[int]:
    value = os.environ.get(name)
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError as e:
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from e


def init_distributed(
    tp_size: int = 1,
    pp_size: int = 1,
    ep_size: int = 1,
    seed: int = 1234,
    num_threads: Optional[int] = None,
    *,
    etp_size: Optional[int] = None,
    timeout_s: float = 600.0,
) -> DistInfo:
    """Initialise torch.distributed, Megatron-Core parallel_state and all RNGs for this process.

    Args:
        tp_size, pp_size, ep_size: tensor / pipeline / expert model-parallel sizes.
        seed: base seed. python/numpy/torch get ``seed + 100 * pp_rank`` (as Megatron-LM's
            training setup does); Megatron's RNG tracker gets the same value and derives its
            data-parallel / model-parallel (+2718 + tp_rank) / expert-parallel
            (+1024 + 100 * ep_rank + etp_rank) states from it.
        num_threads: torch intra-op threads for this process. Default: cpu_count divided by the
            processes on this node (torchrun LOCAL_WORLD_SIZE), at least 1. Oversubscribing cores
            made CPU forwards 30-50x slower (shared design CPU_MEGATRON.md).
        etp_size: expert tensor-parallel size; None means Megatron's default (= tp_size). Use 1 to
            combine tp_size > 1 with ep_size > 1 on few processes.
        timeout_s: collective timeout in seconds.

    Returns:
        DistInfo for this process.

    Raises:
        TypeError / ValueError: bad sizes or an impossible layout (see ``validate_layout``).
        RuntimeError: Megatron's parallel state is already initialised (call
            ``destroy_distributed()`` first).
    """
    global _OWNS_PROCESS_GROUP
    from megatron.core import parallel_state, tensor_parallel

    if parallel_state.model_parallel_is_initialized():
        raise RuntimeError(
            "Megatron parallel_state is already initialised; call destroy_distributed() first"
        )
    seed = int(seed)
    tp_size = _positive_int("tp_size", tp_size)
    pp_size = _positive_int("pp_size", pp_size)
    ep_size = _positive_int("ep_size", ep_size)
    etp_size = tp_size if etp_size is None else _positive_int("etp_size", etp_size)

    if dist.is_initialized():
        rank, world_size = dist.get_rank(), dist.get_world_size()
        local_rank = _env_int("LOCAL_RANK") or 0
        _OWNS_PROCESS_GROUP = False
    else:
        env_rank, env_world = _env_int("RANK"), _env_int("WORLD_SIZE")
        if env_rank is not None and env_world is not None:
            rank, world_size = env_rank, env_world
            local_rank = _env_int("LOCAL_RANK") or 0
            init_method = "env://"
            missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(k)]
            if missing:
                raise ValueError(
                    f"RANK/WORLD_SIZE are set but {', '.join(missing)} is not; launch with torchrun "
                    "or set MASTER_ADDR and MASTER_PORT"
                )
        else:
            rank, world_size, local_rank = 0, 1, 0
            init_method = f"tcp://127.0.0.1:{_free_port()}"
        if not 0 <= rank < world_size:
            raise ValueError(f"RANK={rank} is outside [0, WORLD_SIZE={world_size})")
    dp_size = validate_layout(world_size, tp_size, pp_size, ep_size, etp_size)

    use_cuda = torch.cuda.is_available()
    backend = "nccl" if use_cuda else "gloo"
    if use_cuda:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        cpu_compat.apply_cpu_patches()
        device = torch.device("cpu")
    # Needed on a GPU without Transformer Engine too (megatron-core 0.16.1, item 3).
    cpu_compat.patch_missing_te_general_gemm()

    if num_threads is None:
        local_world = _env_int("LOCAL_WORLD_SIZE") or 1
        num_threads = max(1, (os.cpu_count() or 1) // local_world)
    torch.set_num_threads(_positive_int("num_threads", num_threads))

    die_with_torchrun_agent()  # a SIGKILLed torchrun agent takes its workers (and their servers) with it
    if not dist.is_initialized():
        timeout = timedelta(seconds=timeout_s)
        attempt = _env_int("TORCHELASTIC_RESTART_COUNT")
        if init_method == "env://" and attempt is not None:
            # Under torchrun the workers share the elastic agent's TCPStore, and with the default
            # static rendezvous (--master_addr/--master_port) that store lives for the whole job:
            # after a --max-restarts restart it still holds attempt 0's keys (gloo's per-rank
            # addresses, group barriers), and the new workers read the dead workers' addresses
            # ("Gloo connectFullMesh failed ... Connection refused"). torch.distributed.rendezvous
            # gives the same store init_process_group would use; a per-attempt prefix gives every
            # attempt a clean key space.
            store, _, _ = next(dist.rendezvous("env://", rank=rank, world_size=world_size, timeout=timeout))
            run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
            store = dist.PrefixStore(f"moerl/{run_id}/attempt_{attempt}", store)
            dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
        else:
            dist.init_process_group(
                backend=backend, init_method=init_method, rank=rank, world_size=world_size, timeout=timeout
            )
        _OWNS_PROCESS_GROUP = True
    try:
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tp_size,
            pipeline_model_parallel_size=pp_size,
            expert_model_parallel_size=ep_size,
            expert_tensor_parallel_size=etp_size,
        )
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        pp_rank = parallel_state.get_pipeline_model_parallel_rank()
        ep_rank = parallel_state.get_expert_model_parallel_rank()
        dp_rank = parallel_state.get_data_parallel_rank()

        rank_seed = seed + 100 * pp_rank
        random.seed(rank_seed)
        np.random.seed(rank_seed % (2**32))
        torch.manual_seed(rank_seed)
        tensor_parallel.model_parallel_cuda_manual_seed(rank_seed)
    except BaseException:
        destroy_distributed()
        raise

    return DistInfo(
        rank=rank,
        world_size=world_size,
        local_rank=local_rank,
        dp_size=dp_size,
        tp_size=tp_size,
        pp_size=pp_size,
        ep_size=ep_size,
        etp_size=etp_size,
        tp_rank=tp_rank,
        pp_rank=pp_rank,
        ep_rank=ep_rank,
        dp_rank=dp_rank,
        backend=backend,
        device=device,
        seed=seed,
    )


def destroy_distributed() -> None:
    """Tear down Megatron's parallel_state and the process group created by init_distributed.

    Also resets megatron's process-global MoE aux-loss backward scale.

    Safe to call when nothing is initialised; afterwards ``init_distributed`` may be called again
    in the same process. A process group the caller created before init_distributed is left alone.
    """
    global _OWNS_PROCESS_GROUP
    from megatron.core import parallel_state
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    parallel_state.destroy_model_parallel()
    # Process-global aux-loss scale: a plain loss.backward() leaves a 0-dim tensor there, and a
    # later schedule's set_loss_scale copies a [1] tensor into it (shape error in 0.16.1).
    MoEAuxLossAutoScaler.main_loss_backward_scale = None
    if _OWNS_PROCESS_GROUP and dist.is_initialized():
        dist.destroy_process_group()
    _OWNS_PROCESS_GROUP = False


# ----------------------------------------------------------------------------- fault injection
FAULT_ENV = "MOERL_FAULT_EXIT_AT"


def fault_injection_point(phase: str, step: int) -> None:
    """TEST-ONLY fault-injection switch: exit this process abruptly at a chosen step.

    Does nothing unless the environment variable ``MOERL_FAULT_EXIT_AT`` is set (never set it in a
    real run). Its value ``"<rank>:<phase>:<step>"`` (e.g. ``"1:rl:3"``) makes the process whose
    global RANK is ``<rank>`` call ``os._exit(17)`` when the training loop reaches this point for
    ``phase`` ("sft" or "rl") step ``step`` (after the step's update, before its checkpoint), but
    only in torchrun's first attempt (TORCHELASTIC_RESTART_COUNT unset or 0), so a run under
    ``torchrun --max-restarts`` fails once, is restarted by the elastic agent and then runs through.
    ``os._exit`` skips every cleanup, like a crash or an OOM kill of one worker.

    Raises:
        ValueError: the variable is set but malformed.
    """
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return
    parts = spec.split(":")
    if len(parts) != 3 or parts[1] not in ("sft", "rl") or not (parts[0].isdigit() and parts[2].isdigit()):
        raise ValueError(f"{FAULT_ENV}={spec!r}: expected '<rank>:<sft|rl>:<step>', e.g. '1:rl:3'")
    if (_env_int("TORCHELASTIC_RESTART_COUNT") or 0) != 0:
        return
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    if rank == int(parts[0]) and phase == parts[1] and int(step) == int(parts[2]):
        print(f"[moerl] {FAULT_ENV}: rank {rank} exits at {phase} step {step} (fault injection)", flush=True)
        os._exit(17)

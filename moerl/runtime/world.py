"""Who this process is in the job, and the few collectives the RL loop needs (leaf module).

Global rank 0 drives the rollout servers, prints and writes logs; ``broadcast_from_main`` hands its
results to the other ranks over the default process group (gloo on CPU). Every function is also
right in a single process without torch.distributed (identity / 1 / rank 0).
"""

from __future__ import annotations

import time
from typing import Any

import torch.distributed as tdist

_IS_MAIN = [True]  # False on ranks other than global rank 0 (they print nothing)


def set_main(is_main: bool) -> None:
    """Mark this process as global rank 0 (prints) or not."""
    _IS_MAIN[0] = bool(is_main)


def is_main() -> bool:
    return _IS_MAIN[0]


def log(msg: str) -> None:
    """One ``[moerl HH:MM:SS] msg`` line on stdout, from global rank 0 only."""
    if _IS_MAIN[0]:
        print(f"[moerl {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def world_size() -> int:
    """torch.distributed world size (1 without an initialised default group)."""
    return tdist.get_world_size() if tdist.is_available() and tdist.is_initialized() else 1


def global_rank() -> int:
    return tdist.get_rank() if world_size() > 1 else 0


def broadcast_from_main(obj: Any) -> Any:
    """``obj`` of global rank 0 on every rank (torch.distributed.broadcast_object_list on the default
    group; identity in a single process). Collective."""
    if world_size() == 1:
        return obj
    box = [obj]
    tdist.broadcast_object_list(box, src=0)
    return box[0]


def barrier() -> None:
    """torch.distributed.barrier() with several ranks; no-op in one process."""
    if world_size() > 1:
        tdist.barrier()


def dp_info() -> tuple[int, int]:
    """(dp_size, dp_rank) from Megatron's parallel_state."""
    from megatron.core import parallel_state as ps

    return ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()

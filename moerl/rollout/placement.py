"""Rollout placement in HybridFlow's resource-pool sense: colocated or disaggregated.

* disaggregated: rollout servers and the trainer own separate GPUs (or nodes); nothing moves.
* colocated: they share GPUs, so each side frees its memory while the other works (the order slime
  and verl use with SGLang's memory saver, ``--enable-memory-saver``):

      rollout ... | before_train():        POST /release_memory_occupation {"tags": null} (all
                  |                        of weights, kv_cache, cuda_graph), then reload the
                  |                        trainer's weights / optimizer onto the GPU
      train ...   | before_weight_sync():  offload the trainer's weights / optimizer to CPU, then
                  |                        POST /resume_memory_occupation {"tags": ["weights"]}
      sync ...    | before_rollout():      POST /resume_memory_occupation {"tags": ["kv_cache",
                  |                        "cuda_graph"]}
      rollout ...

  (weights first and the KV cache only after the update keeps the peak low). Only tags this object
  released are resumed, so the first rollout of a fresh server needs no resume.

Which servers release / resume (the trainer passes RolloutCluster.colocated_server_urls): every
server moerl started, on every node -- global rank 0's own live servers and the other nodes'
(``peer_worker_urls``: each shares its node's GPUs with that node's trainer ranks and runs with
``--enable-memory-saver``). ``rollout.external_urls`` servers are not moerl's: they are never
released or resumed (they keep their memory and only receive weight updates), so they must not share
GPUs with the trainer. Only global rank 0 talks to the servers; with several trainer ranks the
trainer (moerl.train.weight_sync.WeightSync) puts a barrier after each offload and before each reload.

Every call is recorded in :attr:`RolloutPlacement.events` (phase, action, time). On CPU the trainer
offload / reload hooks default to no-ops that are still called and recorded.
"""

from __future__ import annotations

import time
from typing import Callable, Optional, Sequence, Union

import httpx

from moerl.rollout.client import MEMORY_TAGS
from moerl.rollout.common import per_server
from moerl.rollout.errors import RolloutError

PLACEMENTS = ("colocated", "disaggregated")
_KV_TAGS = [t for t in MEMORY_TAGS if t != "weights"]


class RolloutPlacement:
    """Memory hand-over between trainer and rollout servers for one placement mode.

    Args:
        mode: "colocated" or "disaggregated" (recipe rollout.placement).
        server_urls: base URLs of the servers (not the router), or a callable returning them (e.g.
            RolloutCluster.colocated_server_urls); empty / None on ranks that do not talk to servers.
        offload_trainer: called before the servers take the GPU back (move trainer weights and
            optimizer state to CPU); default no-op.
        reload_trainer: called before training (bring them back); default no-op.
        timeout_s: HTTP timeout of one release / resume call.
    Raises:
        ValueError: unknown mode. RolloutError (from the phase methods): a server refused a call.
    """

    def __init__(self, mode: str, server_urls: Union[Sequence[str], Callable[[], Sequence[str]], None] = None, *,
                 offload_trainer: Optional[Callable[[], None]] = None,
                 reload_trainer: Optional[Callable[[], None]] = None, timeout_s: float = 600.0):
        if mode not in PLACEMENTS:
            raise ValueError(f"rollout.placement must be one of {PLACEMENTS}, got {mode!r}")
        self.mode = mode
        self._urls = server_urls
        self.offload_trainer = offload_trainer or (lambda: None)
        self.reload_trainer = reload_trainer or (lambda: None)
        self.timeout_s = timeout_s
        self.released: set[str] = set()
        self.trainer_offloaded = False
        self.events: list[tuple[str, str, float]] = []  # (phase, action, time.time())

    @property
    def colocated(self) -> bool:
        return self.mode == "colocated"

    def server_urls(self) -> list[str]:
        urls = self._urls() if callable(self._urls) else self._urls
        return list(urls or [])

    def _record(self, phase: str, action: str) -> None:
        self.events.append((phase, action, time.time()))

    def _post_all(self, path: str, tags: Optional[list[str]]) -> None:
        urls = self.server_urls()
        if not urls:
            return

        def one(url: str) -> Optional[str]:
            try:
                with httpx.Client(timeout=self.timeout_s, trust_env=False) as c:
                    r = c.post(url.rstrip("/") + path, json={"tags": tags})
            except httpx.HTTPError as e:
                return f"{url}: {type(e).__name__}: {e}"
            return None if r.status_code == 200 else f"{url}: HTTP {r.status_code}: {r.text[:300]}"

        errors = [e for e in per_server(urls, one) if e]
        if errors:
            raise RolloutError(f"{path} {tags} failed on {len(errors)} of {len(urls)} servers: " + "; ".join(errors))

    def before_train(self) -> None:
        """Colocated: servers release all GPU memory, then the trainer reloads its state."""
        if not self.colocated:
            return
        self._post_all("/release_memory_occupation", None)
        self.released = set(MEMORY_TAGS) if self.server_urls() else set()
        self._record("before_train", "release_memory_occupation")
        if self.trainer_offloaded:
            self.reload_trainer()
            self.trainer_offloaded = False
            self._record("before_train", "reload_trainer")

    def before_weight_sync(self) -> None:
        """Colocated: the trainer offloads to CPU, then servers get their weight memory back."""
        if not self.colocated:
            return
        if not self.trainer_offloaded:
            self.offload_trainer()
            self.trainer_offloaded = True
            self._record("before_weight_sync", "offload_trainer")
        if "weights" in self.released:
            self._post_all("/resume_memory_occupation", ["weights"])
            self.released.discard("weights")
            self._record("before_weight_sync", "resume_memory_occupation:weights")

    def before_rollout(self) -> None:
        """Colocated: servers get their KV cache (and CUDA graphs) back; generation may start."""
        if not self.colocated:
            return
        self.before_weight_sync()  # no-op when it already ran since the last before_train
        tags = [t for t in _KV_TAGS if t in self.released]
        if tags:
            self._post_all("/resume_memory_occupation", tags)
            self.released.difference_update(tags)
            self._record("before_rollout", "resume_memory_occupation:" + ",".join(tags))

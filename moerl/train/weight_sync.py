"""The trainer side of weight sync: export the actor's weights and push them to every rollout server.

Pushing goes through RolloutCluster.update_weights (retry on the survivors when a server dies during the
push; restore a restarted server) with the transport of rollout.weight_sync (moerl.rollout.weight_sync:
disk | tensor | distributed). Colocated placement (moerl.rollout.placement) releases / resumes server
memory and offloads the trainer around it. In RL the RolloutManager wraps every push (pause / drain,
push, continue).

``rollout.weight_dtype`` is a state-dict transform applied here, before the mode-specific send, so
every mode carries the same tensors (:func:`rollout_weights`, moerl.precision.fp8_checkpoint): fp8
sends each quantised Linear weight as ``weight`` float8_e4m3fn + ``weight_scale_inv`` (128 x 128
blocks) and disk mode writes the matching ``quantization_config`` in config.json.

One copy (issue #14): with rollout.weight_sync=tensor, rollout.weight_dtype=auto (the tensors are
sent as exported) and at least one server reached by shared memory (moerl.rollout.weight_sync
.tensor_transports), rank 0 exports straight into a two-slot shared-memory arena
(moerl.rollout.shm_arena.SharedExportArena) instead of private clones, and the sync then sends every
tensor's handle in one request per server. The failover restorer keeps the slot of the version it
restores; the next export goes into the other slot, and a slot is published (may be overwritten two
exports later) only once its push succeeded. Without rollout.failover (no restorer) the arena has
one slot, overwritten by each export. bf16 / fp8 make new private tensors, so they keep the
bucketed path, as does a cluster with only remote servers.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Callable, Optional

from moerl.precision.fp8_checkpoint import rollout_hf_config, rollout_state_dict
from moerl.rollout.launcher import RolloutCluster, failover_restorer
from moerl.rollout.placement import RolloutPlacement
from moerl.rollout.shm_arena import SharedExportArena
from moerl.rollout.weight_sync import (DistributedWeightUpdater, resolve_master_address, sync_weights,
                                       tensor_transports)
from moerl.runtime import world
from moerl.train.offload import ActorOffloader

if TYPE_CHECKING:  # annotations only (no import at run time)
    from moerl.train.setup import RunContext
    from moerl.train.actor import MegatronActor


def rollout_weights(rollout_cfg, hf_state_dict, hf_config):
    """``(state dict, config)`` as the rollout servers receive them for ``rollout.weight_dtype``
    (``rollout_cfg`` = the recipe's rollout section): also the layout of the initial checkpoint the
    servers start from, so SGLang builds its FP8 layers when weight_dtype=fp8. DeepSeek-V3's MTP layers
    are left out (deepseek_v3.without_mtp: the servers run the main model).
    Raises: ValueError from quantisation (a NaN/inf weight, named)."""
    wd = rollout_cfg.weight_dtype
    if getattr(hf_config, "num_nextn_predict_layers", 0) and getattr(hf_config, "model_type", None) == "deepseek_v3":
        from moerl.models.families.deepseek_v3 import without_mtp  # servers run the main model, no MTP layers

        hf_state_dict, hf_config = without_mtp(hf_state_dict, hf_config)
    return rollout_state_dict(hf_state_dict, wd), rollout_hf_config(hf_config, wd)


class WeightSync:
    """Pushes the actor's weights to every rollout server and tracks weight_version.

    Collective: every rank calls it (the HF export gathers the TP/EP/PP shards onto rank 0); only
    rank 0, which holds ``cluster``, talks to the servers (``cluster`` is None elsewhere)."""

    def __init__(self, ctx: RunContext, cluster: Optional[RolloutCluster], version: int = 0):
        """Raises ValueError (before any push) when rollout.weight_sync=distributed and the servers'
        rendezvous address (rollout.weight_sync_master_address, else rollout.host; "auto" resolved)
        is loopback / wildcard while some server runs on another machine."""
        self.ctx, self.cluster, self.version = ctx, cluster, version
        ro = ctx.cfg.rollout
        self.updater: Optional[DistributedWeightUpdater] = None  # rollout.weight_sync == "distributed"
        self.tp_sizes: dict[str, int] = {}  # tensor mode: each server's tp_size, asked once (server_tp_sizes)
        self.master_address: Optional[str] = None
        if cluster is not None and ro.weight_sync == "distributed":
            self.master_address = resolve_master_address(ro.weight_sync_master_address, ro.host,
                                                         list(cluster.server_urls) + list(cluster.extra_worker_urls))
        # rollout.placement: colocated releases / resumes server memory around training (every rank
        # calls the trainer offload hooks; rank 0 alone talks to the servers). Colocated: the actors
        # given to offload_with() go to host memory while rollout runs (moerl.train.offload).
        # Released / resumed: the live servers moerl started on every node (this cluster's and the
        # other nodes', RolloutCluster.colocated_server_urls), never rollout.external_urls (not
        # moerl's: they keep their memory and only get the weights). With several ranks a barrier
        # follows every trainer offload and precedes every reload, so rank 0 resumes the servers only
        # once every rank has offloaded, and no rank reloads before rank 0 released the servers.
        off = self.offloader = ActorOffloader([], log=world.log) if ro.placement == "colocated" else None

        def offload() -> None:
            off.offload()
            world.barrier()

        def reload() -> None:
            world.barrier()
            off.reload()

        # rollout.weight_sync=tensor, weight_dtype=auto, some server on this machine: export into shared memory
        self.arena: Optional[SharedExportArena] = None
        if cluster is not None and ro.weight_sync == "tensor" and ro.weight_dtype == "auto":
            urls = list(cluster.server_urls) + list(getattr(cluster, "extra_worker_urls", ()))
            if "shm" in tensor_transports(urls).values():  # two slots only when a restorer keeps one
                self.arena = SharedExportArena(slots=2 if ro.failover else 1)

        self.placement = RolloutPlacement(ro.placement,
                                          cluster.colocated_server_urls if cluster is not None else None,
                                          offload_trainer=offload if off else None,
                                          reload_trainer=reload if off else None)

    def offload_with(self, actor, include_optimizer: bool = True) -> None:
        """Colocated placement: offload ``actor`` with the trainer (weights only when
        include_optimizer is False, e.g. the reference policy); no-op otherwise."""
        if self.offloader is not None:
            self.offloader.add(actor, include_optimizer)

    def trainer_loaded(self):
        """Context in which the offloaded actors are on the device (reloaded, offloaded again on
        exit): checkpoints, exports and optimizer rebuilds between rollouts."""
        return self.offloader.loaded() if self.offloader is not None else contextlib.nullcontext()

    def republish(self, actor: MegatronActor) -> str:
        """Push the weights again under the CURRENT version (fresh servers after a resume: the weights
        are the ones that version named when the checkpoint was taken). Collective like a push."""
        self.version -= 1
        return self(actor)

    def __call__(self, actor: MegatronActor) -> str:
        """Export and push now (collective); returns the new weight_version."""
        return self.export(actor)()

    def export(self, actor: MegatronActor) -> Callable[[], str]:
        """The collective half of a push: the next weight_version's HF export (gathered onto rank 0,
        into the shared-memory arena when there is one). Returns ``push()``, which sends it to the
        servers (rank 0; a no-op elsewhere) and returns the version string. ``push`` may run on
        another thread (RolloutManager's background push, rollout.background_push) while the trainer
        goes on; it must have returned before the next ``export`` (which may reuse the arena slot)."""
        self.version += 1
        version = str(self.version)
        slot = self.arena.next() if self.arena is not None else None  # never the restorer's slot
        with self.trainer_loaded():
            hf_sd = (actor.export_hf_state_dict(dst=0) if slot is None
                     else actor.export_hf_state_dict(dst=0, out_alloc=slot.alloc))
        hf_config = None
        if self.cluster is not None:
            hf_sd, hf_config = rollout_weights(self.ctx.cfg.rollout, hf_sd, self.ctx.hf_config)  # weight_dtype

        def push() -> str:
            self.placement.before_weight_sync()
            if self.cluster is not None:
                self._send(hf_sd, hf_config, version, slot)
            self.placement.before_rollout()
            return version

        return push

    def _send(self, hf_sd: dict, hf_config, version: str, slot) -> None:
        """Rank 0: ``hf_sd`` (as the servers receive it) to every live server (failover-aware),
        transport rollout.weight_sync."""
        ro = self.ctx.cfg.rollout
        bucket_bytes = int(ro.weight_sync_bucket_mb * (1 << 20))
        out_root = self.ctx.run_dir / "weights"

        def push(urls: list[str]) -> None:
            if ro.weight_sync == "distributed" and (self.updater is None or self.updater.server_urls != urls):
                if self.updater is not None:
                    self.updater.close()
                    self.updater = None
                if urls:  # [] (failover: every server restarting): nothing to push, the restorer catches up
                    self.updater = DistributedWeightUpdater(urls, master_address=self.master_address,
                                                            backend=ro.weight_sync_backend)
            try:
                sync_weights(ro.weight_sync, urls, hf_sd, version, bucket_bytes=bucket_bytes,
                             hf_config=hf_config, out_root=out_root, updater=self.updater,
                             http_client=self.cluster.http_client(),  # kept alive: CPU on the trainer's core
                             tp_cache=self.tp_sizes)
            except Exception:
                self.tp_sizes.clear()  # a restarted or replaced server is asked again
                if self.updater is not None:  # the group may be out of step: rebuild it next time
                    self.updater.close()
                    self.updater = None
                raise

        def restore(url: str) -> None:  # what a restarted server receives before it serves again;
            # built when called, so disk mode finds (and reloads) the version directory push wrote
            failover_restorer(ro.weight_sync, hf_sd, version, out_root, bucket_bytes=bucket_bytes)(url)

        # A server that dies during the push (failover on) is restarted and restored later; the
        # cluster retries the push once on the survivors (RolloutCluster.update_weights).
        self.cluster.update_weights(version, push, restore=restore if ro.failover else None)
        if slot is not None and ro.failover:  # the restorer holds this slot's tensors: the next export avoids it
            self.arena.publish(slot)

#!/usr/bin/env python
"""Benchmark moerl's three weight-sync modes against a plain memory copy of the same bytes.

A random Qwen3-MoE of about ``--params`` parameters (fp32) is served by ``--servers`` moerl
reference servers (``python -m moerl.rollout.server``, real HTTP on 127.0.0.1, one thread each);
the trainer side (this process) holds a second random copy of the weights as an HF state dict and
pushes it with moerl.rollout.weight_sync in every mode:

* ``disk``        sharded HF safetensors written (fsynced) per version, /update_weights_from_disk.
* ``tensor``      what ``moerl train`` does with rollout.weight_sync=tensor, weight_dtype=auto and servers
                  on this host (the servers here are on 127.0.0.1): the HF state dict lives in the
                  trainer's shared-memory export arena (moerl.rollout.shm_arena.SharedExportArena, two
                  slots alternating, as WeightSync uses it), so every tensor travels by its own handle,
                  all of them in ONE /update_weights_from_tensor per server; the only copy is the server's
                  into its parameters. Filling the arena is the export's own copy (the export clones into
                  private memory without the arena), which every mode pays and no mode times: it is done
                  before the timer starts.
* ``tensor private`` the trainer's tensors in private memory (weight_dtype bf16 / fp8, or an export
                  without the arena): /update_weights_from_tensor per bucket, each bucket copied into a
                  reusable shared-memory buffer and applied by the server (two copies). With
                  ``--tensor-transport bytes`` this is the only tensor row and the tensors travel inline
                  (base64 in the JSON), as to a server on another host.
* ``distributed`` /init_weights_update_group once (not timed), then per bucket
                  /update_weights_from_distributed + a gloo broadcast from the trainer.

``--weight-dtypes`` adds rows per rollout.weight_dtype (default ``auto fp8``; the arena row is for
``auto`` only, as in ``moerl train``): ``fp8`` times the
trainer's blockwise FP8 quantisation (moerl.precision.fp8_checkpoint.rollout_state_dict, 128x128
blocks, router / norms / embeddings kept) plus the sync of the quantised state dict (about a quarter
of the fp32 bytes) and the servers' dequantisation; its MB/s still counts the fp32 model bytes, so
the rows compare "model synced per second". ``bf16`` casts to bfloat16 before sending.

Each timed sync ends when every server reports the new weight_version. ``memcpy`` copies the same
tensors into preallocated buffers (``Tensor.copy_``) in this process: the ceiling for moving the
bytes once. It is timed before the syncs and again after every timed sync (its median over all of
them is the reference), so the ratio compares the same stretch of time on a shared machine.
Columns: median wall seconds over ``--runs`` runs, bytes/s (model bytes / seconds; with several
servers every server receives all of them, the figure counts them once), and the ratio to
memcpy's bytes/s. The first sync of each mode is a warm-up and is not timed (the first three of the
arena row: its slots settle into one /dev/shm file each by the third export, and the server maps and
faults in each new file once; moerl.rollout.shm_arena).

Usage: python tools/bench_weight_sync.py [--params 100e6] [--bucket-mb 64] [--runs 3] [--servers 1]
       [--weight-dtypes auto fp8] [--tensor-transport auto] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402


def model_overrides(params: float) -> dict:
    """Qwen3-MoE shape with about ``params`` parameters: hidden 512, 8 experts of width 512, top-2,
    as many layers as needed (about 7.1M parameters per layer)."""
    per_layer = 8 * 3 * 512 * 512 + 2 * 512 * 512 + 2 * 512 * 256 + 512 * 8
    layers = max(1, round(params / per_layer))
    return dict(hidden_size=512, intermediate_size=1024, moe_intermediate_size=512, num_hidden_layers=layers,
                num_attention_heads=8, num_key_value_heads=4, head_dim=64, num_experts=8, num_experts_per_tok=2)


def _free_ports(n: int) -> int:
    sys.path.insert(0, str(REPO / "tests"))
    from _mp_helpers import free_port_block

    return free_port_block(n)


def bench_memcpy(sd: dict, runs: int) -> list[float]:
    """Seconds to copy every tensor of ``sd`` into a preallocated buffer, per run."""
    dst = {n: torch.empty_like(t) for n, t in sd.items()}
    out = []
    for _ in range(runs + 1):
        t0 = time.perf_counter()
        for n, t in sd.items():
            dst[n].copy_(t)
        out.append(time.perf_counter() - t0)
    return out[1:]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--params", type=float, default=100e6, help="approximate parameter count (fp32)")
    p.add_argument("--bucket-mb", type=float, default=64.0, help="bucket / shard size in MiB")
    p.add_argument("--runs", type=int, default=3, help="timed runs per mode (median reported)")
    p.add_argument("--servers", type=int, default=1, help="reference servers to sync")
    p.add_argument("--modes", nargs="+", default=["disk", "tensor", "distributed"])
    p.add_argument("--json", default=None, help="also write the results here")
    p.add_argument("--weight-dtypes", nargs="+", default=["auto", "fp8"], choices=["auto", "bf16", "fp8"],
                   help="rollout.weight_dtype variants of every mode (fp8: blockwise quantisation timed too)")
    p.add_argument("--tensor-transport", default="auto", choices=["auto", "shm", "bytes"],
                   help="tensor mode: shm handles (auto: for servers on this host) or inline bytes")
    args = p.parse_args(argv)
    if args.runs < 1 or args.servers < 1 or args.bucket_mb <= 0:
        p.error("--runs and --servers must be >= 1 and --bucket-mb > 0")

    from moerl.rollout.launcher import wait_healthy
    from moerl.rollout.server import load_safetensors_dir
    from moerl.rollout.testing import make_tiny_moe_checkpoint
    from moerl.precision.fp8_checkpoint import rollout_hf_config, rollout_state_dict
    from moerl.rollout.shm_arena import SharedExportArena
    from moerl.rollout.weight_sync import DistributedWeightUpdater, sync_weights, tensor_transports

    torch.set_num_threads(1)
    bucket_bytes = int(args.bucket_mb * (1 << 20))
    with tempfile.TemporaryDirectory(prefix="moerl_bench_ws_") as tmp:
        served, trainer = os.path.join(tmp, "served"), os.path.join(tmp, "trainer")
        ov = model_overrides(args.params)
        make_tiny_moe_checkpoint(served, seed=0, **ov)
        make_tiny_moe_checkpoint(trainer, seed=1, **ov)
        sd = dict(load_safetensors_dir(trainer))
        arena = SharedExportArena()
        nbytes = sum(t.numel() * t.element_size() for t in sd.values())
        n_params = sum(t.numel() for t in sd.values())
        from transformers import AutoConfig

        hf_config = AutoConfig.from_pretrained(trainer)
        print(f"model: {n_params / 1e6:.1f}M parameters, {nbytes / 2**20:.0f} MiB fp32, {len(sd)} tensors, "
              f"{ov['num_hidden_layers']} layers; bucket {args.bucket_mb:g} MiB; {args.servers} server(s); "
              f"{args.runs} runs", flush=True)

        base = _free_ports(args.servers)
        urls = [f"http://127.0.0.1:{base + i}" for i in range(args.servers)]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
        procs = [subprocess.Popen([sys.executable, "-m", "moerl.rollout.server", "--model-path", served, "--port",
                                   str(base + i), "--num-threads", "1", "--log-file",
                                   os.path.join(tmp, f"server{i}.log")], env=env) for i in range(args.servers)]
        results: dict[str, list[float]] = {"memcpy": bench_memcpy(sd, args.runs)}
        updater = None
        try:
            for i, (u, pr) in enumerate(zip(urls, procs)):
                wait_healthy(u, pr, timeout_s=600.0, what=f"server {i}", interval_s=0.5,
                             log_path=os.path.join(tmp, f"server{i}.log"))
            version = 0
            shm = "shm" in tensor_transports(urls, args.tensor_transport).values()
            rows = []
            for wd in args.weight_dtypes:
                for mode in args.modes:
                    if mode == "tensor" and wd == "auto" and shm:
                        rows.append((wd, mode, True))  # the export arena (what moerl train does)
                    rows.append((wd, mode, False))
            for wd, mode, in_arena in rows:
                if mode == "distributed" and updater is None:
                    updater = DistributedWeightUpdater(urls, backend="gloo", timeout_s=600)
                    updater.init_group()
                if mode == "tensor":
                    used = sorted(set(tensor_transports(urls, args.tensor_transport).values()))
                    print(f"  tensor transport: {'+'.join(used)} (shm = shared-memory handles, bytes = inline "
                          f"base64 in the JSON); trainer tensors {'in the export arena' if in_arena else 'private'}",
                          flush=True)
                times = []
                label = mode + ("" if in_arena or mode != "tensor" or not shm else " private")
                label = label if wd == "auto" else f"{label} {wd}"
                warm = 3 if in_arena else 1  # the arena settles into one file per slot by its third export
                for k in range(args.runs + warm):
                    version += 1
                    slot = None
                    if in_arena:  # the export's own copy, into shared memory (untimed, as every mode's export)
                        slot = arena.next()
                        src = {n: slot.alloc(n, t.shape, t.dtype).copy_(t) for n, t in sd.items()}
                    else:
                        src = sd
                    t0 = time.perf_counter()
                    sent = rollout_state_dict(src, wd)  # rollout.weight_dtype (fp8: quantised here, timed)
                    sync_weights(mode, urls, sent, f"bench{version}", bucket_bytes=bucket_bytes,
                                 hf_config=rollout_hf_config(hf_config, wd),
                                 out_root=os.path.join(tmp, "weights"), updater=updater,
                                 tensor_transport=args.tensor_transport)
                    dt = time.perf_counter() - t0
                    if slot is not None:
                        arena.publish(slot)  # as WeightSync: the next export goes into the other slot
                    if k >= warm:
                        times.append(dt)
                        results["memcpy"] += bench_memcpy(sd, 1)  # interleaved: same moments of a shared machine
                    print(f"  {label:<16} run {k}{' (warm-up)' if k < warm else ''}: {dt:.3f} s", flush=True)
                results[label] = times
        finally:
            if updater is not None:
                updater.close()
            for pr in procs:
                pr.kill()
                pr.wait()

    mem_bps = nbytes / statistics.median(results["memcpy"])
    rows = []
    print("\n| mode | median s | MB/s | ratio to memcpy |\n|---|---:|---:|---:|")
    for mode, times in results.items():
        med = statistics.median(times)
        if mode.startswith("tensor"):
            how = "+".join(sorted(set(tensor_transports(urls, args.tensor_transport).values())))
            mode = mode.replace("tensor", f"tensor ({how})")
        bps = nbytes / med
        rows.append({"mode": mode, "median_s": med, "bytes_per_s": bps, "ratio_to_memcpy": bps / mem_bps,
                     "runs_s": times})
        print(f"| {mode} | {med:.3f} | {bps / 1e6:,.0f} | {bps / mem_bps:.4f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"params": n_params, "bytes": nbytes, "bucket_mb": args.bucket_mb, "servers": args.servers,
                       "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Real SGLang rollout servers (GPU): command lines, GPU assignment, per-node start under torchrun.

On a GPU cluster every node's LOCAL RANK 0 starts that node's SGLang servers on its rollout GPUs
(``CUDA_VISIBLE_DEVICES`` per server) with

    python -m sglang.launch_server --model-path M --host H --port P --tp-size T --dp-size D
        --ep-size E --mem-fraction-static F --base-gpu-id 0 --random-seed S [--weight-version V]
        [--enable-memory-saver] [--enable-deterministic-inference] [extra args]

(flags of sglang ``ServerArgs``, checked against the pinned SGLang release's server_args.py by
tests/test_sglang_contract.py), the URLs of all nodes are gathered on global rank 0, and rank 0
runs sglang-router in front of all of them (moerl.rollout.launcher.RolloutCluster with
``extra_worker_urls``). Servers may also be external: the recipe's URLs go straight to the router.

``--enable-memory-saver`` is added for colocated placement (SGLang needs it for
/release_memory_occupation and /resume_memory_occupation); ``--enable-deterministic-inference``
makes SGLang honour the per-request ``sampling_seed`` moerl sends (reproducible samples whichever
server serves them). Servers bind 127.0.0.1 unless the recipe gives another host (a multi-node
router needs a host the other nodes can reach).

SGLang itself is absent from the CPU environment; :func:`require_sglang` (called before any launch)
raises with the install instructions.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from dataclasses import dataclass, field
from typing import Optional, Sequence

from moerl.rollout.client import SGLANG_VERSION
from moerl.rollout.common import resolve_host, resolve_master_address  # resolve_host: re-exported

INSTALL_HINT = (
    f"the 'sglang' rollout backend needs SGLang {SGLANG_VERSION} (CUDA only): build the GPU image "
    f"(`docker build -t moerl:gpu .` from moerl's Dockerfile) or run `pip install \"sglang[all]=={SGLANG_VERSION}\"` "
    f"on a CUDA machine; on CPU use rollout.backend=reference (moerl's reference server)")


def sglang_available() -> bool:
    """True when the ``sglang`` package can be imported here (checked without importing it)."""
    return importlib.util.find_spec("sglang") is not None


def require_sglang() -> None:
    """Raise RuntimeError naming how to install SGLang when it is not importable here."""
    if not sglang_available():
        raise RuntimeError(f"python package 'sglang' is not installed: {INSTALL_HINT}")


def _nnodes_from_env() -> int:
    """Nodes of this torchrun job: WORLD_SIZE / LOCAL_WORLD_SIZE (1 without torchrun)."""
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)) or world)
    return max(1, world // max(1, local))


def check_rollout_environment(rollout, nnodes: Optional[int] = None) -> None:
    """Refuse, before any work, rollout settings this machine cannot run (``moerl train`` calls it
    right after loading the recipe; a recipe may be planned or dry-run anywhere).

    Args:
        rollout: the recipe's ``rollout`` section.
        nnodes: nodes of the job (None: WORLD_SIZE / LOCAL_WORLD_SIZE set by torchrun).

    Raises:
        ValueError: ``rollout.backend=sglang`` without the sglang package (names how to install it),
            ``rollout.weight_sync_backend=nccl`` for the distributed sync without CUDA, or the
            distributed sync with servers on other machines (other nodes' SGLang servers,
            rollout.external_urls on another host) while rollout.weight_sync_master_address (else
            rollout.host, "auto" resolved) is loopback / wildcard
            (moerl.rollout.common.resolve_master_address).
    """
    if rollout.backend == "sglang" and rollout.gpu_ids and not sglang_available():
        raise ValueError(f"rollout.backend=sglang: python package 'sglang' is not installed here: {INSTALL_HINT}")
    if rollout.weight_sync == "distributed" and rollout.weight_sync_backend == "nccl":
        import torch

        if not torch.cuda.is_available():
            raise ValueError("rollout.weight_sync_backend=nccl needs CUDA GPUs (none here); use "
                             "rollout.weight_sync_backend=gloo with the CPU reference server")
    if rollout.weight_sync == "distributed":
        nnodes = _nnodes_from_env() if nnodes is None else nnodes
        others = nnodes - 1 if rollout.backend == "sglang" and rollout.gpu_ids else 0  # each starts servers
        resolve_master_address(rollout.weight_sync_master_address, rollout.host, rollout.external_urls,
                               other_nodes=others)


@dataclass
class SGLangServerSpec:
    """One SGLang server (one ``sglang.launch_server`` process).

    Args:
        model_path: HF model directory or hub id every server loads.
        port: HTTP port.
        gpu_ids: physical GPU indices of this server on its node (CUDA_VISIBLE_DEVICES); their
            number must equal tp_size * dp_size (sglang places tp x dp ranks on the visible GPUs,
            starting at --base-gpu-id 0).
        host: address the server binds (127.0.0.1 unless the recipe says otherwise).
        tp_size, dp_size, ep_size: sglang --tp-size / --dp-size / --ep-size of this server
            (ep_size divides tp_size in SGLang's MoE layout).
        mem_fraction_static: sglang --mem-fraction-static (fraction of GPU memory for weights + KV
            cache), in (0, 1).
        tokenizer_path: optional --tokenizer-path.
        weight_version: optional --weight-version reported before the first weight update.
        enable_memory_saver: --enable-memory-saver (needed by release/resume memory occupation).
        deterministic: --enable-deterministic-inference (honour per-request sampling_seed).
        return_routed_experts: --enable-return-routed-experts (routing replay R3: /generate returns
            meta_info.routed_experts; moe.routing_replay=r3).
        random_seed: --random-seed.
        dtype: --dtype (rollout.dtype: "float32" | "bfloat16"); None leaves SGLang's "auto" (the
            checkpoint's dtype).
        extra_args: further ``--flag value`` strings appended verbatim.
    Raises (``validate``): ValueError naming the field and the fix.
    """

    model_path: str
    port: int
    gpu_ids: Sequence[int]
    host: str = "127.0.0.1"
    tp_size: int = 1
    dp_size: int = 1
    ep_size: int = 1
    mem_fraction_static: float = 0.8
    tokenizer_path: Optional[str] = None
    weight_version: Optional[str] = None
    enable_memory_saver: bool = False
    deterministic: bool = True
    return_routed_experts: bool = False
    random_seed: int = 0
    dtype: Optional[str] = None
    extra_args: Sequence[str] = field(default_factory=tuple)

    def validate(self) -> "SGLangServerSpec":
        for name in ("tp_size", "dp_size", "ep_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"rollout.{name} must be an integer >= 1, got {v!r}")
        if self.tp_size % self.ep_size:
            raise ValueError(f"rollout.ep_size ({self.ep_size}) must divide rollout.tp_size ({self.tp_size}) "
                             f"(SGLang's expert parallelism splits the tp group)")
        if not 0.0 < self.mem_fraction_static < 1.0:
            raise ValueError(f"rollout.mem_fraction_static must be in (0, 1), got {self.mem_fraction_static}")
        if len(self.gpu_ids) != self.tp_size * self.dp_size:
            raise ValueError(f"SGLang server on port {self.port} got {len(self.gpu_ids)} GPUs {list(self.gpu_ids)} "
                             f"but needs tp_size * dp_size = {self.tp_size * self.dp_size}")
        if len(set(self.gpu_ids)) != len(self.gpu_ids) or any(g < 0 for g in self.gpu_ids):
            raise ValueError(f"gpu_ids must be distinct non-negative GPU indices, got {list(self.gpu_ids)}")
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be in 1..65535, got {self.port}")
        if not self.model_path:
            raise ValueError("model_path is empty")
        return self

    def argv(self, python: str = sys.executable) -> list[str]:
        """The ``python -m sglang.launch_server`` command line (list of strings)."""
        self.validate()
        argv = [python, "-m", "sglang.launch_server",
                "--model-path", str(self.model_path), "--host", self.host, "--port", str(self.port),
                "--tp-size", str(self.tp_size), "--dp-size", str(self.dp_size), "--ep-size", str(self.ep_size),
                "--mem-fraction-static", repr(float(self.mem_fraction_static)), "--base-gpu-id", "0",
                "--random-seed", str(self.random_seed)]
        if self.tokenizer_path:
            argv += ["--tokenizer-path", str(self.tokenizer_path)]
        if self.dtype is not None:
            argv += ["--dtype", str(self.dtype)]
        if self.weight_version is not None:
            argv += ["--weight-version", str(self.weight_version)]
        if self.enable_memory_saver:
            argv.append("--enable-memory-saver")
        if self.deterministic:
            argv.append("--enable-deterministic-inference")
        if self.return_routed_experts:
            argv.append("--enable-return-routed-experts")
        argv += [str(a) for a in self.extra_args]
        return argv

    def env(self) -> dict:
        """Environment of this server: CUDA_VISIBLE_DEVICES of its GPUs."""
        return {"CUDA_VISIBLE_DEVICES": ",".join(str(g) for g in self.gpu_ids)}


def plan_node_servers(model_path: str, rollout_gpu_ids: Sequence[int], *, tp_size: int = 1, dp_size: int = 1,
                      ep_size: int = 1, base_port: int = 30000, host: str = "127.0.0.1",
                      mem_fraction_static: float = 0.8, enable_memory_saver: bool = False,
                      **kw) -> list[SGLangServerSpec]:
    """Split one node's rollout GPUs into consecutive groups of tp_size * dp_size, one server each
    (server i: GPUs rollout_gpu_ids[i*g:(i+1)*g], port base_port + i).

    Raises:
        ValueError: the GPU count is not a multiple of tp_size * dp_size, or no GPU is given.
    """
    per = tp_size * dp_size
    gpus = list(rollout_gpu_ids)
    if not gpus:
        raise ValueError("rollout.gpu_ids is empty: give the GPUs of each node that serve rollouts")
    if len(gpus) % per:
        raise ValueError(f"{len(gpus)} rollout GPUs {gpus} per node are not a multiple of rollout.tp_size * "
                         f"rollout.dp_size = {per}; change rollout.gpu_ids or the server sizes")
    return [SGLangServerSpec(model_path=model_path, port=base_port + i, gpu_ids=gpus[i * per:(i + 1) * per],
                             host=host, tp_size=tp_size, dp_size=dp_size, ep_size=ep_size,
                             mem_fraction_static=mem_fraction_static, enable_memory_saver=enable_memory_saver,
                             **kw).validate()
            for i in range(len(gpus) // per)]


def node_cluster(specs: Sequence[SGLangServerSpec], *, router_port: int, start_router_here: bool,
                 extra_worker_urls: Sequence[str] = (), log_dir: Optional[str] = None,
                 startup_timeout_s: float = 1800.0, router_policy: str = "cache_aware",
                 failover: bool = False, check_installed: bool = True, peer_worker_urls: Sequence[str] = ()):
    """A RolloutCluster that starts ``specs`` (this node's SGLang servers) as its servers.

    With ``start_router_here`` (global rank 0) the router fronts these servers and
    ``extra_worker_urls`` (other nodes' servers, external URLs); ``peer_worker_urls`` names the
    other nodes' servers among them (colocated placement releases / resumes those too; see
    RolloutCluster.colocated_server_urls). Other nodes call
    :meth:`NodeServers.start` of the returned object instead (servers only, no router).
    Raises RuntimeError (install hint) when SGLang is missing and ``check_installed``.
    """
    from moerl.rollout.launcher import RolloutCluster

    if check_installed:
        require_sglang()
    specs = list(specs)
    if specs:
        hosts = {s.host for s in specs}
        ports = [s.port for s in specs]
        if len(hosts) != 1 or ports != list(range(ports[0], ports[0] + len(ports))):
            raise ValueError("a node's servers must share one host and use consecutive ports")
    cluster = RolloutCluster(
        specs[0].model_path if specs else "", num_servers=len(specs),
        host=specs[0].host if specs else "127.0.0.1", base_port=specs[0].port if specs else router_port + 1,
        router_port=router_port, router_policy=router_policy, startup_timeout_s=startup_timeout_s,
        log_dir=log_dir, server_command=lambda i, port: specs[i].argv(),
        server_env=lambda i: specs[i].env(), extra_worker_urls=extra_worker_urls, failover=failover,
        peer_worker_urls=peer_worker_urls)
    if not start_router_here:
        return NodeServers(cluster)
    return cluster


class NodeServers:
    """This node's servers without a router (local rank 0 of a node other than global rank 0)."""

    def __init__(self, cluster):
        self.cluster = cluster

    def start(self) -> "NodeServers":
        """Start the servers and wait for their /health (RolloutStartupError on failure)."""
        import time

        import tempfile

        c = self.cluster
        c.check_ports()
        c.log_dir = c.log_dir or tempfile.mkdtemp(prefix="moerl_sglang_")
        os.makedirs(c.log_dir, exist_ok=True)
        c._started = True
        for i, url in enumerate(c.server_urls):
            c._servers.append(c._spawn(f"server {i}", i, url, c._server_argv(i, c.base_port + i)))
        c._wait_ready(c._servers, "/health", time.monotonic() + c.startup_timeout_s)
        return self

    def __enter__(self) -> "NodeServers":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.cluster.shutdown()

    @property
    def server_urls(self) -> list[str]:
        return self.cluster.server_urls


def gather_server_urls(local_urls: Sequence[str]) -> list[str]:
    """All nodes' server URLs in node order (torch.distributed all_gather_object over every rank;
    ranks that start no servers pass []). Without an initialised process group: ``local_urls``."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return list(local_urls)
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, list(local_urls))
    return [u for part in out for u in part]


def local_rank() -> int:
    """LOCAL_RANK set by torchrun (0 without torchrun)."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def node_layout() -> tuple[int, int]:
    """``(node_rank, nnodes)`` of this process: torchrun's GROUP_RANK (the node's rank, given by the
    rendezvous; global rank = GROUP_RANK * LOCAL_WORLD_SIZE + LOCAL_RANK) and WORLD_SIZE /
    LOCAL_WORLD_SIZE; ``(0, 1)`` without torchrun."""
    return int(os.environ.get("GROUP_RANK", "0") or 0), _nnodes_from_env()


def launch_reference_rollout(model_path: str, *, num_servers: int, host: str, base_port: int, router_port: int,
                             external_urls: Sequence[str] = (), **cluster_kw):
    """Collective under torchrun (every rank calls it): the reference rollout servers of the whole job,
    ``num_servers`` (rollout.num_servers) PER NODE, started by each node's local rank 0.

    Node ``n`` (torchrun GROUP_RANK) serves on ports ``base_port + n * num_servers ..`` (distinct, so
    that nodes sharing one machine, e.g. two torchrun agents on loopback, do not collide); the URLs are
    all-gathered and global rank 0 returns a (not yet started) RolloutCluster that starts node 0's
    servers and sglang-router in front of every node's servers and ``external_urls`` (the other
    nodes' as ``peer_worker_urls``: weight syncs, pauses and colocated release / resume reach them);
    local rank 0 of another node returns a :class:`NodeServers` (its servers, no router); every other
    rank returns None. One node: rank 0's RolloutCluster, as before. ``cluster_kw`` goes to
    RolloutCluster (threads_per_server, dtype, log_dir, failover, ...).

    Raises:
        moerl.errors.PortError: rollout.router_port falls among some node's server ports.
        ValueError: ``host`` is loopback (127.0.0.1) while the nodes are different machines (the router
            on node 0 could not reach them): set rollout.host=auto.
    """
    import socket

    import torch.distributed as dist

    from moerl.errors import PortError
    from moerl.rollout.common import is_loopback_or_wildcard
    from moerl.rollout.launcher import RolloutCluster

    node, nnodes = node_layout()
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    if nnodes == 1:
        return RolloutCluster(model_path=model_path, num_servers=num_servers, host=host, base_port=base_port,
                              router_port=router_port, extra_worker_urls=external_urls, **cluster_kw) if rank == 0 else None
    node_base = base_port + node * num_servers
    mine = local_rank() == 0
    if cluster_kw.get("log_dir") and node > 0:  # nodes may share a filesystem (or a machine): own log files
        cluster_kw["log_dir"] = os.path.join(cluster_kw["log_dir"], f"node{node}")
    local = [f"http://{host}:{node_base + i}" for i in range(num_servers)] if mine else []
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, (socket.gethostname() if mine else None, local))
    machines = {h for h, _ in out if h is not None}
    every = [u for _, urls in out for u in urls]
    last = base_port + nnodes * num_servers - 1
    if base_port <= router_port <= last:
        raise PortError(f"rollout.router_port={router_port} is one of the rollout server ports {base_port}..{last} "
                        f"({nnodes} nodes x rollout.num_servers={num_servers}: node n serves on rollout.base_port + "
                        f"n * num_servers ..)", key="rollout.router_port",
                        hint=f"rollout.router_port={last + 1} or below rollout.base_port")
    if len(machines) > 1 and is_loopback_or_wildcard(host):
        raise ValueError(f"rollout servers run on {len(machines)} machines but rollout.host={host} is not an "
                         "address the router on node 0 can reach: set rollout.host=auto (each node's address)")
    if rank == 0:
        from moerl.runtime.world import log

        peers = [u for u in every if u not in local]
        log(f"rollout: {nnodes} nodes, {len(every)} servers behind the router on node 0: "
            + "; ".join(f"node {n}: {urls}" for n, (_, urls) in enumerate(o for o in out if o[0] is not None)))
        return RolloutCluster(model_path=model_path, num_servers=num_servers, host=host, base_port=node_base,
                              router_port=router_port, extra_worker_urls=[*peers, *external_urls],
                              peer_worker_urls=peers, **cluster_kw)
    if mine:
        return NodeServers(RolloutCluster(model_path=model_path, num_servers=num_servers, host=host,
                                          base_port=node_base, router_port=router_port, **cluster_kw))
    return None


def launch_sglang_rollout(model_path: str, *, rollout_gpu_ids: Sequence[int], router_port: int,
                          base_port: int = 30000, host: str = "127.0.0.1", tp_size: int = 1, dp_size: int = 1,
                          ep_size: int = 1, mem_fraction_static: float = 0.8, colocated: bool = False,
                          external_urls: Sequence[str] = (), log_dir: Optional[str] = None,
                          router_policy: str = "cache_aware", failover: bool = False,
                          startup_timeout_s: float = 1800.0, **spec_kw):
    """Collective (every rank under torchrun): start the rollout servers of the whole job.

    Local rank 0 of every node plans its servers on ``rollout_gpu_ids`` (none when empty: a
    training-only node, or only ``external_urls``); the planned URLs are all-gathered; global rank 0
    returns a (not yet started) RolloutCluster that starts its node's servers and the router in front
    of every node's servers and ``external_urls``; other local-rank-0 ranks return a
    :class:`NodeServers`; all other ranks return None. Use the result as a context manager (None:
    ``contextlib.nullcontext``).

    Raises:
        RuntimeError: SGLang missing on a rank that must start servers (install hint).
        ValueError: bad sizes / GPU lists; host 127.0.0.1 with servers on more than one node.
    """
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    specs: list[SGLangServerSpec] = []
    if local_rank() == 0 and rollout_gpu_ids:
        require_sglang()
        specs = plan_node_servers(model_path, rollout_gpu_ids, tp_size=tp_size, dp_size=dp_size, ep_size=ep_size,
                                  base_port=base_port, host=resolve_host(host),
                                  mem_fraction_static=mem_fraction_static, enable_memory_saver=colocated,
                                  **spec_kw)
    local = [f"http://{s.host}:{s.port}" for s in specs]
    every = gather_server_urls(local)
    if not every and not external_urls:
        raise ValueError("no rollout server: give rollout.gpu_ids (servers started here) or rollout.external_urls")
    if len(every) != len(local) and any(s.host in ("127.0.0.1", "localhost") for s in specs):
        raise ValueError("rollout servers run on several nodes but bind 127.0.0.1; set rollout.host to 'auto' "
                         "(this node's address) or 0.0.0.0-reachable address")
    if rank == 0:
        peers = [u for u in every if u not in local]  # started by moerl on other nodes (colocated there)
        others = peers + [u.rstrip("/") for u in external_urls]
        return node_cluster(specs, router_port=router_port, start_router_here=True, extra_worker_urls=others,
                            log_dir=log_dir, startup_timeout_s=startup_timeout_s, router_policy=router_policy,
                            failover=failover, check_installed=bool(specs), peer_worker_urls=peers)
    if specs:
        return node_cluster(specs, router_port=router_port, start_router_here=False, log_dir=log_dir,
                            startup_timeout_s=startup_timeout_s, check_installed=True)
    return None


# ----------------------------------------------------------------------------- dry check (no GPU, no SGLang)


def fetch_sglang_wheel(cache_dir: str, version: str = SGLANG_VERSION, timeout_s: float = 600.0) -> str:
    """Path of the sglang ``version`` wheel in ``cache_dir``, downloaded with ``pip download --no-deps``
    when missing (never installed). Raises RuntimeError with pip's message when the download fails."""
    import glob
    import subprocess

    os.makedirs(cache_dir, exist_ok=True)
    found = sorted(glob.glob(os.path.join(cache_dir, f"sglang-{version}-*.whl")))
    if not found:
        p = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", f"sglang=={version}",
                            "-d", cache_dir], capture_output=True, text=True, timeout=timeout_s)
        found = sorted(glob.glob(os.path.join(cache_dir, f"sglang-{version}-*.whl")))
        if p.returncode != 0 or not found:
            raise RuntimeError(f"pip download sglang=={version} failed: {(p.stderr or p.stdout)[-800:]}")
    return found[-1]


def sglang_launch_flags(wheel_path: str) -> dict[str, bool]:
    """{--flag: is_switch} of ``sglang.launch_server``, parsed (ast, no import) from the
    ``parser.add_argument`` calls of sglang/srt/server_args.py inside the wheel."""
    import ast
    import zipfile

    with zipfile.ZipFile(wheel_path) as zf:
        tree = ast.parse(zf.read("sglang/srt/server_args.py").decode())
    flags = {}
    for n in ast.walk(tree):
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "add_argument":
            action = next((k.value.value for k in n.keywords
                           if k.arg == "action" and isinstance(k.value, ast.Constant)), None)
            for a in n.args:
                if isinstance(a, ast.Constant) and str(a.value).startswith("--"):
                    flags[a.value] = action in ("store_true", "store_false")
    return flags


def check_server_argv(argv: Sequence[str], flags: dict[str, bool]) -> None:
    """Raise ValueError unless ``argv`` is ``python -m sglang.launch_server`` followed by known
    flags, each switch alone and every other flag with one value."""
    argv = list(argv)
    if argv[1:3] != ["-m", "sglang.launch_server"]:
        raise ValueError(f"not a sglang.launch_server command line: {argv[:3]}")
    k = 3
    while k < len(argv):
        f = argv[k]
        if f not in flags:
            raise ValueError(f"{f} is not an argument of sglang {SGLANG_VERSION} launch_server")
        if flags[f]:
            k += 1
            continue
        if k + 1 >= len(argv) or argv[k + 1].startswith("--"):
            raise ValueError(f"{f} needs a value")
        k += 2


def dry_run(cfg, nnodes: int = 1, model_path: Optional[str] = None) -> list[dict]:
    """The commands of a recipe's SGLang rollout, nothing started: per node and server
    ``{"node", "env", "argv"}`` (CUDA_VISIBLE_DEVICES in env), then the router's (node 0, env {})."""
    from moerl.rollout.launcher import RolloutCluster

    ro = cfg.rollout
    model = model_path or "MODEL_PATH"  # the trainer's HF export of weight version 0 at run time
    if nnodes > 1 and ro.gpu_ids and ro.host in ("127.0.0.1", "localhost"):
        raise ValueError(f"rollout servers run on {nnodes} nodes but rollout.host={ro.host} binds loopback, which "
                         "the router on node 0 cannot reach; set rollout.host=auto (each node's address)")
    plan = []
    urls = []
    for node in range(nnodes):
        host = f"NODE{node}_ADDRESS" if ro.host == "auto" else ro.host
        specs = plan_node_servers(model, ro.gpu_ids, tp_size=ro.server_tp_size, dp_size=ro.server_dp_size,
                                  ep_size=ro.server_ep_size, base_port=ro.base_port, host=host,
                                  mem_fraction_static=ro.mem_fraction_static,
                                  enable_memory_saver=ro.placement == "colocated", random_seed=cfg.seed,
                                  return_routed_experts=cfg.moe.routing_replay == "r3") \
            if ro.gpu_ids else []
        for s in specs:
            plan.append({"node": node, "env": s.env(), "argv": s.argv("python")})
            urls.append(f"http://{s.host}:{s.port}")
    c = RolloutCluster("", num_servers=0, host=ro.host if ro.host != "auto" else "0.0.0.0",
                       router_port=ro.router_port, base_port=ro.router_port + 1, router_policy=ro.router_policy,
                       server_command=lambda i, p: [], extra_worker_urls=urls + list(ro.external_urls))
    plan.append({"node": 0, "env": {}, "argv": ["python"] + c._router_argv()[1:]})
    return plan


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m moerl.rollout.sglang_launcher RECIPE [key=value ...] [--nnodes N] [--check-wheel-cache DIR]``:
    print the SGLang server and router commands of a recipe (rollout.backend=sglang) and, with
    --check-wheel-cache, check every server flag against the pinned SGLang wheel's server_args.py."""
    import argparse

    from moerl.config.loader import load_config

    p = argparse.ArgumentParser(prog="python -m moerl.rollout.sglang_launcher", description=main.__doc__)
    p.add_argument("recipe")
    p.add_argument("overrides", nargs="*", help="dotted key=value recipe overrides")
    p.add_argument("--nnodes", type=int, default=1)
    p.add_argument("--model-path", default=None)
    p.add_argument("--check-wheel-cache", default=None, help="directory holding / receiving the sglang wheel")
    a = p.parse_intermixed_args(argv)
    cfg = load_config(a.recipe, a.overrides)
    plan = dry_run(cfg, a.nnodes, a.model_path)
    for e in plan:
        env = " ".join(f"{k}={v}" for k, v in e["env"].items())
        print(f"node {e['node']}: {env + ' ' if env else ''}{' '.join(e['argv'])}")
    if a.check_wheel_cache:
        flags = sglang_launch_flags(fetch_sglang_wheel(a.check_wheel_cache))
        for e in plan:
            if "sglang.launch_server" in e["argv"]:
                check_server_argv(e["argv"], flags)
        print(f"OK: every server flag exists in sglang {SGLANG_VERSION} (server_args.py)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

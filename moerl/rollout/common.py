"""Helpers shared by the rollout modules (launcher, sglang_launcher, weight_sync, the reference server).

A leaf module: it imports no other ``moerl`` module, so every rollout module may import it without
creating an import cycle (launcher -> weight_sync -> sglang_launcher -> launcher used to be one).
Its names stay importable from their old homes: ``resolve_host`` from moerl.rollout.sglang_launcher,
``resolve_master_address`` / ``is_loopback_or_wildcard`` / ``url_host`` / ``remote_server_urls`` /
``_version_dirname`` from moerl.rollout.weight_sync, ``DEFAULT_WEIGHT_VERSION`` from
moerl.rollout.server.

Contents:
  * weight versions: :data:`DEFAULT_WEIGHT_VERSION`, :func:`version_dirname`;
  * /pause_generation modes: :data:`PAUSE_MODES`, :func:`check_pause_mode`;
  * hosts: :func:`resolve_host` ("auto" -> this node's address), :func:`is_loopback_or_wildcard`,
    :func:`url_host`, :func:`remote_server_urls`, :func:`resolve_master_address`;
  * JSON value checks: :func:`is_int`, :func:`is_num` (bool is not a number in SGLang's fields);
  * :func:`per_server`: one call per server URL, in parallel threads;
  * control calls: :func:`managed_server_urls` and :func:`control_urls` (the servers a pause / continue /
    weight update reaches),
    :func:`post_control` (SGLang's /pause_generation and /continue_generation on a kept-alive
    :func:`plain_http_client`).
"""

from __future__ import annotations

import re
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Optional, Sequence, TypeVar

_T = TypeVar("_T")


def per_server(urls: Sequence[str], one: Callable[[str], _T]) -> list[_T]:
    """``[one(url) for url in urls]`` with the calls run in parallel, one thread each (blocking HTTP to
    several servers: pause / continue, weight-update posts, GC freeze); a URL given twice is called twice.
    ``one`` should return its failure rather than raise; an exception it raises propagates (after every
    call has ended). No URLs: []; one URL: called in this thread (a pool thread per call was CPU on the
    trainer's core at every pause / continue of an async weight push)."""
    if not urls:
        return []
    if len(urls) == 1:
        return [one(urls[0])]
    with ThreadPoolExecutor(max_workers=len(urls)) as pool:
        return list(pool.map(one, urls))

def plain_http_client(urls: Sequence[str], timeout_s: float):
    """An ``httpx.Client`` (keep-alive connections, idle ones closed after 2 s) for control calls to ``urls``;
    when all are plain http:// it skips loading the CA bundle, which costs ~15-30 ms of CPU per client.
    ``timeout_s``: the default per-request timeout in seconds (a request may pass its own)."""
    import httpx

    # idle connections are dropped after 2 s, before a server closes them (uvicorn's keep-alive timeout is 5 s,
    # SGLang's too): a request on a connection the server is closing would fail without a retry
    return httpx.Client(timeout=timeout_s, trust_env=False, limits=httpx.Limits(keepalive_expiry=2.0),
                        verify=not all(u.startswith("http://") for u in urls))


def managed_server_urls(cluster) -> list[str]:
    """The servers ``cluster`` started that a pause, continue or weight update reaches: ``live_server_urls()``
    with failover (a dead one restarts and is restored later), all ``server_urls`` without (a dead one is
    then named by the call that fails on it)."""
    return cluster.live_server_urls() if cluster.failover else list(cluster.server_urls)


def control_urls(cluster, managed: Optional[Sequence[str]] = None) -> list[str]:
    """The servers a pause, continue or weight update of ``cluster`` reaches, in order: ``managed`` (default
    :func:`managed_server_urls`; a caller that needs that list too passes the one it read, so both come from
    one read of the live set), then every ``extra_worker_urls`` not among them (other nodes' servers,
    external URLs behind the router). ``cluster``: a moerl.rollout.launcher.RolloutCluster or an object
    with the same four attributes (the producer process's view of it)."""
    managed = managed_server_urls(cluster) if managed is None else list(managed)
    return managed + [u for u in cluster.extra_worker_urls if u not in managed]


def post_control(urls: Sequence[str], path: str, mode: Optional[str], timeout_s: float,
                 http) -> dict[str, Optional[str]]:
    """SGLang's POST ``path`` (``"/pause_generation"`` with body ``{"mode": mode}``, or
    ``"/continue_generation"`` with ``{}`` when ``mode`` is None) to every URL, in parallel
    (:func:`per_server`), on ``http`` (an ``httpx.Client``, e.g. :func:`plain_http_client`: its kept-alive
    connections cost about half the CPU of a new client per call, which matters on the trainer's core
    at every async weight update). One attempt each, ``timeout_s`` seconds.

    Returns: {url: None when the server answered 2xx, else the error text naming the URL and the HTTP
    status and body, or the connection error}. Raises nothing for a failed server (the caller decides:
    RolloutCluster names it or lets failover skip it)."""
    import httpx

    body = {} if mode is None else {"mode": mode}

    def one(url: str) -> Optional[str]:
        try:
            r = http.post(url.rstrip("/") + path, json=body, timeout=timeout_s)
        except httpx.HTTPError as e:
            return f"POST {url}{path}: {type(e).__name__}: {e}"
        if r.status_code >= 400:
            return f"POST {url}{path}: HTTP {r.status_code}: {r.text[:1000]}"
        return None

    return dict(zip(urls, per_server(list(urls), one)))


#: weight_version a server reports before its first update (SGLang ``ServerArgs.weight_version`` default).
DEFAULT_WEIGHT_VERSION = "default"

#: /pause_generation modes (SGLang io_struct ``PauseGenerationReqInput.mode``:
#: Literal["abort", "retract", "in_place"], default "abort").
PAUSE_MODES = ("abort", "retract", "in_place")
DEFAULT_PAUSE_MODE = "abort"


def check_pause_mode(mode) -> str:
    """``mode`` if it is one of :data:`PAUSE_MODES`.

    Raises:
        ValueError: any other value; the message names the field ``mode`` and the allowed values.
    """
    if not isinstance(mode, str) or mode not in PAUSE_MODES:
        raise ValueError(f"mode must be one of {list(PAUSE_MODES)} (SGLang PauseGenerationReqInput), got {mode!r}")
    return mode


# ----------------------------------------------------------------------------- JSON values


def is_int(v) -> bool:
    """True for a JSON integer (a Python int that is not a bool)."""
    return isinstance(v, int) and not isinstance(v, bool)


def is_num(v) -> bool:
    """True for a JSON number (int or float, not a bool)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool)


# ----------------------------------------------------------------------------- weight versions


def version_dirname(weight_version: str) -> str:
    """Directory name of one weight version written by the disk weight sync: ``weights_<version>``
    with every character outside ``[A-Za-z0-9._-]`` replaced by ``_`` (e.g. "3" -> "weights_3")."""
    return "weights_" + re.sub(r"[^A-Za-z0-9._-]", "_", weight_version)


# ----------------------------------------------------------------------------- hosts


def resolve_host(host: str) -> str:
    """``host`` unchanged, or for "auto" this node's address (socket.gethostbyname(gethostname())),
    which multi-node rollouts need so that the router on node 0 reaches every node's servers.

    Raises:
        OSError (socket.gaierror): "auto" and this machine's hostname does not resolve.
    """
    import socket

    return socket.gethostbyname(socket.gethostname()) if host == "auto" else host


_LOOPBACK_NAMES = ("localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback")


def is_loopback_or_wildcard(host: str) -> bool:
    """True for an address another machine cannot use to reach this one: ``localhost`` (and its
    aliases), a loopback IP (127.0.0.0/8, ::1) or the wildcard (0.0.0.0, ::)."""
    import ipaddress

    h = host.strip("[]").lower()
    if h in _LOOPBACK_NAMES:
        return True
    try:
        ip = ipaddress.ip_address(h)
    except ValueError:
        return False
    return ip.is_loopback or ip.is_unspecified


def this_machines_addresses() -> set[str]:
    """Names and IPs of this machine: hostname, FQDN, gethostbyname(hostname) and every interface
    address psutil reports (lower-case)."""
    import socket

    out = {socket.gethostname().lower(), socket.getfqdn().lower()}
    try:
        out.add(socket.gethostbyname(socket.gethostname()))
    except OSError:
        pass
    try:
        import psutil

        for addrs in psutil.net_if_addrs().values():
            for a in addrs:
                if a.family in (socket.AF_INET, socket.AF_INET6):
                    out.add(a.address.split("%")[0].lower())
    except Exception:  # psutil missing or the interfaces cannot be read: names only
        pass
    return out


def url_host(url: str) -> str:
    """The host of ``url`` (``http://10.0.0.2:30000`` -> ``10.0.0.2``; IPv6 without brackets)."""
    import httpx

    return (httpx.URL(url).host or "").lower()


def remote_server_urls(server_urls: Sequence[str]) -> list[str]:
    """The URLs among ``server_urls`` whose host is not this machine (neither loopback / wildcard
    nor one of its names or interface addresses). Hostnames are not looked up in DNS: an unknown
    name counts as remote."""
    here = None
    out = []
    for url in server_urls:
        h = url_host(url)
        if is_loopback_or_wildcard(h):
            continue
        if here is None:
            here = this_machines_addresses()
        if h not in here:
            out.append(url)
    return out


def resolve_master_address(master_address: Optional[str], host: str, server_urls: Sequence[str] = (), *,
                           other_nodes: int = 0) -> str:
    """The address rollout servers reach trainer rank 0 at for the distributed weight sync:
    ``rollout.weight_sync_master_address``, else ``rollout.host``, with "auto" resolved to this
    node's address (:func:`resolve_host`, as for the servers' own host).

    Args:
        master_address: rollout.weight_sync_master_address (None = use ``host``).
        host: rollout.host.
        server_urls: every server the trainer pushes to (own, other nodes', rollout.external_urls).
        other_nodes: nodes other than this one known to start servers before their URLs are known
            (the recipe check: multi-node rollout.backend=sglang); they count as remote.
    Returns: an address (IP or name) of this machine's node.
    Raises:
        ValueError: some server runs on another machine (see :func:`remote_server_urls`) while the
            address is loopback or the wildcard (127.0.0.1, localhost, 0.0.0.0): it could not reach
            the trainer's rendezvous. Names rollout.weight_sync_master_address, rollout.host and the fix.
    """
    given = master_address or host
    field = ("rollout.weight_sync_master_address" if master_address
             else "rollout.host (rollout.weight_sync_master_address unset)")
    addr = resolve_host(given)
    if is_loopback_or_wildcard(addr):
        remote = remote_server_urls(server_urls)
        if remote or other_nodes > 0:
            shown = ", ".join(remote[:3]) + (f" (+{len(remote) - 3} more)" if len(remote) > 3 else "")
            if other_nodes > 0:
                shown = f"the servers of {other_nodes} other node(s)" + (f", {shown}" if shown else "")
            via = f"{given!r} resolves to {addr!r}" if addr != given else f"{addr!r}"
            raise ValueError(
                f"rollout.weight_sync=distributed: the servers join the trainer's weight update group at "
                f"{field} = {via}, a loopback / wildcard address that rollout servers on other machines "
                f"({shown}) cannot reach; set rollout.weight_sync_master_address to an address of trainer "
                f"rank 0's node that they can reach (its cluster IP or hostname)"
                + (", or rollout.host=auto when this node's hostname resolves to such an address"
                   if given != "auto" else ""))
    return addr


#: ports free_port_block / launcher.free_port_below_ephemeral have handed out in this process (never handed out
#: again: two calls before anything binds, e.g. a rollout block and a torchrun master port, must not overlap)
_HANDED_OUT_PORTS: set = set()
_HANDED_OUT_LOCK = threading.Lock()


def claim_ports(ports: range, is_free) -> bool:
    """Hand out ``ports`` (all or none): True when none was handed out before in this process and
    ``is_free(port)`` holds for each; they are then recorded as handed out. Thread-safe."""
    with _HANDED_OUT_LOCK:
        if not _HANDED_OUT_PORTS.isdisjoint(ports) or not all(is_free(p) for p in ports):
            return False
        _HANDED_OUT_PORTS.update(ports)
        return True


def free_port_block(n: int = 3) -> int:
    """A base port with ``n`` consecutive free ports on 127.0.0.1 below Linux's ephemeral range
    (32768+), so that client sockets of other processes cannot take them between this check and the
    servers' bind (tests and benchmarks that start servers and a router). No port of the block was
    handed out by an earlier call in this process (free-looking until its user binds it).

    Raises:
        RuntimeError: no free block found in 500 tries.
    """
    import os
    import random
    import socket
    import time

    def is_free(p: int) -> bool:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", p))
            except OSError:
                return False
            return True

    rng = random.Random(os.getpid() * 7919 + time.time_ns())
    for _ in range(500):
        base = rng.randrange(20000, 32000 - n)
        if claim_ports(range(base, base + n), is_free):
            return base
    raise RuntimeError("no free port block")

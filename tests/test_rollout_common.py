"""moerl.rollout.common: per_server (one call per server URL, in parallel threads, results in URL order) and free_port_block."""

from __future__ import annotations

import threading

import pytest

from moerl.rollout.common import per_server


def test_per_server_runs_the_calls_at_once_and_keeps_the_order():
    urls = [f"http://127.0.0.1:{30000 + i}" for i in range(4)]
    barrier = threading.Barrier(len(urls), timeout=10)  # passes only if all four calls run together

    def one(url: str):
        barrier.wait()
        return url[-1] if url.endswith("2") else None

    assert per_server(urls, one) == [None, None, "2", None]


def test_per_server_calls_one_url_in_the_calling_thread():
    seen = []
    assert per_server(["a"], lambda u: seen.append(threading.get_ident()) or u * 2) == ["aa"]
    assert seen == [threading.get_ident()]
    with pytest.raises(ZeroDivisionError):
        per_server(["a"], lambda u: 1 / 0)


def test_per_server_calls_a_repeated_url_twice():
    calls = []
    assert per_server(["a", "a"], lambda u: calls.append(u) or f"{u}!") == ["a!", "a!"]
    assert calls == ["a", "a"]


def test_per_server_without_urls_and_with_a_raising_call():
    assert per_server([], lambda u: 1 / 0) == []
    with pytest.raises(ZeroDivisionError):
        per_server(["a", "b"], lambda u: 1 / 0 if u == "b" else u)


def test_free_port_blocks_of_one_process_never_overlap():
    """Calls made before anything binds (a rollout block, then a torchrun master port) used to be able to
    return overlapping ports (random bases in 12,000 ports: ~8 overlaps expected among these 200 blocks);
    now every block is free and disjoint from the earlier ones."""
    import socket

    from moerl.rollout.common import free_port_block

    blocks = [(free_port_block(3), 3) for _ in range(150)] + [(free_port_block(1), 1) for _ in range(50)]
    ports = [p for base, n in blocks for p in range(base, base + n)]
    assert len(ports) == len(set(ports)) == 500
    assert all(20000 <= p < 32000 for p in ports)
    with socket.socket() as s:  # free when handed out
        s.bind(("127.0.0.1", blocks[-1][0]))

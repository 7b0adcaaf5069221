"""The native-kernel build lock (moerl.kernels._build.build_lock): a build killed mid-way leaves torch's
FileBaton file behind, and torch.utils.cpp_extension.load then waits on it for ever; moerl's own flock
(released by the kernel when its holder dies) and its owner record tell a stale file from a live build."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
import warnings

import pytest

from moerl.kernels import _build
from moerl.kernels._build import BUILD_OWNER, TORCH_BATON, build_lock

pytest.importorskip("fcntl")


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _leftover(d, pid: int, host: str = None) -> None:
    """What a moerl build killed mid-way leaves: torch's file and moerl's owner record."""
    (d / TORCH_BATON).write_text("")
    (d / BUILD_OWNER).write_text(f"{host or socket.gethostname()} {pid}")


def test_a_killed_builds_torch_lock_is_removed_with_a_warning(tmp_path):
    _leftover(tmp_path, _dead_pid())
    with pytest.warns(RuntimeWarning, match=r"removed .*lock: torch's build lock left by build process \d+, which was killed"):
        with build_lock(tmp_path):
            assert not (tmp_path / TORCH_BATON).exists()
            assert (tmp_path / BUILD_OWNER).read_text() == f"{socket.gethostname()} {os.getpid()}"
    assert not (tmp_path / BUILD_OWNER).exists()  # a build that ends removes its record


@pytest.mark.parametrize("case", ["no record", "other host"])
def test_a_lock_of_an_unknown_holder_is_left_alone(tmp_path, case):
    """No owner record (an older moerl, another tool) or one of another machine sharing the directory (where
    flock may not reach): the file stays (torch waits for it) and the warning names it."""
    if case == "no record":
        (tmp_path / TORCH_BATON).write_text("")
    else:
        _leftover(tmp_path, _dead_pid(), host="another-host")
    with pytest.warns(RuntimeWarning, match="delete it if no build of the native kernels is running"):
        with build_lock(tmp_path):
            assert (tmp_path / TORCH_BATON).exists()


def test_no_warning_without_a_leftover(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with build_lock(tmp_path):
            pass


def test_a_live_build_is_waited_for_and_a_killed_one_is_not(tmp_path):
    """Another process builds (holds build_lock and torch's file, as a real build does): we wait. It is
    SIGKILLed mid-way (its torch file stays): we get the lock at once and the stale file is gone."""
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import pathlib, time
        from moerl.kernels._build import build_lock
        d = pathlib.Path({str(tmp_path)!r})
        with build_lock(d):
            (d / {TORCH_BATON!r}).write_text("")
            print("held", flush=True)
            time.sleep(120)
        """)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert (tmp_path / TORCH_BATON).exists()  # a build in progress has torch's file
        entered = threading.Event()
        seen_baton = []

        def build() -> None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                with build_lock(tmp_path):
                    seen_baton.append((tmp_path / TORCH_BATON).exists())
                    entered.set()

        t = threading.Thread(target=build, daemon=True)
        t.start()
        assert not entered.wait(1.0)  # a live build holds it
        holder.send_signal(signal.SIGKILL)
        holder.wait()
        assert entered.wait(10.0)
        assert seen_baton == [False]  # the killed build's file was removed before our build
        t.join(5.0)
    finally:
        holder.kill()
        holder.wait()


def test_the_build_runs_under_the_lock(tmp_path, monkeypatch):
    """_build calls cpp_extension.load inside build_lock: a killed build's torch file in the build directory is
    gone before load runs (load itself is replaced: this checks the order, not the compiler)."""
    from torch.utils import cpp_extension

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(_build, "_missing_tools", lambda cuda: None)
    build_dir = _build._build_dir("moerl_kernels_cpu")
    _leftover(build_dir, _dead_pid())
    calls = []

    def fake_load(**kw):
        calls.append((kw["build_directory"], (build_dir / TORCH_BATON).exists()))

    monkeypatch.setattr(cpp_extension, "load", fake_load)
    with pytest.warns(RuntimeWarning, match="which was killed"):
        _build._build("cpu", verbose=False)
    assert calls == [(str(build_dir), False)]

"""Build-on-first-use loader of moerl's native kernels (csrc/) and the report of which
implementation each op uses.

The C++ sources under ``csrc/cpu`` (and, on a CUDA machine, ``csrc/cuda``) are compiled with
``torch.utils.cpp_extension.load`` (ninja + the host C++ compiler) the first time an op needs them,
into ``$TORCH_EXTENSIONS_DIR`` or ``~/.cache/moerl/torch_extensions`` (rebuilt when a source
changes), and register their ops under ``torch.ops.moerl``. ``pip install`` never compiles anything,
so it works on a machine without a compiler; there the ops run their pure-torch references and
:func:`kernel_report` (``moerl doctor``) says so and why.

Environment: ``MOERL_KERNELS=auto`` (default: native when it builds, else the torch reference, with
one warning), ``native`` (a build failure raises), ``torch`` (never build; the references).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import threading
import warnings
from pathlib import Path
from typing import Optional

import torch

__all__ = ["CSRC", "KERNELS_ENV", "NativeBuildError", "kernel_mode", "load_native", "native_available",
           "kernel_report", "cpu_sources", "cuda_sources"]

CSRC = Path(__file__).resolve().parents[2] / "csrc"
KERNELS_ENV = "MOERL_KERNELS"
_MODES = ("auto", "native", "torch")

_lock = threading.Lock()
_state: dict[str, object] = {}  # device kind -> True | error message


class NativeBuildError(RuntimeError):
    """The native kernels could not be built or loaded (the message names the missing tool / the
    compiler error and how to fix it)."""


def kernel_mode() -> str:
    """``$MOERL_KERNELS`` (auto | native | torch).

    Raises:
        moerl.errors.CLIError (a ValueError): another value (names the variable, the choices and the fix).
    """
    from moerl.errors import CLIError

    mode = os.environ.get(KERNELS_ENV, "auto").strip().lower() or "auto"
    if mode not in _MODES:
        raise CLIError(f"environment variable {KERNELS_ENV}={mode!r} is not one of {', '.join(_MODES)}",
                       key=KERNELS_ENV, hint=f"unset it (auto) or set {KERNELS_ENV}=torch to use the pure-torch "
                       "references")
    return mode


def cpu_sources() -> list[Path]:
    """The C++ sources of the CPU extension (csrc/cpu/*.cpp)."""
    return sorted((CSRC / "cpu").glob("*.cpp"))


def cuda_sources() -> list[Path]:
    """The CUDA sources (csrc/cuda/*.cu) and their torch binding (csrc/cuda/*.cpp)."""
    return sorted((CSRC / "cuda").glob("*.cu")) + sorted((CSRC / "cuda").glob("*.cpp"))


def _build_dir(name: str) -> Path:
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or str(Path.home() / ".cache" / "moerl" / "torch_extensions")
    tag = f"py{torch.__version__.split('+')[0].replace('.', '_')}_{name}"
    path = Path(root) / tag
    path.mkdir(parents=True, exist_ok=True)
    return path


#: torch.utils.cpp_extension's cross-process build lock: a FILE in the build directory (FileBaton) that a build
#: killed mid-way (kill -9, a crash: not Ctrl-C, which removes it) leaves behind, after which every later build
#: of that extension polls for it for ever
TORCH_BATON = "lock"
#: moerl's flock file and the record of the build holding it ("<host> <pid>"), both in the build directory
BUILD_LOCK, BUILD_OWNER = "moerl_build.lock", "moerl_build.owner"


def _stale_baton(build_dir: Path) -> Optional[str]:
    """Called holding the flock: why torch's lock file in ``build_dir`` is stale, or None when that is not
    known (no file; no owner record: an older moerl or another tool; a record of another host, where the
    flock may not reach). A record is written only under the flock and removed when its build ends, so one
    of this host found under the flock belongs to a build that was killed (its process may still be a
    zombie, its pid reused: neither is asked)."""
    if not (build_dir / TORCH_BATON).exists():
        return None
    try:
        host, pid = (build_dir / BUILD_OWNER).read_text().split()
        pid_i = int(pid)
    except (OSError, ValueError):
        return None
    if host != socket.gethostname():
        return None
    return f"left by build process {pid_i}, which was killed"


@contextlib.contextmanager
def build_lock(build_dir: Path):
    """Hold the build of the extension in ``build_dir`` for this process: ``fcntl.flock`` on
    ``<build_dir>/moerl_build.lock`` (released by the kernel when its holder dies, even by SIGKILL), with
    ``moerl_build.owner`` recording this host and pid while the build runs.

    A torch FileBaton file (:data:`TORCH_BATON`) found under the lock with an owner record of this machine
    was left by a killed build (see :func:`_stale_baton`): it is removed with a warning naming it
    (``cpp_extension.load`` would wait on it for ever). Any other leftover (no record: an older moerl or
    another tool; a record of another host sharing the directory, where flock may not reach) is left alone
    with a warning that names the file to delete if no build is running. Best effort: without fcntl, or where the
    filesystem refuses locks or the files, the build runs as it would without this lock.
    """
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        yield
        return
    try:
        fd = os.open(build_dir / BUILD_LOCK, os.O_RDONLY | os.O_CREAT, 0o666)  # flock needs no write access
    except OSError:
        fd = None
    locked = False
    if fd is not None:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # waits while another live process builds
            locked = True
        except OSError:  # e.g. a filesystem without locks
            pass
    owner = build_dir / BUILD_OWNER
    try:
        baton = build_dir / TORCH_BATON
        if locked:
            why = _stale_baton(build_dir)
            if why is not None:
                warnings.warn(f"removed {baton}: torch's build lock {why}", RuntimeWarning, stacklevel=3)
                baton.unlink(missing_ok=True)
            elif baton.exists():
                warnings.warn(f"{baton} exists (torch's build lock, not held by a moerl build known to be gone): the "
                              "build waits until it disappears; delete it if no build of the native kernels is "
                              "running", RuntimeWarning, stacklevel=3)
            try:
                owner.write_text(f"{socket.gethostname()} {os.getpid()}")
            except OSError:
                pass
        yield
    finally:
        if locked:
            try:
                owner.unlink(missing_ok=True)
            except OSError:
                pass
        if fd is not None:
            os.close(fd)  # releases the flock


def _missing_tools(cuda: bool) -> Optional[str]:
    from torch.utils import cpp_extension

    if not cpu_sources():
        return f"no C++ sources under {CSRC / 'cpu'} (an installed copy without csrc/)"
    if not cpp_extension.is_ninja_available():
        return "ninja not found (pip install ninja, or apt-get install ninja-build)"
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None and shutil.which("g++") is None:
        return f"no C++ compiler ({cxx} / g++) on PATH (apt-get install g++)"
    if cuda and cpp_extension.CUDA_HOME is None:
        return "CUDA available but nvcc / CUDA_HOME not found (install the CUDA toolkit or set CUDA_HOME)"
    return None


def _build(kind: str, verbose: bool) -> None:
    from torch.utils import cpp_extension

    cuda = kind == "cuda"
    missing = _missing_tools(cuda)
    if missing:
        raise NativeBuildError(missing)
    name = "moerl_kernels_cuda" if cuda else "moerl_kernels_cpu"
    sources = [str(p) for p in (cuda_sources() if cuda else cpu_sources())]
    flags = ["-O3", "-march=native", "-fopenmp-simd", "-fno-math-errno"]
    build_dir = _build_dir(name)
    try:
        with build_lock(build_dir):  # a killed earlier build's torch lock file does not hang this one
            cpp_extension.load(
                name=name, sources=sources, extra_cflags=flags, extra_cuda_cflags=["-O3"] if cuda else None,
                extra_include_paths=[str(CSRC / "include")], build_directory=str(build_dir),
                is_python_module=False, verbose=verbose, with_cuda=cuda)
    except Exception as e:  # noqa: BLE001 - a compiler error surfaces as RuntimeError/subprocess errors
        text = str(e).strip().splitlines()
        raise NativeBuildError(f"building {name} from {CSRC} failed: {text[-1] if text else type(e).__name__} "
                               f"(rerun with MOERL_KERNELS_VERBOSE=1 for the compiler output, or set "
                               f"{KERNELS_ENV}=torch to use the pure-torch references)") from e


def load_native(device: str = "cpu", *, required: bool = False) -> bool:
    """Build (first call, then cached on disk) and load the native kernels for ``device``
    ("cpu" or "cuda"); True when ``torch.ops.moerl`` has them.

    Args:
        device: "cpu" or "cuda".
        required: raise instead of returning False (tests: no silent fallback).

    Raises:
        NativeBuildError: (``required`` or ``MOERL_KERNELS=native``) the build failed or a tool is
            missing; the message names it.
        ValueError: a bad ``MOERL_KERNELS`` value or device.
    """
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    mode = kernel_mode()
    required = required or mode == "native"
    if mode == "torch" and not required:
        return False
    with _lock:
        if device not in _state:
            try:
                if device == "cuda" and not torch.cuda.is_available():
                    raise NativeBuildError("no CUDA device")
                if device == "cuda" and "cpu" not in _state:  # the CPU library defines the op schemas
                    _build("cpu", verbose=os.environ.get("MOERL_KERNELS_VERBOSE") == "1")
                    _state["cpu"] = True
                _build(device, verbose=os.environ.get("MOERL_KERNELS_VERBOSE") == "1")
                _state[device] = True
            except NativeBuildError as e:
                _state[device] = str(e)
                if not required:
                    warnings.warn(f"moerl native kernels ({device}) unavailable, using the pure-torch references: {e}",
                                  RuntimeWarning, stacklevel=2)
        ok = _state[device] is True
    if required and not ok:
        raise NativeBuildError(str(_state[device]))
    return ok


def native_available(device: str = "cpu") -> bool:
    """True when the native kernels for ``device`` are (or can be) loaded; builds on first call."""
    return load_native(device)


def kernel_report(build: bool = True) -> list[tuple[str, str, str]]:
    """(op, implementation, why) for each op moerl has a native kernel for, on this machine.

    ``build=False`` reports without compiling (an unbuilt extension is "not built yet").
    """
    try:
        mode = kernel_mode()
    except ValueError as e:
        return [(op, "error", str(e)) for op in ("fused_logprob", "fp8_quantize")]
    rows = []
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    for device in devices:
        if mode == "torch":
            impl, why = "torch reference", f"{KERNELS_ENV}=torch"
        elif build:
            try:
                ok = load_native(device)
            except Exception as e:  # noqa: BLE001 - MOERL_KERNELS=native: report rather than raise
                ok, _state[device] = False, str(e)
            impl = f"native {device} (csrc/{device})" if ok else "torch reference"
            why = (f"built with {'nvcc' if device == 'cuda' else 'the host C++ compiler'}, cached under "
                   f"{_build_dir('moerl_kernels_' + device).parent}" if ok else str(_state[device]))
        else:
            impl, why = "unknown", "not built yet (run moerl doctor to build)"
        for op in ("fused_logprob", "fp8_quantize"):
            rows.append((f"{op} [{device}]", impl, why))
    return rows


def prebuild(cuda: bool) -> None:
    """Compile the CPU extension (and with ``cuda`` the CUDA one, for ``$TORCH_CUDA_ARCH_LIST``; no GPU
    needed) into the cache now, e.g. while building a container image
    (``python -m moerl.kernels._build [--cuda]``).

    Raises:
        NativeBuildError: a tool is missing or the compiler failed.
    """
    verbose = os.environ.get("MOERL_KERNELS_VERBOSE") == "1"
    _build("cpu", verbose)
    if cuda:
        _build("cuda", verbose)


if __name__ == "__main__":
    import sys

    prebuild("--cuda" in sys.argv[1:])
    print(f"moerl kernels built under {_build_dir('moerl_kernels_cpu').parent}")

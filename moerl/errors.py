"""moerl's bad-input errors: one type per kind of input, and the one place that turns them into exit 2.

Kinds (each a ``ValueError`` through :class:`InputError`):

==================  ======================================================================
RecipeError         a recipe key or override (``moerl.config.ConfigError`` is this kind)
DataError           a prompt file or one of its rows (``moerl.data.DatasetError`` is this kind)
ModelError          an HF model directory (``model.init_from``, ``--model-path``, ``--hf``)
CheckpointError     a Megatron checkpoint (``resume``, ``--ckpt``) that does not fit the recipe
PortError           a port out of range or already taken
CLIError            a command line (unknown command, argument out of range)
==================  ======================================================================

Every entry point (``moerl train | serve | plan`` and the tools) calls :func:`run_entry`, which prints
``<prog>: bad <kind> input: <message>`` plus a ``fix:`` line on stderr and returns exit code 2.
A Python traceback is printed as well only with ``--debug`` (``moerl --debug train ...``) or
``MOERL_DEBUG=1``. Errors of other kinds (bugs, a rollout server dying) are not caught here.

This module imports nothing heavy (it is imported before torch).
"""

from __future__ import annotations

import os
import sys
import traceback
from typing import Callable, Optional

DEBUG_ENV = "MOERL_DEBUG"


class InputError(ValueError):
    """A user input moerl cannot use, found before any work.

    Args:
        message: what is wrong, naming the recipe key / file / row.
        key: the recipe key or command-line flag at fault (e.g. ``"model.init_from"``, ``"--port"``).
        file: the file or directory at fault.
        row: the 1-based row (line) of ``file`` at fault.
        hint: how to fix it (printed on a ``fix:`` line by :func:`run_entry`).

    ``str(err)`` is the message alone; :meth:`describe` adds the fix.
    """

    kind = "input"

    def __init__(self, message: str, *, key: Optional[str] = None, file: Optional[str] = None,
                 row: Optional[int] = None, hint: Optional[str] = None) -> None:
        super().__init__(message)
        self.key, self.file, self.row, self.hint = key, file, row, hint

    def describe(self) -> str:
        """The message, then ``fix: <hint>`` on its own line when a hint is set."""
        text = str(self)
        return text + (f"\n  fix: {self.hint}" if self.hint else "")


class RecipeError(InputError):
    """A recipe key or ``key=value`` override that cannot run (schema, cross-field rule, YAML)."""

    kind = "recipe"


class DataError(InputError):
    """A prompt file or row: missing file, undecodable bytes, invalid JSON, missing field, too long."""

    kind = "data"


class ModelError(InputError):
    """An HF model directory: missing, no config.json, another architecture, tensors that do not
    match its config or the recipe's model.hf_config."""

    kind = "model"


class CheckpointError(InputError):
    """A Megatron checkpoint (``resume``, ``--ckpt``) that is missing or was written for another model
    shape, data or tokenizer."""

    kind = "checkpoint"


class PortError(InputError):
    """A TCP port outside 1..65535 or already in use."""

    kind = "port"


class CLIError(InputError):
    """A command line moerl cannot run: unknown command, a flag value out of range."""

    kind = "CLI"


def input_kind(err: BaseException) -> Optional[str]:
    """``"recipe" | "data" | "model" | "checkpoint" | "port" | "CLI"`` for a bad-input error (an
    :class:`InputError`, or an error type defined elsewhere in moerl that is bad input too), else None."""
    if isinstance(err, InputError):
        return err.kind
    from moerl.rewards.errors import RewardConfigError
    from moerl.rollout.errors import PortInUseError

    if isinstance(err, PortInUseError):
        return "port"
    if isinstance(err, RewardConfigError):
        return "recipe"
    return None


def debug_enabled() -> bool:
    """Whether tracebacks are wanted (``MOERL_DEBUG`` set to anything but ""/"0")."""
    return os.environ.get(DEBUG_ENV, "") not in ("", "0")


def report_input_error(prog: str, err: BaseException, file=None) -> int:
    """Print ``err`` as ``<prog>: bad <kind> input: <message>`` (+ ``fix:`` line) and return 2.
    With :func:`debug_enabled`, the traceback comes first."""
    file = file if file is not None else sys.stderr
    if debug_enabled():
        traceback.print_exception(err, file=file)
    text = err.describe() if isinstance(err, InputError) else str(err)
    kind = input_kind(err)
    print(f"{prog}: bad {kind + ' ' if kind and kind != 'input' else ''}input: {text}", file=file)
    return 2


def run_entry(prog: str, fn: Callable[[], Optional[int]]) -> int:
    """Run an entry point's body; a bad-input error (an :class:`InputError` or one of the moerl errors
    :func:`input_kind` knows) becomes one line on stderr and exit code 2. Anything else propagates.

    Returns:
        ``fn()``'s return value (None -> 0), or 2 for bad input.
    """
    try:
        rc = fn()
    except Exception as e:  # noqa: BLE001 - re-raised unless it is bad input
        if input_kind(e) is None:
            raise
        return report_input_error(prog, e)
    return 0 if rc is None else int(rc)


def check_port(port: int, key: str) -> int:
    """``port`` as an int in 1..65535.

    Raises:
        PortError: naming ``key`` (a recipe key or a flag) and the valid range.
    """
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise PortError(f"{key}={port!r} is not a TCP port", key=key, hint=f"give {key} a port in 1..65535")
    return port


def check_writable_path(path, key: str, error: type = None) -> None:
    """``path`` can be created or written: it is a directory or does not exist yet, and its nearest
    existing ancestor is a writable directory in which the missing directories can really be made (they
    are made and removed again: ``/proc``, ``/sys`` refuse it even where ``os.access`` says yes).

    Args:
        path: the output path (a directory moerl creates or fills).
        key: the recipe key or flag that gave it (named in the error).
        error: the InputError subclass to raise (default :class:`CLIError`).

    Raises:
        InputError (``error``): ``path`` is a file, or an ancestor is a file or not writable, or making
            it fails (the OSError's reason named).
    """
    error = error or CLIError
    target = os.path.abspath(os.fspath(path))
    if os.path.exists(target) and not os.path.isdir(target):
        raise error(f"{key} {path} exists and is not a directory", key=key, file=str(path), hint=f"choose another {key}")
    ancestor = target
    while not os.path.exists(ancestor):
        ancestor = os.path.dirname(ancestor)
    if not os.path.isdir(ancestor) or not os.access(ancestor, os.W_OK | os.X_OK):
        why = "is not a directory" if not os.path.isdir(ancestor) else "is not writable"
        raise error(f"{key} {path} cannot be made: {ancestor} {why}", key=key, file=str(path),
                    hint=f"choose another {key}")
    if ancestor != target:  # try it (os.access says yes for root on /proc, /sys): make the missing dirs, undo
        made = []
        try:
            probe = target
            chain = []
            while probe != ancestor:
                chain.append(probe)
                probe = os.path.dirname(probe)
            for d in reversed(chain):
                os.mkdir(d)
                made.append(d)
        except OSError as e:
            raise error(f"{key} {path} cannot be made: {e.strerror or e} ({ancestor})", key=key, file=str(path),
                        hint=f"choose another {key} (a directory you can write)") from None
        finally:
            for d in reversed(made):
                try:
                    os.rmdir(d)
                except OSError:
                    pass


__all__ = ["CLIError", "CheckpointError", "DataError", "InputError", "ModelError", "PortError", "RecipeError",
           "check_port", "check_writable_path", "debug_enabled", "input_kind", "report_input_error", "run_entry"]

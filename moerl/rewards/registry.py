"""The reward-function registry and the resolver for user reward code (``reward.function``).

Two kinds of reward function (both plain Python, both run in the sandboxed pool of
``moerl.rewards.pool``):

- per-sample: ``fn(response: str, label: str, metadata: dict) -> float | dict`` (the two-argument
  form ``fn(response, label)`` is accepted too; the arity is read once with ``inspect.signature``);
- group: ``fn(responses: list[str], label: str, metadata: dict) -> list[float | dict]``, one entry
  per response in the same order; it sees exactly the ``n_samples_per_prompt`` responses of one prompt.

A dict result is ``{"score": float, **other_numeric_metrics}``; the extra entries are logged as
``reward/<name>`` (see ``normalize_reward``).

This module must stay light to import (the config schema imports it): no torch, transformers or
math_verify here; built-ins import their heavy dependencies inside the function.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import json
import math
import os
import sys
from dataclasses import dataclass
from typing import Any, Callable, Optional

from moerl.rewards.errors import RewardConfigError, RewardValueError

RewardFn = Callable[..., Any]

KEY = "reward.function"  # the recipe key every resolver error names


@dataclass(frozen=True)
class _Entry:
    fn: RewardFn
    group: bool
    check_label: Optional[Callable[[Any, Any], None]]


_REGISTRY: dict[str, _Entry] = {}
_FILE_MODULES: dict[str, Any] = {}  # absolute path -> module loaded from a user file (loaded once)


def register_reward_fn(name: str, fn: RewardFn, *, group: bool = False,
                       check_label: Optional[Callable[[Any, Any], None]] = None) -> None:
    """Register a reward function under ``name`` (usable as ``reward.function=<name>``).

    Args:
        name: registry name.
        fn: per-sample ``fn(response, label[, metadata]) -> float | dict`` or, with ``group=True``,
            ``fn(responses, label, metadata) -> list[float | dict]``.
        group: whether ``fn`` scores a whole group of responses.
        check_label: optional ``hook(label, metadata) -> None`` that raises ``ValueError`` for a label the
            function can never score (run over a dataset's labels by ``check_label``).

    Raises:
        ValueError: ``name`` is already registered to a different function (registering the same
            function again is a no-op).
        TypeError: ``fn`` is not callable.
    """
    if not callable(fn):
        raise TypeError(f"reward function for {name!r} must be callable, got {type(fn).__name__}")
    if name in _REGISTRY and _REGISTRY[name].fn is not fn:
        raise ValueError(f"reward function {name!r} is already registered")
    _REGISTRY[name] = _Entry(fn, bool(group), check_label)


def get_reward_fn(name: str) -> RewardFn:
    """The function registered as ``name``, as registered (not wrapped; see ``resolve_reward_fn``).

    Raises:
        ValueError: unknown name (the message lists the registered ones).
    """
    try:
        return _REGISTRY[name].fn
    except KeyError:
        raise ValueError(f"unknown reward function {name!r}; registered: {', '.join(sorted(_REGISTRY))}") from None


def available_reward_fns() -> list[str]:
    """Registered reward function names, sorted."""
    return sorted(_REGISTRY)


def as_metadata(metadata: Any) -> dict:
    """``metadata`` as a dict: ``None`` -> ``{}``, a dict as is, a JSON object string parsed.

    Datasets stored as parquet/Arrow often carry per-row metadata as a JSON string; both forms are
    accepted everywhere a reward takes metadata.

    Raises:
        RewardValueError: a string that is not a JSON object, or any other type.
    """
    if metadata is None:
        return {}
    if isinstance(metadata, dict):
        return metadata
    if isinstance(metadata, (str, bytes)):
        try:
            out = json.loads(metadata)
        except ValueError as e:
            raise RewardValueError(f"reward metadata is a string but not JSON ({e}): {str(metadata)[:200]!r}") from None
        if not isinstance(out, dict):
            raise RewardValueError(f"reward metadata JSON must be an object, got {type(out).__name__}")
        return out
    raise RewardValueError(f"reward metadata must be a dict or a JSON object string, got {type(metadata).__name__}")


def _finite_float(x: Any, what: str) -> float:
    if isinstance(x, bool) or (isinstance(x, (int, float)) and not isinstance(x, complex)):
        v = float(x)
    elif type(x).__name__ in ("float32", "float64", "float16", "int32", "int64") and hasattr(x, "item"):
        v = float(x.item())  # numpy scalars without importing numpy
    else:
        raise RewardValueError(f"{what} must be a float (or int/bool), got {type(x).__name__}: {x!r:.200}")
    if not math.isfinite(v):
        raise RewardValueError(f"{what} is {v}; a reward must be a finite float")
    return v


def normalize_reward(out: Any) -> tuple[float, dict[str, float]]:
    """A reward function's return value as ``(score, metrics)``.

    - ``float``/``int``/``bool`` (and numpy scalars) -> ``(float(out), {})``;
    - ``dict`` -> ``(float(out["score"]), {k: float(v) for the other entries whose value is numeric})``;
      non-numeric extra entries are dropped (metrics are numbers); metric names are bare (the trainer
      logs them as ``reward/<name>``).

    Raises:
        RewardValueError: any other type, a NaN or infinite score, a dict without ``"score"``.
    """
    if isinstance(out, dict):
        if "score" not in out:
            raise RewardValueError(f"reward dict has no 'score' entry (keys: {sorted(map(str, out))}); return "
                                   "{'score': float, ...extra metrics}")
        score = _finite_float(out["score"], "reward dict 'score'")
        metrics: dict[str, float] = {}
        for k, v in out.items():
            if k != "score" and not isinstance(v, (str, bytes)):
                try:
                    metrics[str(k)] = float(v)
                except (TypeError, ValueError):
                    pass
        return score, metrics
    return _finite_float(out, "reward"), {}


def normalize_group_reward(out: Any, n: int) -> list[tuple[float, dict[str, float]]]:
    """A group function's return value as ``n`` ``(score, metrics)`` pairs (see ``normalize_reward``).

    Raises:
        RewardValueError: not a list/tuple, wrong length, or a bad entry.
    """
    if not isinstance(out, (list, tuple)):
        raise RewardValueError(f"group reward function must return a list of {n} rewards, got {type(out).__name__}")
    if len(out) != n:
        raise RewardValueError(f"group reward function returned {len(out)} rewards for {n} responses")
    return [normalize_reward(x) for x in out]


# --------------------------------------------------------------------------- resolving reward.function


def _positional_arity(fn: Callable) -> tuple[int, float]:
    """(required positional params, max positional params (inf with *args)) of ``fn``."""
    sig = inspect.signature(fn)
    required, maximum = 0, 0.0
    for p in sig.parameters.values():
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            maximum += 1
            if p.default is p.empty:
                required += 1
        elif p.kind == p.VAR_POSITIONAL:
            maximum = math.inf
        elif p.kind == p.KEYWORD_ONLY and p.default is p.empty:
            required = 99  # a required keyword-only argument can never be passed
    return required, maximum


def _adapt(fn: Callable, spec: str, group: bool) -> Callable:
    """Check ``fn``'s signature and return it with the uniform 3-argument call."""
    try:
        required, maximum = _positional_arity(fn)
    except (TypeError, ValueError):  # builtins without a signature: trust them with 3 arguments
        return fn
    if group:
        if not (required <= 3 <= maximum):
            raise RewardConfigError(
                f"{KEY}={spec!r}: a group reward function must take 3 positional parameters "
                f"(responses, label, metadata); {getattr(fn, '__name__', fn)!r} takes {required} required / "
                f"{maximum} positional. Fix its signature, or set reward.group=false for a per-sample function")
        return fn
    if required <= 3 <= maximum:
        return fn
    if required <= 2 <= maximum:
        def two_arg(response, label, metadata=None, _fn=fn):
            return _fn(response, label)

        two_arg.__wrapped__ = fn  # type: ignore[attr-defined]
        two_arg.__name__ = getattr(fn, "__name__", "reward_fn")
        return two_arg
    raise RewardConfigError(
        f"{KEY}={spec!r}: a per-sample reward function must take 2 or 3 positional parameters "
        f"(response, label[, metadata]); {getattr(fn, '__name__', fn)!r} takes {required} required / {maximum} "
        "positional. Fix its signature (a group function, fn(responses, label, metadata), needs reward.group=true)")


def _load_file(path: str, spec: str) -> Any:
    path = os.path.abspath(os.path.expanduser(path))
    if path in _FILE_MODULES:
        return _FILE_MODULES[path]
    if not os.path.isfile(path):
        raise RewardConfigError(f"{KEY}={spec!r}: file {path} does not exist; give an existing "
                                "/path/to/file.py:function")
    name = "moerl_user_reward_" + "".join(c if c.isalnum() else "_" for c in path)
    mspec = importlib.util.spec_from_file_location(name, path)
    if mspec is None or mspec.loader is None:
        raise RewardConfigError(f"{KEY}={spec!r}: {path} cannot be loaded as a Python module (use a .py file)")
    module = importlib.util.module_from_spec(mspec)
    sys.modules[name] = module  # so dataclasses / pickling inside the file work
    try:
        mspec.loader.exec_module(module)
    except (Exception, SystemExit) as e:
        sys.modules.pop(name, None)
        raise RewardConfigError(f"{KEY}={spec!r}: importing {path} failed: {e!r}; fix the file") from e
    _FILE_MODULES[path] = module
    return module


def resolve_reward_fn(spec: str, *, group: bool = False) -> Callable:
    """The reward function ``spec`` names, checked, with a uniform call signature.

    ``spec`` (the recipe's ``reward.function``) is one of:

    - a registered name (``available_reward_fns()``: arithmetic, math, exact_match, countdown,
      reasoning_gym, and whatever ``register_reward_fn`` added);
    - ``package.module:function`` (imported with ``importlib.import_module``; ``function`` may be a
      dotted attribute path);
    - ``/path/to/file.py:function`` (any ``.py`` file, also outside the package, loaded once per
      process with ``importlib.util.spec_from_file_location``).

    Call it in the main process before any work: the reward pool's workers resolve the same string
    again, so a spec that resolves here resolves there (same interpreter and ``sys.path``).

    Args:
        spec: see above.
        group: whether a group function is expected (``reward.group``).

    Returns:
        per-sample: ``fn(response, label, metadata) -> float | dict`` (a two-argument function is
        wrapped to take and ignore ``metadata``); group: ``fn(responses, label, metadata) -> list``.

    Raises:
        RewardConfigError: the message names ``reward.function`` and the problem: unknown name (lists
            the registered ones), module not importable, file missing, attribute missing, not callable,
            wrong signature (per-sample: 2 or 3 positional parameters; group: 3), or a registered
            function whose kind (group / per-sample) differs from ``group``.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise RewardConfigError(f"{KEY} must be a non-empty string, got {spec!r}")
    spec = spec.strip()
    if ":" not in spec:
        entry = _REGISTRY.get(spec)
        if entry is None:
            raise RewardConfigError(
                f"{KEY}={spec!r} is not a registered reward function; choose one of {available_reward_fns()} "
                "or give your own as package.module:function or /path/to/file.py:function")
        if entry.group != group:
            kind = "a group" if entry.group else "a per-sample"
            raise RewardConfigError(f"{KEY}={spec!r} is {kind} reward function; set reward.group="
                                    f"{str(entry.group).lower()}")
        return _adapt(entry.fn, spec, group)
    where, _, attr = spec.rpartition(":")
    if not where or not attr:
        raise RewardConfigError(f"{KEY}={spec!r}: expected package.module:function or /path/to/file.py:function")
    if where.endswith(".py") or os.sep in where or "/" in where:
        module = _load_file(where, spec)
    else:
        try:
            module = importlib.import_module(where)
        except ImportError as e:
            raise RewardConfigError(f"{KEY}={spec!r}: module {where!r} is not importable ({e}); install it, add its "
                                    "directory to PYTHONPATH, or give /path/to/file.py:function") from e
        except Exception as e:
            raise RewardConfigError(f"{KEY}={spec!r}: importing module {where!r} failed: {e!r}; fix the module") from e
    fn: Any = module
    for part in attr.split("."):
        if not hasattr(fn, part):
            raise RewardConfigError(f"{KEY}={spec!r}: {where} has no attribute {attr!r}; check the function name")
        fn = getattr(fn, part)
    if not callable(fn):
        raise RewardConfigError(f"{KEY}={spec!r}: {where}:{attr} is a {type(fn).__name__}, not a callable")
    return _adapt(fn, spec, group)


def check_label(spec: str, label: Any, metadata: Any = None) -> None:
    """Validate one dataset row's label (and metadata, a dict or None) for ``spec``: runs the registered
    ``check_label`` hook ``hook(label, metadata)`` if the function has one (``arithmetic``: a
    non-negative integer; ``countdown``: an integer, and ``metadata["numbers"]`` a list of ints), else
    does nothing (user functions and specs with ``:`` have no hook).

    Raises:
        ValueError: from the hook, naming the problem (the caller adds the row and recipe key).
    """
    entry = _REGISTRY.get(spec.strip()) if isinstance(spec, str) else None
    if entry is not None and entry.check_label is not None:
        entry.check_label(label, metadata)

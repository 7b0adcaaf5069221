"""Load a recipe YAML, apply dotted ``key=value`` overrides, validate into a :class:`RecipeConfig`.

Every failure is a :class:`ConfigError` raised before any work starts, naming the dotted key and the
rule broken (unknown key with a did-you-mean suggestion, wrong type, out-of-range value, cross-field
rule), or the file and line for a missing file / malformed YAML.
"""

from __future__ import annotations

import difflib
import os
import re
from typing import Any, Iterable, Optional

import yaml
from pydantic import BaseModel, ValidationError

from moerl.config.errors import ConfigError  # re-exported: moerl.config.loader.ConfigError stays valid
from moerl.config.schema import RecipeConfig


class _Loader(yaml.SafeLoader):
    """yaml.SafeLoader that also reads YAML 1.2 floats without a dot (``1e-4``, ``3E5``) as floats.

    PyYAML implements YAML 1.1, where ``lr: 1e-4`` is the *string* "1e-4"; that trips strict typing.
    """


def _construct_mapping(loader: "_Loader", node: yaml.MappingNode, deep: bool = False) -> dict:
    """SafeLoader's mapping constructor, refusing a key given twice in one mapping (YAML itself keeps
    the last silently: two ``train:`` sections would drop the first)."""
    seen: dict[Any, Any] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=True)
        try:
            first = seen.get(key)
        except TypeError:  # an unhashable key: SafeLoader reports it itself
            continue
        if first is not None:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r} (first at line {first.line + 1}); YAML would keep only the "
                "last one: merge the two into one", key_node.start_mark)
        seen[key] = key_node.start_mark
    return yaml.SafeLoader.construct_mapping(loader, node, deep=deep)


_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def _yaml_load(text: str) -> Any:
    return yaml.load(text, Loader=_Loader)  # noqa: S506 - _Loader derives from SafeLoader


# ----------------------------------------------------------------------------- overrides
def parse_override(item: str) -> tuple[list[str], Any]:
    """Split ``"a.b.c=value"`` into (["a", "b", "c"], yaml-parsed value).

    Raises:
        ConfigError: no ``=``, an empty key part, or a value that is not valid YAML.
    """
    if not isinstance(item, str) or "=" not in item:
        raise ConfigError(f"override {item!r} must look like dotted.key=value (e.g. rollout.n_samples_per_prompt=8)")
    key, raw = item.split("=", 1)
    parts = key.strip().split(".")
    if any(not p for p in parts):
        raise ConfigError(f"override {item!r}: empty part in key {key!r}")
    try:
        value = _yaml_load(raw) if raw.strip() else None
    except yaml.YAMLError as e:
        raise ConfigError(f"override {item!r}: value {raw!r} is not valid YAML ({e})") from None
    return parts, value


def apply_overrides(raw: dict[str, Any], overrides: Iterable[str]) -> dict[str, Any]:
    """Apply dotted overrides to a nested dict in place (creating missing sections) and return it."""
    for item in overrides:
        parts, value = parse_override(item)
        node = raw
        for i, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            elif not isinstance(child, dict):
                where = ".".join(parts[: i + 1])
                raise ConfigError(f"override {item!r}: '{where}' is a value ({child!r}), not a section")
            node = child
        node[parts[-1]] = value
    return raw


# ----------------------------------------------------------------------------- error text
def _section_model(loc: tuple) -> Optional[type[BaseModel]]:
    """The pydantic model class that owns the last element of ``loc`` (None if not a model path)."""
    model: type[BaseModel] = RecipeConfig
    for part in loc[:-1]:
        field = model.model_fields.get(part) if isinstance(part, str) else None
        if not _is_section(field):
            return None
        model = field.annotation
    return model


def _sections_with_key(name: str) -> list[str]:
    """The top-level recipe sections that have a key ``name`` (e.g. "max_staleness" -> ["train"]), or
    ``[""]`` when it is a top-level key itself."""
    if name in RecipeConfig.model_fields and not _is_section(RecipeConfig.model_fields[name]):
        return [""]
    return [sec for sec, f in RecipeConfig.model_fields.items()
            if _is_section(f) and name in f.annotation.model_fields]


def _is_section(field) -> bool:
    ann = getattr(field, "annotation", None)
    return isinstance(ann, type) and issubclass(ann, BaseModel)


def _format_error(err: dict[str, Any]) -> str:
    loc = tuple(err.get("loc", ()))
    key = ".".join(str(p) for p in loc)
    etype = err.get("type", "")
    if etype == "extra_forbidden":
        model = _section_model(loc)
        msg = f"unknown key '{key}'"
        elsewhere = _sections_with_key(str(loc[-1])) if len(loc) <= 2 else []
        if elsewhere and tuple(loc[:-1]) not in [(s,) if s else () for s in elsewhere]:  # a key of another section
            return msg + f"; did you mean {' or '.join(repr(f'{s}.{loc[-1]}' if s else str(loc[-1])) for s in elsewhere)}?"
        if model is not None:
            names = list(model.model_fields)
            close = difflib.get_close_matches(str(loc[-1]), names, n=1, cutoff=0.6)
            prefix = ".".join(str(p) for p in loc[:-1])
            if close:
                msg += f"; did you mean '{prefix + '.' if prefix else ''}{close[0]}'?"
            else:
                msg += f" (valid keys{' of ' + prefix if prefix else ''}: {', '.join(names)})"
        return msg
    text = str(err.get("msg", ""))
    if etype == "value_error":  # our cross-field rules already name their keys
        return text.removeprefix("Value error, ")
    got = err.get("input")
    if isinstance(got, dict):
        return f"{key or '<recipe>'}: {text}"
    return f"{key or '<recipe>'}: {text} (got {got!r})"


def validate_config(raw: Any, source: str = "<recipe>") -> RecipeConfig:
    """Validate a nested dict into a RecipeConfig, converting pydantic errors to a ConfigError."""
    if raw is None:  # an empty file is almost always a mistake: never run the defaults silently
        raise ConfigError(f"recipe {source} is empty; start from configs/tiny_arith.yaml (every key commented)")
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: the recipe must be a YAML mapping of sections, got {type(raw).__name__}")
    try:
        return RecipeConfig.model_validate(raw)
    except ValidationError as e:
        lines = [_format_error(err) for err in e.errors()]
        raise ConfigError(f"invalid recipe {source}:\n  " + "\n  ".join(lines)) from None


def load_config(path: str | os.PathLike, overrides: Iterable[str] = ()) -> RecipeConfig:
    """Read the recipe YAML at ``path``, apply ``overrides`` and validate.

    Args:
        path: recipe file (e.g. ``configs/tiny_arith.yaml``).
        overrides: dotted ``key=value`` strings applied in order; values are parsed as YAML
            (``rollout.n_samples_per_prompt=8`` -> int, ``model.init_from=null`` -> None).

    Raises:
        ConfigError: missing file, non-UTF-8 bytes or malformed YAML or a key given twice in one
            section (with its line), bad override, unknown key
            (with a did-you-mean), wrong type, out-of-range value or broken cross-field rule.
    """
    path = os.fspath(path)
    if os.path.isdir(path):
        raise ConfigError(f"{path} is a directory; give a recipe file such as configs/tiny_arith.yaml")
    if os.path.exists(path) and not os.path.isfile(path):  # /dev/null, a FIFO, a socket
        raise ConfigError(f"recipe {path} is not a regular file (an empty device or pipe holds no recipe)",
                          key="recipe", file=path, hint="give a recipe file such as configs/tiny_arith.yaml")
    if not os.path.isfile(path):
        raise ConfigError(f"recipe file not found: {path}")
    with open(path, "rb") as f:
        data = f.read()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise ConfigError(f"recipe {path} line {line} is not UTF-8 text (byte {data[e.start]:#04x}); save the "
                          "file as UTF-8") from None
    try:
        raw = _yaml_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
        where = f" line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e)
        ctx, ctx_mark = getattr(e, "context", None), getattr(e, "context_mark", None)
        if ctx and ctx_mark is not None and ctx_mark is not mark:
            problem += f" ({ctx} at line {ctx_mark.line + 1})"
        raise ConfigError(f"malformed YAML in {path}{where}: {problem}") from None
    if raw is None:  # an empty file is almost always a mistake: never run the defaults silently
        raise ConfigError(f"recipe {path} is empty; start from configs/tiny_arith.yaml (every key commented)")
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the recipe must be a YAML mapping of sections, got {type(raw).__name__}")
    if isinstance(overrides, str):
        overrides = [overrides]
    apply_overrides(raw, overrides)
    return validate_config(raw, source=path)

"""The configuration tree: attrs classes, loaded from YAML plus ``key.sub=value`` overrides.

Every field carries its documentation (``doc``) and, where a value can be out of range, a
``check``; ``python -m trainer --help`` prints them all. Loading validates everything before
any work starts: an unknown key (with a close-match hint), a wrong type, a value out of range
or an inconsistent combination raises ``ConfigError`` with one line naming the key, the value
and what is allowed.
"""

from __future__ import annotations

import difflib
import os
import types
import typing
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import attrs
import yaml
from omegaconf import OmegaConf

from trainer.config._config import Config
from trainer.config._peer_keys import peer_answer, peer_value_answer
from trainer.config._schema import (
    RENAMED_VALUES,
)
from trainer.config._validate import validate_cfg
from trainer.errors import ConfigError

__all__ = [
    "SECRET_KEYS",
    "help_text",
    "iter_fields",
    "load_config",
    "to_dict",
    "type_name",
]

#: Keys whose value is a secret: written nowhere (:func:`to_dict` leaves them None), taken from
#: their environment variable as given (not parsed as YAML).
SECRET_KEYS = frozenset({"engine.api_key", "serve.api_key"})

# ---------------------------------------------------------------------------------------------


def iter_fields(cls: type = Config, prefix: str = "") -> Iterator[tuple[str, attrs.Attribute, Any]]:
    """Yield (dotted key, attribute, resolved type) for every leaf field."""
    hints = typing.get_type_hints(cls)
    for a in attrs.fields(cls):
        key = f"{prefix}{a.name}"
        tp = hints[a.name]
        if attrs.has(tp):
            yield from iter_fields(tp, key + ".")
        else:
            yield key, a, tp


def type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(x) for x in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(t) for t in typing.get_args(tp))
    if origin is dict:
        return "mapping"
    if origin is tuple:
        return f"tuple[{', '.join('...' if t is Ellipsis else type_name(t) for t in typing.get_args(tp))}]"
    return "None" if tp is type(None) else getattr(tp, "__name__", str(tp))


def _as_argument(value: Any) -> Any:
    """A number in a list of strings, as written (YAML reads ``4096`` as an int)."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        return str(value)
    return value


def _coerce(key: str, value: Any, tp: Any) -> Any:
    origin = typing.get_origin(tp)
    wrong = ConfigError(f"config: {key}={value!r} has the wrong type: expected {type_name(tp)}")
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for t in args:
            if t is type(None):
                continue
            try:
                return _coerce(key, value, t)
            except ConfigError:
                continue
        raise wrong
    if origin is Literal:
        allowed = typing.get_args(tp)
        if value not in allowed and (key, value) in RENAMED_VALUES:
            raise ConfigError(
                f"config: {key}={value!r} was renamed: write {key}={RENAMED_VALUES[key, value]}"
            )
        if value not in allowed and (answer := peer_value_answer(key, value)):
            raise ConfigError(f"config: {answer}")
        if value not in allowed:
            raise ConfigError(
                f"config: {key}={value!r} is not allowed: choose one of {', '.join(map(repr, allowed))}"
            )
        return value
    if origin is tuple:
        args = typing.get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:
            if isinstance(value, str):  # engine.urls=http://a:8000 (one item)
                value = [value]
            if not isinstance(value, list | tuple):
                raise wrong
            if args[0] is str:  # an argument list (engine.extra_args=[--max-model-len,4096])
                value = [_as_argument(v) for v in value]
            return tuple(_coerce(key, v, args[0]) for v in value)
        if not isinstance(value, list | tuple) or len(value) != len(args):
            raise wrong
        return tuple(_coerce(key, v, t) for v, t in zip(value, args))
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise wrong
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise wrong
    if tp is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        raise wrong
    if tp is str:
        if isinstance(value, str):
            return value
        raise wrong
    if _is_mapping(tp):
        if isinstance(value, dict) and all(isinstance(k, str) for k in value):
            return dict(value)
        raise wrong
    raise wrong


def _is_mapping(tp: Any) -> bool:
    """Whether a key holds a free-form mapping (``generator.kwargs``): its own keys are data."""
    return tp is dict or typing.get_origin(tp) is dict


def _flatten(
    d: dict[str, object], prefix: str = "", mappings: frozenset[str] = frozenset()
) -> Iterator[tuple[str, Any]]:
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v and key not in mappings:
            yield from _flatten(v, key + ".", mappings)
        else:
            yield key, v


def _build(values: dict[str, object]) -> Config:
    """The config from flattened ``values``; every unknown key, wrong type and value out of
    range of one command line in one ConfigError (one line each), not the first alone."""
    known = {key: (a, tp) for key, a, tp in iter_fields()}
    mappings = frozenset(key for key, (_a, tp) in known.items() if _is_mapping(tp))
    problems: list[str] = []
    leaves: dict[str, object] = {}
    for key, value in _flatten(values, mappings=mappings):
        problem = _key_problem(key, value, known)
        if problem:
            problems.append(problem)
        else:
            leaves[key] = value
    for key, (a, _tp) in known.items():
        env = a.metadata.get("env")
        if env and os.environ.get(env) not in (None, ""):
            raw = key == "faults" or key in SECRET_KEYS  # a secret is text, never parsed
            leaves[key] = os.environ[env] if raw else yaml.safe_load(os.environ[env])
    for key, value in leaves.items():
        a, tp = known[key]
        try:
            value = _coerce(key, value, tp)
        except ConfigError as exc:
            problems.append(str(exc))
            continue
        check = a.metadata.get("check")
        problem = check(value) if check else None
        if problem:
            problems.append(f"config: {key}={value!r} is out of range: {problem}")
        leaves[key] = value
    if len(problems) == 1:
        raise ConfigError(problems[0])
    if problems:
        raise ConfigError(f"config: {len(problems)} problems\n" + "\n".join(problems))
    return _assemble(Config, leaves, "")


def _key_problem(key: str, value: object, known: Mapping[str, tuple[Any, Any]]) -> str | None:
    """What is wrong with the key of ``key=value`` (None: a key of this config): a peer's key
    (verl's, SkyRL's: answered with the key and value here), Hydra's ``+``/``~``, a section,
    an ``.enable`` where another key is the switch, or an unknown key with its closest."""
    bare = key.lstrip("+~")
    peer = peer_answer(bare, value) if bare not in known else None
    if peer:
        return f"config: {peer}"
    if key.startswith(("+", "~")):  # Hydra's (verl's) syntax to add or delete a key
        what = (
            f"write {bare}=VALUE without it"
            if bare in known
            else f"and {bare!r} is not a key (see `python -m trainer --help`)"
        )
        return (
            f"config: {key!r}: '{key[0]}' adds or removes a key in Hydra; here every key "
            f"exists already and none can be added, {what}"
        )
    if key in known:
        return None
    section, _, leaf = key.rpartition(".")
    switch = _section_switches().get(section)
    if switch and leaf in _SWITCH_LEAVES:
        return f"config: {key!r} is not a key: {switch} turns {section} on"
    if any(k.startswith(key + ".") for k in known):
        return f"config: {key} is a section, not a value; set its keys ({key}.KEY=...)"
    hint = _closest_key(key, known)
    tail = f" (did you mean {hint!r}?)" if hint else "; see `python -m trainer --help`"
    return f"config: unknown key {key!r}{tail}"


#: The leaf names users try to turn a section on with (verl's ``.enable``, ``use_``).
_SWITCH_LEAVES = frozenset({"enable", "enabled", "use", "on", "active"})


def _section_switches(cls: type = Config, prefix: str = "") -> dict[str, str]:
    """``{section: "key=VALUE"}`` for each section declared with a ``switch``."""
    hints = typing.get_type_hints(cls)
    found: dict[str, str] = {}
    for a in attrs.fields(cls):
        if attrs.has(hints[a.name]):
            key = f"{prefix}{a.name}"
            if a.metadata.get("switch"):
                found[key] = a.metadata["switch"]
            found.update(_section_switches(hints[a.name], key + "."))
    return found


def _closest_key(key: str, known: Mapping[str, object]) -> str | None:
    """The key ``key`` was likely meant to be: the closest of its section's keys by their
    last part (``trainer.max_step``: ``trainer.max_steps``; a shared ``trainer.`` makes any
    two keys look alike), else a close whole key (a misspelled section); None."""
    section, _, leaf = key.rpartition(".")
    siblings = {k.rpartition(".")[2]: k for k in known if k.rpartition(".")[0] == section}
    if siblings:
        close = difflib.get_close_matches(leaf, list(siblings), n=1)
        return siblings[close[0]] if close else None
    close = difflib.get_close_matches(key, list(known), n=1, cutoff=0.8)
    return close[0] if close else None


def _assemble(cls: type, leaves: dict[str, object], prefix: str) -> Any:
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for a in attrs.fields(cls):
        key = f"{prefix}{a.name}"
        if attrs.has(hints[a.name]):
            kwargs[a.name] = _assemble(hints[a.name], leaves, key + ".")
        elif key in leaves:
            kwargs[a.name] = leaves[key]
    return cls(**kwargs)


def load_config(config_file: str | Path | None = None, overrides: Sequence[str] = ()) -> Config:
    """Defaults, then the YAML file, then ``key=value`` overrides (then env overrides); validated."""
    merged = OmegaConf.create({})
    if config_file is not None:
        path = Path(config_file)
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except (OSError, yaml.YAMLError) as exc:
            raise ConfigError(f"config: cannot read {path}: {exc}".splitlines()[0]) from None
        if not isinstance(data, dict):
            raise ConfigError(
                f"config: {path} must hold a mapping of keys, not {type(data).__name__}"
            )
        merged = OmegaConf.merge(merged, OmegaConf.create(data))
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"config: override {item!r} is not key=value")
        key, _, value = item.partition("=")
        if not value:  # omegaconf reads `key=` as null: a default chosen in silence
            raise ConfigError(
                f"config: override {item!r} has no value (an unset shell variable?): give "
                f"one, or write {key}=null for the key's default"
            )
        try:
            merged = OmegaConf.merge(merged, OmegaConf.from_dotlist([item]))
        except Exception as exc:  # omegaconf raises many types for bad syntax
            raise ConfigError(
                f"config: cannot parse override {item!r}: {exc}".splitlines()[0]
            ) from None
    values = OmegaConf.to_container(merged, resolve=True)
    assert isinstance(values, dict)
    cfg = _build(values)  # type: ignore[arg-type]
    validate_cfg(cfg)
    return cfg


def to_dict(cfg: Any) -> dict[str, object]:
    """The resolved config as plain data (what config.yaml holds, and what trackers record),
    each of :data:`SECRET_KEYS` None whatever its value (a resume gets it again from its
    environment variable)."""
    data = attrs.asdict(
        cfg, value_serializer=lambda _i, _a, v: list(v) if isinstance(v, tuple) else v
    )
    for key in SECRET_KEYS:
        *sections, leaf = key.split(".")
        section: Any = data
        for name in sections:
            section = section.get(name) if isinstance(section, dict) else None
        if isinstance(section, dict) and leaf in section:
            section[leaf] = None
    return data


def help_text() -> str:
    """Every key with its type, default and doc (``python -m trainer --help``)."""
    lines = []
    defaults = Config()
    for key, a, tp in iter_fields():
        obj: Any = defaults
        for part in key.split("."):
            obj = getattr(obj, part)
        env = a.metadata.get("env")
        env_s = f" [env {env}]" if env else ""
        lines.append(
            f"  {key} = {obj!r}  ({type_name(tp)}){env_s}\n      {a.metadata.get('doc', '')}"
        )
    return "\n".join(lines)

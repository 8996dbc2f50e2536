"""Flags, ``KVINDEX_*`` variables and the config file, decoded once into :class:`Settings`.

Precedence: a flag beats its variable, which beats the config file, which beats the
default written in :mod:`kvindex.api.serve.settings`. The three sources are laid over one
another as a nested dict and converted by msgspec in one call, so every value meets
the same types and constraints wherever it came from, and an error names the setting.
"""

from __future__ import annotations

import argparse
import types
import typing
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

import msgspec

from kvindex.api.serve.settings import SECTIONS, Settings
from kvindex.api.serve.settings_derived import ConfigError

# The admin token has no flag; it is read from here (a Secret) or from a file.
ADMIN_TOKEN_VARIABLE = "KVINDEX_ADMIN_TOKEN"


@dataclass(frozen=True, slots=True)
class Leaf:
    """One setting: where it sits in the tree and how it is spelt as a flag and variable."""

    section: str | None  # None: a field of Settings itself
    field: str
    annotation: Any  # the field's type, constraints included
    meta: msgspec.Meta
    default: Any

    @property
    def dest(self) -> str:
        """The flat name: argparse's destination, and the keyword of :func:`from_flags`."""
        return self.flag[2:].replace("-", "_")

    @property
    def flag(self) -> str:
        prefix = SECTIONS[self.section].flag_prefix if self.section else ""
        return "--" + prefix + self.field.replace("_", "-")

    @property
    def variable(self) -> str:
        return "KVINDEX_" + self.dest.upper()

    @property
    def extra(self) -> dict[str, Any]:
        return self.meta.extra or {}

    @property
    def base(self) -> Any:
        """The type without ``Annotated`` and ``| None``."""
        hint = self.annotation
        while typing.get_origin(hint) is typing.Annotated:
            hint = typing.get_args(hint)[0]
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if typing.get_origin(hint) in (typing.Union, types.UnionType):
            return args[0]
        return hint

    @property
    def repeatable(self) -> bool:
        return typing.get_origin(self.base) is list

    def help(self) -> str:
        text = self.meta.description or ""
        default = self.default
        if isinstance(default, Enum):
            default = default.value
        if default is None or default == []:
            return text
        return f"{text} (default {default})"

    def argparse_spec(self) -> dict[str, Any]:
        spec: dict[str, Any] = {"help": self.help()}
        base = self.base
        if self.repeatable:
            spec["action"] = "append"
        elif base is bool and self.default is True:  # --X / --no-X; absent: the rest decide
            spec["action"] = argparse.BooleanOptionalAction
        elif base is bool:  # a switch: given means true; absent leaves it to the rest
            spec["action"] = "store_const"
            spec["const"] = True
        elif isinstance(base, type) and issubclass(base, Enum):
            spec["choices"] = [member.value for member in base]
        elif typing.get_origin(base) is typing.Literal:
            spec["choices"] = list(typing.get_args(base))
        elif base in (int, float):
            spec["type"] = base
        if "metavar" in self.extra:
            spec["metavar"] = self.extra["metavar"]
        return spec


def _leaves_of(cls: type[msgspec.Struct], section: str | None) -> Iterable[Leaf]:
    hints = typing.get_type_hints(cls, include_extras=True)
    defaults = cls()
    for name in cls.__struct_fields__:
        if name in SECTIONS and section is None:
            continue
        annotation = hints[name]
        metas = [
            m
            for m in getattr(annotation, "__metadata__", ())
            if isinstance(m, msgspec.Meta) and m.description
        ]
        yield Leaf(
            section,
            name,
            annotation,
            metas[0] if metas else msgspec.Meta(),
            getattr(defaults, name),
        )


def leaves() -> list[Leaf]:
    """Every setting of the tree, in declaration order."""
    found = list(_leaves_of(Settings, None))
    for name, cls in SECTIONS.items():
        found += _leaves_of(cls, name)
    return found


LEAVES: dict[str, Leaf] = {leaf.dest: leaf for leaf in leaves()}
FLAGGED = [leaf for leaf in LEAVES.values() if not leaf.extra.get("file_only")]


def add_serve_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per setting that has one (default None: 'not given', so that the
    variable and the file can still set it)."""
    for leaf in FLAGGED:
        if not leaf.extra.get("env_only"):
            parser.add_argument(leaf.flag, **leaf.argparse_spec())


def environment_variables() -> list[str]:
    """Every ``KVINDEX_*`` variable ``kvindex serve`` reads."""
    return sorted(leaf.variable for leaf in FLAGGED)


def unknown_variables(environ: Mapping[str, str], others: Iterable[str] = ()) -> list[str]:
    """``KVINDEX_*`` variables nobody reads: a misspelt one is a setting silently lost."""
    known = {*environment_variables(), *others}
    return sorted(n for n in environ if n.startswith("KVINDEX_") and n not in known)


def _from_environment(leaf: Leaf, raw: str) -> Any:
    """A variable's text as the leaf's type; repeatable settings take a comma list."""
    if leaf.repeatable:
        return [part.strip() for part in raw.replace("\n", ",").split(",") if part.strip()]
    if leaf.base is bool:
        word = raw.strip().lower()
        if word in ("1", "true", "yes", "on"):
            return True
        if word in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"{leaf.variable}={raw!r}: use true or false")
    if leaf.base not in (int, float):
        return raw  # strings, enums and literals: checked with the rest of the tree
    try:
        return msgspec.convert(raw, leaf.base, strict=False)
    except msgspec.ValidationError:
        raise ConfigError(f"{leaf.variable}={raw!r} is not a number") from None


def read_config_file(path: str | None) -> dict[str, Any]:
    """The config file as a nested dict (YAML, JSON or TOML by its suffix)."""
    if not path:
        return {}
    file = Path(path)
    try:
        data = file.read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read --model-config {path}: {exc.strerror}") from None
    suffix = file.suffix.lower()
    try:
        if suffix == ".json":
            tree = msgspec.json.decode(data)
        elif suffix == ".toml":
            tree = msgspec.toml.decode(data)
        elif suffix in (".yaml", ".yml"):
            tree = msgspec.yaml.decode(data)
        else:
            raise ConfigError(f"{path}: the config file must end in .yaml, .yml, .json or .toml")
    except ImportError:
        raise ConfigError(f"{path}: YAML needs PyYAML (pip install pyyaml) or use JSON") from None
    except msgspec.DecodeError as exc:
        raise ConfigError(f"{path} is not valid {suffix.lstrip('.').upper()}: {exc}") from None
    if tree is None:
        return {}
    if not isinstance(tree, dict):
        raise ConfigError(f"{path}: the config file must be a mapping of sections")
    # The first spelling of the weights, before the settings had sections.
    for name in ("tier_weights", "route_weights"):
        if name in tree:
            scoring = tree.setdefault("scoring", {})
            if isinstance(scoring, dict):
                scoring.setdefault(name, tree.pop(name))
    return tree


def decode_settings(flags: Mapping[str, Any], environ: Mapping[str, str]) -> Settings:
    """The one decoder: ``flags`` by destination name (None = not given), then the
    ``KVINDEX_*`` variables, then the config file, then the defaults."""
    unknown = set(flags) - set(LEAVES)
    if unknown:
        raise ConfigError(f"no such setting: {', '.join(sorted(unknown))}")
    given: dict[str, Any] = {}
    for dest, leaf in LEAVES.items():
        value = flags.get(dest)
        if value is None and not leaf.extra.get("file_only"):
            raw = environ.get(leaf.variable)
            if raw:
                value = _from_environment(leaf, raw)
        if value is not None:
            given[dest] = value
    path = given.get("model_config")
    tree = read_config_file(path)
    for dest, value in given.items():
        leaf = LEAVES[dest]
        if leaf.section is None:
            tree[leaf.field] = value
        else:
            section = tree.setdefault(leaf.section, {})
            if not isinstance(section, dict):
                raise ConfigError(f"{path}: {leaf.section} must be a mapping")
            section[leaf.field] = value
    try:
        return msgspec.convert(tree, Settings)
    except msgspec.ValidationError as exc:
        source = f"{path}: " if path else ""
        raise ConfigError(f"{source}{exc}{_hint(str(exc))}") from None


def _hint(message: str) -> str:
    """The flag and variable of the setting a msgspec error points at (``$.http.max_pods``)."""
    for leaf in FLAGGED:
        where = f"$.{leaf.section}.{leaf.field}" if leaf.section else f"$.{leaf.field}"
        if message.endswith(f"`{where}`") or f"`{where}[" in message:
            return f" ({leaf.flag} or {leaf.variable})" if not leaf.extra.get("env_only") else ""
    return ""


def from_flags(**flags: Any) -> Settings:
    """Settings as the command line would give them, without the environment:
    ``from_flags(zmq_bind=["tcp://127.0.0.1:5557"], model="m")``. For tests and for
    embedding kvindex; the CLI uses :func:`decode_settings`."""
    return decode_settings(flags, {})

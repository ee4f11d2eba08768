"""Command-line flags derived from a frozen configuration dataclass, so a setting's name, type, default and help
live in one place: the field. `setting()` declares a field with its help text; `add_flags()` puts every such field
on a parser; `from_flags()` builds the dataclass back from the parsed arguments.

How a field's type becomes a flag: int/float/str take a value; `X | None` takes an X and defaults to None; a Literal
lists its choices; bool is `--name/--no-name`; `bool | None` is `--name {auto,on,off}` (auto: None); a tuple of str
is one comma-separated value."""

import argparse
import dataclasses
import types
import typing
from collections.abc import Callable
from typing import Any, Literal

AUTO_ON_OFF = {"auto": None, "on": True, "off": False}


def setting(default: Any, help: str, *, flag: str | None = None, parse: Callable[[str], Any] | None = None,
            hidden: bool = False) -> Any:
    """A dataclass field that is also a flag: `flag` overrides the name derived from the field's, `parse` the
    conversion of its text, `hidden` keeps it out of --help (test hooks). A MISSING default makes the flag required."""
    metadata = {"help": argparse.SUPPRESS if hidden else help, "flag": flag, "parse": parse}
    if isinstance(default, (list, dict, set, frozenset)):
        raise TypeError("mutable defaults are not settings; use a tuple")
    return dataclasses.field(default=default, metadata=metadata)


def comma_list(text: str) -> tuple[str, ...]:
    return tuple(item.strip() for item in text.split(",") if item.strip())


def _flag_fields(cls: type) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(cls) if "help" in f.metadata]


def _flag_name(f: dataclasses.Field) -> str:
    return f.metadata["flag"] or "--" + f.name.replace("_", "-")


def _dest(f: dataclasses.Field) -> str:
    return _flag_name(f).removeprefix("--").replace("-", "_")


def _optional_inner(hint: Any) -> Any | None:
    """X for `X | None`, else None."""
    if typing.get_origin(hint) in (types.UnionType, typing.Union):
        rest = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(rest) == 1 and len(typing.get_args(hint)) == 2:
            return rest[0]
    return None


def _argument_options(f: dataclasses.Field, hint: Any) -> dict[str, Any]:
    """argparse keyword arguments for one field."""
    options: dict[str, Any] = {"default": f.default, "help": f.metadata["help"], "dest": _dest(f)}
    parse = f.metadata["parse"]
    inner = _optional_inner(hint)
    if parse is not None:
        return options | {"type": parse, "default": argparse.SUPPRESS}  # absent: the field's default, unparsed
    if hint is bool:
        return options | {"action": argparse.BooleanOptionalAction}
    if inner is bool:
        return options | {"choices": tuple(AUTO_ON_OFF), "default": "auto"}
    target = inner if inner is not None else hint
    if typing.get_origin(target) is Literal:
        return options | {"choices": typing.get_args(target)}
    if typing.get_origin(target) is tuple:
        return options | {"type": comma_list, "default": argparse.SUPPRESS}
    if target in (int, float, str):
        return options | {"type": target}
    raise TypeError(f"{f.name}: no flag for type {hint!r}; give it a parse function or leave it out of settings")


def add_flags(parser: argparse.ArgumentParser, cls: type) -> None:
    """One flag per `setting()` field of `cls`, in field order."""
    hints = typing.get_type_hints(cls)
    for f in _flag_fields(cls):
        options = _argument_options(f, hints[f.name])
        if f.default is dataclasses.MISSING:
            options = {k: v for k, v in options.items() if k != "default"} | {"required": True}
        elif options["help"] is not argparse.SUPPRESS and options["default"] not in (argparse.SUPPRESS, None, ""):
            options["help"] += " (default: %(default)s)"
        parser.add_argument(_flag_name(f), **options)


class FlagError(ValueError):
    """Flag values their configuration refuses (its own checks): a usage error, not a crash."""


def from_flags(cls: type, args: argparse.Namespace, **given: Any) -> Any:
    """`cls` built from the parsed flags of its `setting()` fields, plus `given` for the fields flags do not set.
    Raises FlagError with the configuration's own message where it refuses them."""
    hints = typing.get_type_hints(cls)
    values = dict(given)
    for f in _flag_fields(cls):
        if not hasattr(args, _dest(f)):
            continue  # a parse/tuple flag that was not given: the field's default
        value = getattr(args, _dest(f))
        values[f.name] = AUTO_ON_OFF[value] if _optional_inner(hints[f.name]) is bool else value
    try:
        return cls(**values)
    except ValueError as error:
        raise FlagError(str(error)) from None

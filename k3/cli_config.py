"""Command-line flags generated from configuration dataclasses, so an option is written once, next to its field.

    @dataclass
    class OptimConfig:
        lr: float = 3e-3
        '''peak learning rate'''                      # the field's docstring is its --help text

    @dataclass
    class TrainConfig:
        out: str = field(default="runs/tiny", metadata=option(required=True))
        optim: OptimConfig = section(OptimConfig)    # its fields are flags of their own: --lr
        recall: RecallConfig = section(RecallConfig, prefix="recall")  # --recall-fraction, ...

    add_arguments(parser, TrainConfig)               # one flag per field
    config = from_flat(TrainConfig, given(TrainConfig, args))

Every field has a *flat name*: its own name, or its section's prefix joined to it (``recall_fraction``), or the
name option(name=...) gives. The flag is the flat name with dashes (--recall-fraction), the argparse dest is the
flat name, and a saved config in the old flat layout ({"recall_fraction": ...}) reads back through the same names
(from_dict). Flags default to None ("not given"), so a field keeps its dataclass default unless the flag is typed,
and a resumed run can take only what the user typed.

Types: bool (--x when it defaults to False, --no-x when to True, both when to None; option(negative=...) names
the False flag and adds it), int, float, str, X | None, Literal[...] or option(choices=...), list[T] (a
repeatable flag); anything else needs option(parse=...) or option(cli=False). The help is the field's docstring (a
string right after it), or option(help=...) where it is computed; it gets "(default X)" unless it speaks of its
default itself. A section may hold another default than its class's (section(default=...)): the flags start from
it. Learnt from torchtitan's JobConfig and simple_parsing.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import textwrap
import types
import typing
from dataclasses import dataclass
from typing import Any, Callable, Literal, Mapping

KEY = "k3_cli"


def option(*, help: str | None = None, name: str | None = None, aliases: tuple[str, ...] = (),
           metavar: str | None = None, choices: tuple | list | None = None, parse: Callable[[str], Any] | None = None,
           negative: str | None = None, negative_help: str | None = None, required: bool = False,
           const: Any = None, show_default: bool = True, cli: bool = True) -> dict:
    """Field metadata for the generated flag: ``field(default=..., metadata=option(...))``.

    name: the flat name (and so the flag and dest) instead of the field's (prefixed) own; aliases: more flags
    (full spellings, e.g. "--from"); parse: turns the flag's text into the value, for types the generator does not
    know (applied by given(), so its ValueError reaches the command's error handling); negative: the name of a
    bool's False flag (default no-NAME); const: the value of the flag given without one (--ray alone: "local");
    show_default=False: no "(default X)" in the help (a default the command replaces);
    cli=False: no flag (the field still has a flat name, for from_flat and old saved configs)."""
    return {KEY: {"help": help, "name": name, "aliases": tuple(aliases), "metavar": metavar,
                  "choices": None if choices is None else tuple(choices), "parse": parse, "negative": negative,
                  "negative_help": negative_help, "required": required, "const": const,
                  "show_default": show_default, "cli": cli}}


def section(cls: type, *, prefix: str | None = None, title: str | None = None, default: Callable[[], Any] | None = None,
            no_flag: tuple[str, ...] = (), derived: tuple[str, ...] = (), cli: bool = True) -> Any:
    """A nested configuration section: ``optim: OptimConfig = section(OptimConfig)``. prefix: its fields' flat
    names start with PREFIX_ (flags --PREFIX-...); title: the --help group (default: the class docstring's first
    line); default: a factory of the section's default (default: cls()), whose values the flags start from;
    no_flag: fields without a flag here (they keep their flat names); derived: fields the enclosing config sets
    from its others (no flag, no flat name)."""
    return dataclasses.field(default_factory=default or cls, metadata={KEY: {
        "section": True, "prefix": prefix, "title": title, "no_flag": tuple(no_flag), "derived": tuple(derived),
        "cli": cli}})


@dataclass(frozen=True)
class FlatField:
    """One leaf field of a (nested) configuration: where it sits and how the command line names it."""

    path: tuple[str, ...]  # attribute names from the top config down, e.g. ("recall", "fraction")
    name: str  # the flat name: argparse dest, key of the old flat layout
    type: Any  # the resolved annotation
    field: dataclasses.Field
    owner: type  # the dataclass that declares the field
    help: str
    cli: bool
    group: str | None  # the --help group of its section
    default: Any  # in its place: a section's default may differ from its class's (section(default=...))

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def meta(self) -> dict:
        return self.field.metadata.get(KEY, {})


@functools.cache
def field_docstrings(cls: type) -> dict[str, str]:
    """{field name: the string literal that follows its declaration in the class body} (torchtitan's style)."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    body = ast.parse(source).body[0].body
    docs = {}
    for node, following in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant)
                and isinstance(following.value.value, str)):
            docs[node.target.id] = " ".join(following.value.value.split())
    return docs


def _is_section(f: dataclasses.Field, hint: Any) -> bool:
    return isinstance(hint, type) and dataclasses.is_dataclass(hint) and f.metadata.get(KEY, {}).get("section", False)


@functools.cache
def flat_fields(cls: type) -> tuple[FlatField, ...]:
    """Every leaf field of ``cls`` and its sections, in declaration order; ValueError on two with one flat name."""
    out: list[FlatField] = []
    _walk(cls, None, (), "", True, None, {}, out)
    seen: dict[str, tuple[str, ...]] = {}
    for leaf in out:
        if leaf.name in seen:
            raise ValueError(f"{cls.__name__}: fields {'.'.join(seen[leaf.name])} and {'.'.join(leaf.path)} share "
                             f"the flat name {leaf.name!r}; give one option(name=...)")
        seen[leaf.name] = leaf.path
    return tuple(out)


def _walk(cls: type, instance: Any, path: tuple[str, ...], prefix: str, cli: bool, group: str | None,
          section_meta: dict, out: list[FlatField]) -> None:
    """Append the leaves of ``cls`` (its default ``instance``, None at the top) to ``out``; ``section_meta`` is the
    section() metadata of the field that holds it."""
    hints = typing.get_type_hints(cls)
    docs = field_docstrings(cls)
    for f in dataclasses.fields(cls):
        if f.name in section_meta.get("derived", ()):
            continue
        hint, meta = hints[f.name], f.metadata.get(KEY, {})
        default = _default(f) if instance is None else getattr(instance, f.name)
        if _is_section(f, hint):
            title = meta.get("title") or (inspect.getdoc(hint) or hint.__name__).splitlines()[0]
            inner = prefix + meta["prefix"] + "_" if meta.get("prefix") else prefix
            _walk(hint, default, path + (f.name,), inner, cli and meta.get("cli", True), title, meta, out)
            continue
        name = meta.get("name") or prefix + f.name
        flag = cli and meta.get("cli", True) and f.name not in section_meta.get("no_flag", ())
        out.append(FlatField(path + (f.name,), name, hint, f, cls, meta.get("help") or docs.get(f.name, ""), flag,
                             group, default))


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def _strip_optional(hint: Any) -> Any:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return hint


def _help_text(leaf: FlatField) -> str:
    text = leaf.help
    default = leaf.default
    shown = not (default is dataclasses.MISSING or default is None or default is False or default in ("", [], {}))
    shown = shown and leaf.meta.get("show_default", True) and not leaf.meta.get("required")
    if shown and "default" not in text.lower():
        text = f"{text} (default {default})" if text else f"default {default}"
    return text.replace("%", "%%")  # argparse formats help with %


def _flag_kwargs(leaf: FlatField) -> dict[str, Any]:
    """argparse keyword arguments of a non-bool leaf: type / choices / action from the annotation and option()."""
    meta, hint = leaf.meta, _strip_optional(leaf.type)
    kwargs: dict[str, Any] = {"dest": leaf.name, "default": None, "help": _help_text(leaf)}
    if meta.get("metavar"):
        kwargs["metavar"] = meta["metavar"]
    if meta.get("required"):
        kwargs["required"] = True
    if meta.get("parse"):
        kwargs["type"] = str  # parsed by given(), so a bad value is the parser's ValueError, said as it words it
    elif typing.get_origin(hint) is list and typing.get_args(hint) and typing.get_args(hint)[0] in (int, float, str):
        kwargs.update(action="append", type=typing.get_args(hint)[0])
    elif typing.get_origin(hint) is Literal:
        values = typing.get_args(hint)
        kwargs.update(type=type(values[0]), choices=values)
    elif hint in (int, float, str):
        kwargs["type"] = hint
    else:
        raise TypeError(f"{leaf.owner.__name__}.{leaf.field.name}: no flag for type {leaf.type!r}; give "
                        f"option(parse=...) or option(cli=False)")
    if meta.get("choices") is not None:
        kwargs["choices"] = meta["choices"]
    if meta.get("const") is not None:
        kwargs.update(nargs="?", const=meta["const"])
    return kwargs


def add_arguments(parser: argparse.ArgumentParser, cls: type, skip: tuple[str, ...] = (),
                  groups: Mapping[str, Any] | None = None) -> None:
    """A flag for every leaf field of ``cls`` (but those named in ``skip``, by flat name). Fields of a titled
    section go into an argument group of that title (``groups`` may hold groups made beforehand, by title)."""
    made: dict[str, Any] = dict(groups or {})
    for leaf in flat_fields(cls):
        if not leaf.cli or leaf.name in skip:
            continue
        target = parser
        if leaf.group:
            target = made.get(leaf.group) or made.setdefault(leaf.group, parser.add_argument_group(leaf.group))
        flags = [leaf.flag, *leaf.meta.get("aliases", ())]
        if _strip_optional(leaf.type) is bool:
            _add_bool(target, leaf, flags)
        else:
            target.add_argument(*flags, **_flag_kwargs(leaf))


def _add_bool(target, leaf: FlatField, flags: list[str]) -> None:
    """--x sets True, --no-x (or option(negative=...)) False: the one that changes the default, or both for a
    default of None (decided later) or a negative named on purpose."""
    default = leaf.default
    negative = "--" + (leaf.meta.get("negative") or "no-" + leaf.name.replace("_", "-"))
    with_positive = default is not True
    with_negative = default is not False or bool(leaf.meta.get("negative"))
    both = target.add_mutually_exclusive_group() if with_positive and with_negative else target
    if with_positive:
        both.add_argument(*flags, dest=leaf.name, action="store_const", const=True, default=None,
                          help=leaf.help.replace("%", "%%"))
    if with_negative:
        text = leaf.meta.get("negative_help") or (f"off: {leaf.help} (on by default)" if default is True
                                                  else f"the opposite of {flags[0]}")
        both.add_argument(negative, *(() if with_positive else flags[1:]), dest=leaf.name, action="store_const",
                          const=False, default=None, help=text.replace("%", "%%"))


def flags_of(cls: type) -> set[str]:
    """Every flag add_arguments makes for ``cls`` (bools: both spellings)."""
    parser = argparse.ArgumentParser(add_help=False)
    add_arguments(parser, cls)
    return {s for action in parser._actions for s in action.option_strings}


def given(cls: type, args: argparse.Namespace) -> dict[str, Any]:
    """{flat name: value} of the flags the user typed (a flag left out is None; a field without a flag is not read,
    so an attribute of the same name that the command adds itself is left alone)."""
    values = {}
    for leaf in flat_fields(cls):
        value = getattr(args, leaf.name, None) if leaf.cli else None
        if value is not None:
            parse = leaf.meta.get("parse")
            values[leaf.name] = parse(value) if parse and isinstance(value, str) else value
    return values


def _nest(cls: type, flat: Mapping[str, Any]) -> dict:
    by_name = {leaf.name: leaf for leaf in flat_fields(cls)}
    unknown = sorted(set(flat) - set(by_name))
    if unknown:
        raise ValueError(f"{cls.__name__} has no field {', '.join(map(repr, unknown))}; its fields are "
                         f"{', '.join(sorted(by_name))}")
    tree: dict = {}
    for name, value in flat.items():
        node = tree
        *sections, last = by_name[name].path
        for part in sections:
            node = node.setdefault(part, {})
        node[last] = value
    return tree


def _check_scalar(cls: type, name: str, hint: Any, value: Any) -> None:
    """A scalar field's value of the annotated type (a saved config may come from anyone's checkpoint): a clear
    ValueError here, not a TypeError deep in a __post_init__ or a kernel."""
    optional = typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in typing.get_args(hint)
    kind = _strip_optional(hint)
    if value is None:  # "not given": some fields derive it later (RLConfig's clip bounds from the algorithm)
        return
    allowed = {bool: (bool,), int: (int,), float: (int, float), str: (str,)}.get(kind)
    if allowed is None:  # lists, dicts, Literals, unions: checked by the dataclass itself
        return
    if not isinstance(value, allowed) or (kind is not bool and isinstance(value, bool)):
        raise ValueError(f"{cls.__name__}.{name} must be {kind.__name__}{' or None' if optional else ''}, got "
                         f"{type(value).__name__} {value!r:.60}")


def check_positive(config: Any, *names: str, prefix: str = "") -> None:
    """A ValueError naming the first field of ``config`` among ``names`` that is not above 0 (NaN included); the
    message gives the flat name (``prefix`` + field name) and what would be right: at least 1 for a count."""
    for name in names:
        value = getattr(config, name)
        if not value > 0:
            right = "at least 1" if isinstance(value, int) else "positive (above 0)"
            raise ValueError(f"{prefix}{name} must be {right}, got {value!r}")


def _build(cls: type, tree: Mapping[str, Any], base: Any = None) -> Any:
    """``cls`` from a tree of values: a section's values replace its value in ``base``, else its default."""
    hints = typing.get_type_hints(cls)
    values = {}
    for f in dataclasses.fields(cls):
        if f.name not in tree:
            continue
        value = tree[f.name]
        if _is_section(f, hints[f.name]) and isinstance(value, Mapping):
            value = _build(hints[f.name], value, _default(f) if base is None else getattr(base, f.name))
        else:
            _check_scalar(cls, f.name, hints[f.name], value)
        values[f.name] = value
    return cls(**values) if base is None else dataclasses.replace(base, **values)


def from_flat(cls: type, flat: Mapping[str, Any] | None = None, /, **more: Any) -> Any:
    """``cls`` built from flat names (as the flags and the old flat layout call its fields); the rest default."""
    return _build(cls, _nest(cls, {**(flat or {}), **more}))


def replace_flat(config: Any, flat: Mapping[str, Any] | None = None, /, **more: Any) -> Any:
    """A copy of ``config`` with the fields named by flat name replaced (sections re-validated)."""
    return _build(type(config), _nest(type(config), {**(flat or {}), **more}), config)


def from_dict(cls: type, data: Mapping[str, Any]) -> Any:
    """``cls`` from a saved dict: the nested layout (asdict) or an older flat one, or a mix.

    A key that names a section and holds a dict is that section; any other key is a flat name."""
    hints = typing.get_type_hints(cls)
    sections = {f.name for f in dataclasses.fields(cls) if _is_section(f, hints[f.name])}
    nested = {k: v for k, v in data.items() if k in sections and isinstance(v, Mapping)}
    tree = _nest(cls, {k: v for k, v in data.items() if k not in nested})
    for name, value in nested.items():
        inner = hints[name]
        by_field = {f.name for f in dataclasses.fields(inner)}
        unknown = sorted(set(value) - by_field)
        if unknown:
            raise ValueError(f"{cls.__name__}.{name} has no field {', '.join(map(repr, unknown))}")
        target = tree.setdefault(name, {})
        for key, item in value.items():
            target.setdefault(key, item)
    return _build(cls, tree)


def to_flat(config: Any) -> dict[str, Any]:
    """{flat name: value} of every leaf field of ``config``."""
    out = {}
    for leaf in flat_fields(type(config)):
        value = config
        for part in leaf.path:
            value = getattr(value, part)
        out[leaf.name] = value
    return out

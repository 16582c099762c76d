"""Typed, validated configuration objects: the base class and its machinery.

Every part of a run is a frozen, keyword-only dataclass deriving from `ConfigBase`.
Types are checked on construction, each class validates its own values in
`validate()`, and overrides (`--set a.b=value`) are parsed by the field's type and
applied with `dataclasses.replace`, so validation runs again on every change.
This module imports nothing heavy (no JAX), so the CLI can read a config before it
decides how JAX should start.
"""

from __future__ import annotations

import ast
import contextvars
import dataclasses
import difflib
import functools
import inspect
import io
import json
import textwrap
import tokenize
import types
import typing
import warnings
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, Literal, Self, Union


class ConfigError(ValueError):
    """A config value is unknown, mistyped or impossible; the message names the field and the fix.

    `field` is the dotted path of the offending field relative to where the error was last
    re-raised; `section` names the config class while no enclosing path is known yet.
    """

    def __init__(self, detail: str, *, field: str = "", section: str = "") -> None:
        self.detail, self.field, self.section = detail, field, section
        where = ".".join(p for p in (section, field) if p)
        super().__init__(f"{where}: {detail}" if where else detail)

    def within(self, path: str) -> ConfigError:
        """The same error seen from the enclosing section `path`."""
        if not path:
            return self
        return ConfigError(self.detail, field=_join(path, self.field) if self.field else path)


class ConfigRenamedWarning(FutureWarning):
    """A config names a field by its old path (`ConfigBase.RENAMED`): it still works, for one
    release, and the warning names the new path. A FutureWarning, so a CLI user sees it."""


def _type_name(hint: Any) -> str:
    origin = typing.get_origin(hint)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(hint))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(hint))
    if origin is tuple:
        args = typing.get_args(hint)
        if len(args) == 2 and args[1] is Ellipsis:
            return f"tuple[{_type_name(args[0])}, ...]"
        return "tuple[" + ", ".join(_type_name(a) for a in args) + "]"
    if hint is type(None):
        return "None"
    return getattr(hint, "__name__", str(hint))


def _conforms(value: Any, hint: Any) -> bool:
    """Whether `value` is exactly of type `hint` (no coercion but int -> float)."""
    origin = typing.get_origin(hint)
    if hint is Any:
        return True
    if hint is type(None):
        return value is None
    if origin is Literal:
        return any(value == a and type(value) is type(a) for a in typing.get_args(hint))
    if origin in (typing.Union, types.UnionType):
        return any(_conforms(value, a) for a in typing.get_args(hint))
    if origin is tuple:
        if not isinstance(value, tuple):
            return False
        args = typing.get_args(hint)
        if len(args) == 2 and args[1] is Ellipsis:
            return all(_conforms(v, args[0]) for v in value)
        if len(value) != len(args):
            return False
        return all(_conforms(v, a) for v, a in zip(value, args, strict=True))
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if isinstance(hint, type):
        return isinstance(value, hint)
    raise TypeError(f"unsupported config type hint {hint!r}")


def _int_for_float(value: Any, hint: Any) -> bool:
    """Whether `value` is an int where `hint` takes a float and no int."""
    if not isinstance(value, int) or isinstance(value, bool):
        return False
    options = (
        typing.get_args(hint) if typing.get_origin(hint) in (Union, types.UnionType) else (hint,)
    )
    return float in options and int not in options


def _coerce(value: Any, hint: Any, path: str) -> Any:
    """Turn JSON-ish data (lists, dicts, ints for floats) into a value of type `hint`."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(hint):
            try:
                return _coerce(value, arg, path)
            except ConfigError:
                continue
        raise ConfigError(
            f"expected {_type_name(hint)}, got {value!r} ({type(value).__name__})", field=path
        )
    if isinstance(hint, type) and issubclass(hint, ConfigBase):
        if isinstance(value, hint):
            return value
        if isinstance(value, Mapping):
            return hint.from_dict(value, path=path)
        raise ConfigError(f"expected a {hint.__name__} section, got {value!r}", field=path)
    if origin is tuple and isinstance(value, (list, tuple)):
        args = typing.get_args(hint)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_coerce(v, args[0], f"{path}[{i}]") for i, v in enumerate(value))
        if len(value) != len(args):
            raise ConfigError(
                f"expected {_type_name(hint)} ({len(args)} items), got {value!r}", field=path
            )
        pairs = enumerate(zip(value, args, strict=True))
        return tuple(_coerce(v, a, f"{path}[{i}]") for i, (v, a) in pairs)
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if _conforms(value, hint):
        return value
    raise ConfigError(
        f"expected {_type_name(hint)}, got {value!r} ({type(value).__name__})", field=path
    )


def _parse_text(text: str, hint: Any, path: str, current: Any = None) -> Any:
    """Parse a command-line override value by the type of the field it sets (`current`, the
    field's value before it: a section's preset may keep some of it)."""
    origin = typing.get_origin(hint)
    options = typing.get_args(hint) if origin in (typing.Union, types.UnionType) else (hint,)
    if type(None) in options and text.strip().lower() in ("none", "null"):
        return None
    sections = [o for o in options if isinstance(o, type) and issubclass(o, ConfigBase)]
    for section in sections:
        try:
            selected = section.from_preset_name(text, current)
        except ConfigError as e:
            raise _relocate(e, path) from None
        if selected is not None:
            return selected
    scalar_hints = [o for o in options if o is not type(None) and o not in sections]
    errors: list[ConfigError] = []
    for h in scalar_hints:
        try:
            parsed = _literal(text, h)
        except ValueError:
            continue
        try:
            return _coerce(parsed, h, path)
        except ConfigError as e:
            errors.append(e)
    if len(errors) == 1 and errors[0].field != path:
        raise errors[0]  # the value parsed, and a field inside it is wrong: say which
    presets = sorted({p for s in sections for p in s.PRESETS})
    hint_text = f"; presets: {', '.join(presets)}" if presets else ""
    raise ConfigError(f"cannot read {text!r} as {_type_name(hint)}{hint_text}", field=path)


def _literal(text: str, hint: Any) -> Any:
    origin = typing.get_origin(hint)
    if hint is str or (
        origin is Literal and all(isinstance(a, str) for a in typing.get_args(hint))
    ):
        return text
    if hint is bool:
        lowered = text.strip().lower()
        if lowered in ("true", "1", "yes"):
            return True
        if lowered in ("false", "0", "no"):
            return False
        raise ValueError(f"not a boolean: {text!r} (use true or false)")
    try:
        value = ast.literal_eval(text)
        # One item of a tuple field: "128" reads as (128,), as "128," does.
        return (value,) if origin is tuple and not isinstance(value, (list, tuple)) else value
    except (ValueError, SyntaxError):
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            # A bare word inside a tuple, e.g. (data,fsdp): read it as strings.
            if origin is tuple:
                return tuple(p.strip() for p in text.strip("()[] ").split(",") if p.strip())
            raise ValueError(f"cannot parse {text!r}") from None


# Set while `apply_overrides` applies a command line's overrides one by one: sections skip
# their `validate` until the whole result is validated once (the order of the overrides then
# never matters, and fields valid only together can be set).
_VALIDATION_DEFERRED: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "rlax_tpu_config_validation_deferred", default=False
)


def _unknown_key(cls: type, key: str, path: str) -> ConfigError:
    names = [f.name for f in dataclasses.fields(cls)]
    close = difflib.get_close_matches(key, names, n=1)
    suggestion = f"did you mean {close[0]!r}? " if close else ""
    return ConfigError(
        f"unknown key {key!r}; {suggestion}valid keys: {', '.join(names)}",
        field=path,
        section="" if path else cls.__name__,
    )


@dataclasses.dataclass(kw_only=True, frozen=True)
class ConfigBase:
    """Base of every config section. Subclasses override `validate`, never `__post_init__`."""

    # Named ready-made values of the whole section, selectable with `--set section=NAME`
    # (`from_preset_name`).
    PRESETS: ClassVar[dict[str, Callable[[], Any]]] = {}
    # Old dotted path -> new dotted path, both from this section as the root of a config:
    # an override or a dict key (an older run's config.json) of an old path is moved to its
    # new one with a ConfigRenamedWarning. RunConfig holds the table (RENAMED_FIELDS).
    RENAMED: ClassVar[Mapping[str, str]] = {}

    def __post_init__(self) -> None:
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            hint = hints[f.name]
            if _int_for_float(value, hint):
                # 256 and 256.0 are one value: keep one spelling, so digests agree.
                object.__setattr__(self, f.name, float(value))
            elif not _conforms(value, hint):
                try:
                    coerced = _coerce(value, hint, "")
                except ConfigError as e:
                    raise ConfigError(
                        e.detail, field=_join(f.name, e.field), section=_cls_name(self)
                    ) from None
                object.__setattr__(self, f.name, coerced)
        if _VALIDATION_DEFERRED.get():
            return
        try:
            self.validate()
        except ConfigError as e:
            if e.section or not e.field:
                raise
            raise ConfigError(e.detail, field=e.field, section=_cls_name(self)) from None

    def validate(self) -> None:
        """Check values; raise ConfigError naming the field and the fix."""

    @classmethod
    def from_preset_name(cls, name: str, current: Any) -> Self | None:
        """The section that `--set path=NAME` selects: preset `name` of `PRESETS`, or None
        when there is none of that name. `current` is the section's value before the
        override (None, or a section of another type, when it has none): a subclass whose
        presets leave some fields alone keeps them from it."""
        make = cls.PRESETS.get(name)
        return None if make is None else make()

    # -- conversion ---------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            out[f.name] = _to_plain(getattr(self, f.name))
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, path: str = "") -> Self:
        if not path and cls.RENAMED:
            data = _move_renamed(data, cls.RENAMED)
        hints = typing.get_type_hints(cls)
        names = {f.name for f in dataclasses.fields(cls)}
        kwargs = {}
        for key, value in data.items():
            if key not in names:
                raise _unknown_key(cls, key, path)
            kwargs[key] = _coerce(value, hints[key], _join(path, key))
        try:
            return cls(**kwargs)
        except ConfigError as e:
            raise _relocate(e, path) from None

    # -- overrides ----------------------------------------------------------------
    def override(self, dotted_key: str, value: Any, *, _path: str = "") -> Self:
        """Return a copy with `dotted_key` (e.g. "trainer.optimizer.learning_rate") set to `value`.

        A string value is parsed by the field's type; a section accepts a preset name. An
        old path of `RENAMED` sets its new one (with a ConfigRenamedWarning).
        """
        if not _path and dotted_key in self.RENAMED:
            new = self.RENAMED[dotted_key]
            if not _is_section_value(dotted_key, new, value):
                _warn_renamed(dotted_key, new)
                dotted_key = new
        head, _, rest = dotted_key.partition(".")
        fields = {f.name: f for f in dataclasses.fields(self)}
        if head not in fields:
            raise _unknown_key(type(self), head, _path)
        hint = typing.get_type_hints(type(self))[head]
        path = _join(_path, head)
        current = getattr(self, head)
        if rest:
            if not isinstance(current, ConfigBase):
                if current is None:
                    raise ConfigError(
                        f"is None, so {path}.{rest} cannot be set; "
                        f"set {path} to a preset or a value first",
                        field=path,
                    )
                raise ConfigError(f"is a {_type_name(hint)}, it has no field {rest!r}", field=path)
            new_value = current.override(rest, value, _path=path)
        elif isinstance(value, str):
            new_value = _parse_text(value, hint, path, current)
        else:
            new_value = _coerce(value, hint, path)
        try:
            return dataclasses.replace(self, **{head: new_value})
        except ConfigError as e:
            raise _relocate(e, _path) from None

    def apply_overrides(self, overrides: list[str] | tuple[str, ...]) -> Self:
        """Apply "key=value" strings (as given by `--set`; a later one of the same key wins),
        then validate the result once, as a whole: the order never matters, and fields that
        are only valid together (a verifier and its reward function, a batch and its
        mini-batch) can be set at once."""
        if not overrides:
            return self
        token = _VALIDATION_DEFERRED.set(True)
        try:
            config = self
            for item in overrides:
                key, sep, value = item.partition("=")
                if not sep or not key.strip():
                    raise ConfigError(f"override {item!r} is not of the form key=value")
                config = config.override(key.strip(), value.strip())
        finally:
            _VALIDATION_DEFERRED.reset(token)
        return type(config).from_dict(config.to_dict())

    # -- text form ----------------------------------------------------------------
    def flat_items(self, prefix: str = "") -> list[tuple[str, Any]]:
        items: list[tuple[str, Any]] = []
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            key = _join(prefix, f.name)
            if isinstance(value, ConfigBase):
                items.extend(value.flat_items(key))
            else:
                items.append((key, value))
        return items

    def to_text(self) -> str:
        """One `key = value` line per leaf, in declaration order: stable, diffable text."""
        lines = [f"{key} = {json.dumps(_to_plain(v))}" for key, v in self.flat_items()]
        return "\n".join(lines) + "\n"


def _is_section_value(old: str, new: str, value: Any) -> bool:
    """Whether `value` set at `old` is meant for the section that now has `old`'s name (the
    old path of a leaf that became a section's field: controller.replay -> .replay.enabled)."""
    if not new.startswith(old + "."):
        return False
    if isinstance(value, str):
        try:
            _literal(value, bool)
        except ValueError:
            return True
        return False
    return isinstance(value, (Mapping, ConfigBase))


def _warn_renamed(old: str, new: str) -> None:
    warnings.warn(
        f"config field {old} is now {new}; the old path works until the next release",
        ConfigRenamedWarning,
        stacklevel=4,
    )


def _move_renamed(data: Mapping[str, Any], renamed: Mapping[str, str]) -> dict[str, Any]:
    """`data` (a config's dict form) with every old path of `renamed` moved to its new one.
    All old values are taken out first, then put in: an old leaf may have become a section
    of the same name (controller.replay)."""
    data = _deep_copy_dicts(data)
    moved: list[tuple[str, str, Any]] = []
    for old, new in renamed.items():
        *parents, last = old.split(".")
        section = _walk(data, parents)
        if section is None or last not in section:
            continue
        if _is_section_value(old, new, section[last]):
            continue
        moved.append((old, new, section.pop(last)))
    for old, new, value in moved:
        *parents, last = new.split(".")
        section = data
        for key in parents:
            section = section.setdefault(key, {})
            if not isinstance(section, dict):
                raise ConfigError(f"cannot move {old} to {new}: {key} is not a section")
        if last in section:
            raise ConfigError(
                f"is set twice, as {new} and by its old path {old}: keep only {new}", field=new
            )
        section[last] = value
    if moved:
        pairs = ", ".join(f"{old} -> {new}" for old, new, _ in moved)
        warnings.warn(
            f"config fields at old paths, read at their new ones (the old paths work until "
            f"the next release): {pairs}",
            ConfigRenamedWarning,
            stacklevel=4,
        )
    return data


def unmove_renamed(data: dict[str, Any], renamed: Mapping[str, str]) -> dict[str, Any]:
    """The inverse of `_move_renamed` on a config's dict form (in place): every new path of
    `renamed` present goes back to its old one, and a section left empty goes away."""
    moved: list[tuple[str, Any]] = []
    for old, new in renamed.items():
        *parents, last = new.split(".")
        chain = [data]
        for key in parents:
            nxt = chain[-1].get(key)
            if not isinstance(nxt, dict):
                break
            chain.append(nxt)
        else:
            if last in chain[-1]:
                moved.append((old, chain[-1].pop(last)))
                for parent, key in zip(reversed(chain[:-1]), reversed(parents), strict=True):
                    if parent[key]:
                        break
                    del parent[key]
    for old, value in moved:
        *parents, last = old.split(".")
        section = data
        for key in parents:
            section = section.setdefault(key, {})
        section[last] = value
    return data


def _walk(data: Mapping[str, Any], keys: list[str]) -> dict[str, Any] | None:
    for key in keys:
        data = data.get(key)
        if not isinstance(data, dict):
            return None
    return data  # type: ignore[return-value]


def _deep_copy_dicts(data: Mapping[str, Any]) -> dict[str, Any]:
    return {k: _deep_copy_dicts(v) if isinstance(v, Mapping) else v for k, v in data.items()}


@functools.cache
def _field_comments(cls: type) -> tuple[tuple[str, str], ...]:
    """(field, description) of each field `cls` itself declares, from its source comments."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return ()
    lines = source.splitlines()
    comments: dict[int, str] = {}  # line number (1-based) -> comment text
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            comments[token.start[0]] = token.string.lstrip("#").strip()
    body = ast.parse(source).body[0]
    assert isinstance(body, ast.ClassDef)
    out = []
    for node in body.body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        above: list[str] = []
        line = node.lineno - 1
        while line >= 1 and lines[line - 1].strip().startswith("#"):
            above.insert(0, comments.get(line, ""))
            line -= 1
        # A "-- heading --" line groups fields; it describes none of them.
        above = [c for c in above if not c.startswith("--")]
        trailing = [comments[n] for n in range(node.lineno, node.end_lineno + 1) if n in comments]
        text = " ".join(c for c in above + trailing if c)
        out.append((node.target.id, text))
    return tuple(out)


def field_descriptions(
    cls: type[ConfigBase], prefix: str = "", defaults: ConfigBase | None = None
) -> list[tuple[str, str, str, str]]:
    """(dotted path, type, default, description) of every field of `cls` and of the sections
    inside it (a section that may be None or a tuple of sections is walked too, `[]`
    marking the tuple): what `rlax-tpu config show --help-fields` prints. `defaults`: the
    instance whose values are the defaults (a section's default in its parent)."""
    hints = typing.get_type_hints(cls)
    helps: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if isinstance(klass, type) and issubclass(klass, ConfigBase):
            helps.update(_field_comments(klass))
    rows = []
    for f in dataclasses.fields(cls):
        path, hint = _join(prefix, f.name), hints[f.name]
        if defaults is not None:
            value = getattr(defaults, f.name)
        elif f.default is not dataclasses.MISSING:
            value = f.default
        elif f.default_factory is not dataclasses.MISSING:
            value = f.default_factory()
        else:
            value = dataclasses.MISSING
        default = "(required)" if value is dataclasses.MISSING else json.dumps(_to_plain(value))
        sections = _sections_of(hint)
        if not sections or typing.get_origin(hint) in (typing.Union, types.UnionType):
            rows.append((path, _type_name(hint), default, helps.get(f.name, "")))
        for section, suffix in sections:
            inner = value if isinstance(value, section) else None
            rows.extend(field_descriptions(section, path + suffix, inner))
    return rows


def _sections_of(hint: Any) -> list[tuple[type[ConfigBase], str]]:
    """The config sections a field of type `hint` holds, with the path suffix of each."""
    origin = typing.get_origin(hint)
    if isinstance(hint, type) and issubclass(hint, ConfigBase):
        return [(hint, "")]
    if origin in (typing.Union, types.UnionType):
        return [s for a in typing.get_args(hint) for s in _sections_of(a)]
    if origin is tuple:
        args = typing.get_args(hint)
        if len(args) == 2 and args[1] is Ellipsis:
            return [(s, suffix + "[]") for s, suffix in _sections_of(args[0])]
    return []


def _to_plain(value: Any) -> Any:
    if isinstance(value, ConfigBase):
        return value.to_dict()
    if isinstance(value, tuple):
        return [_to_plain(v) for v in value]
    return value


def _join(prefix: str, key: str) -> str:
    return ".".join(p for p in (prefix, key) if p)


def _cls_name(obj: Any) -> str:
    return type(obj).__name__


def _relocate(error: ConfigError, path: str) -> ConfigError:
    """An error raised by a section's own checks, re-addressed by the section's dotted path."""
    if not path:
        return ConfigError(error.detail, field=error.field)
    return error.within(path)


def require(condition: bool, field: str, message: str) -> None:
    """Raise ConfigError naming `field` unless `condition` holds."""
    if not condition:
        raise ConfigError(message, field=field)

"""Typed params: each stage reads its own section of ``params.yaml`` into a frozen dataclass.

Every section class derives from :class:`Section`. ``Section.load(path, "train")`` reads the YAML,
rejects unknown keys (naming the file and the key), fills defaults, converts lists to tuples and
calls the class's ``validate()``, which raises :class:`ValueError` on bad values. No asserts on
user input anywhere: a user editing ``params.yaml`` gets one clear line, never a torch traceback.

Nested sections are dataclasses too (``TrainConfig.optim: OptimConfig``); they are built
recursively from the YAML mapping, so ``dvc exp run -S train.optim.lr=1e-4`` reaches them.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from pathlib import Path
from typing import Any, TypeVar

import yaml

from dspark_core.errors import UserError

T = TypeVar("T", bound="Section")
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml's parser: ~10x faster, same documents


class ParamsError(UserError):
    """A bad value in params.yaml (or another config file); the message names file and field."""


def read_yaml(path: str | Path) -> Any:
    """The YAML document of ``path`` ({} when empty); a syntax error is a ParamsError naming the line."""
    if not Path(path).is_file():
        raise ParamsError(f"{path}: no such file; run from the repository root (where params.yaml and dvc.yaml are) "
                          "or name the file")
    try:
        with Path(path).open(encoding="utf-8") as fh:
            return yaml.load(fh, Loader=_LOADER) or {}
    except UnicodeDecodeError as e:
        raise ParamsError(f"{path}: not UTF-8 text (byte {e.start}); save it as UTF-8") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        what = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ParamsError(f"{path}:{where}: YAML syntax error ({what}); fix that line") from None


def _where(src: str, field: str) -> str:
    return f"{src}: {field}" if src else field


@dataclasses.dataclass(frozen=True)
class Section:
    """Base of every params section. Subclasses are ``@dataclass(frozen=True)``.

    ``EXECUTION_KEYS``: fields that decide how a run executes, not what it computes (kernels, process counts,
    batch layouts with the same loss): left out of :meth:`identity_dict`, which decides whether a checkpoint
    made under other values can be resumed."""

    EXECUTION_KEYS: typing.ClassVar[tuple[str, ...]] = ()

    def validate(self) -> None:  # overridden by sections with constraints
        return None

    # -- construction ---------------------------------------------------------------------
    @classmethod
    def from_dict(cls: type[T], data: dict[str, Any] | None, *, src: str = "", prefix: str = "") -> T:
        data = dict(data or {})
        hints = typing.get_type_hints(cls)
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - set(fields))
        if unknown:
            raise ParamsError(
                f"{_where(src, prefix + unknown[0])} is not a known parameter "
                f"(known: {', '.join(sorted(fields))})"
            )
        kwargs: dict[str, Any] = {}
        for name, value in data.items():
            kwargs[name] = _coerce(hints[name], value, src, prefix + name)
        try:
            obj = cls(**kwargs)
        except TypeError as e:  # a required field is missing
            raise ParamsError(f"{_where(src, prefix.rstrip('.') or cls.__name__)}: {e}") from None
        try:
            obj.validate()
        except ParamsError:
            raise
        except ValueError as e:  # messages start with the field name: "lr must be > 0; got -1"
            raise ParamsError(_where(src, f"{prefix}{e}")) from None
        return obj

    @classmethod
    def check_keys(cls, data: dict[str, Any], where: str) -> None:
        """Refuse a key of ``data`` (nested sections too) that is not a field, naming it under ``where`` (e.g.
        ``params.yaml: variants.small.draft``): a variant's override is named where it is written."""
        fields = {f.name for f in dataclasses.fields(cls)}
        hints = typing.get_type_hints(cls)
        for key, value in data.items():
            if key not in fields:
                raise ParamsError(f"{where}.{key} is not a known parameter (known: {', '.join(sorted(fields))})")
            sub = [t for t in (hints[key], *typing.get_args(hints[key]))
                   if isinstance(t, type) and issubclass(t, Section)]
            if isinstance(value, dict) and sub:
                sub[0].check_keys(value, f"{where}.{key}")

    @classmethod
    def load(cls: type[T], path: str | Path, section: str) -> T:
        path = Path(path)
        if not path.is_file():
            raise ParamsError(f"{path}: params file not found")
        doc = read_yaml(path)
        cur: Any = doc
        for part in section.split("."):
            if not isinstance(cur, dict) or part not in cur:
                raise ParamsError(f"{path}: section '{section}' is missing")
            cur = cur[part]
        if not isinstance(cur, dict):
            raise ParamsError(f"{path}: section '{section}' must be a mapping, got {type(cur).__name__}")
        return cls.from_dict(cur, src=str(path), prefix=section + ".")

    def to_dict(self) -> dict[str, Any]:
        return _plain(dataclasses.asdict(self))

    def identity_dict(self) -> dict[str, Any]:
        """``to_dict`` without the ``EXECUTION_KEYS``: what decides whether a checkpoint can be resumed."""
        return {k: v for k, v in self.to_dict().items() if k not in self.EXECUTION_KEYS}

    def replace(self: T, **changes: Any) -> T:
        obj = dataclasses.replace(self, **changes)
        obj.validate()
        return obj


def _plain(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    return x


def _coerce(tp: Any, value: Any, src: str, field: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is typing.Union or (origin is not None and str(origin) == "<class 'types.UnionType'>"):
        if value is None and type(None) in args:
            return None
        non_none = [a for a in args if a is not type(None)]
        last: Exception | None = None
        for a in non_none:
            try:
                return _coerce(a, value, src, field)
            except ParamsError as e:
                last = e
        raise last or ParamsError(f"{_where(src, field)}: bad value {value!r}")
    if isinstance(tp, type) and issubclass(tp, Section):
        if not isinstance(value, dict):
            raise ParamsError(f"{_where(src, field)} must be a mapping, got {value!r}")
        return tp.from_dict(value, src=src, prefix=field + ".")
    if origin in (tuple, list):
        if not isinstance(value, (list, tuple)):
            raise ParamsError(f"{_where(src, field)} must be a list, got {value!r}")
        inner = args[0] if args else Any
        return tuple(_coerce(inner, v, src, f"{field}[{i}]") for i, v in enumerate(value))
    if origin is dict:
        if not isinstance(value, dict):
            raise ParamsError(f"{_where(src, field)} must be a mapping, got {value!r}")
        return dict(value)
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise ParamsError(f"{_where(src, field)} must be a number, got {value!r}")
        try:
            out = float(value)
        except ValueError:
            raise ParamsError(f"{_where(src, field)} must be a number, got {value!r}") from None
        if not math.isfinite(out):
            raise ParamsError(f"{_where(src, field)} must be a finite number, got {value!r}")
        return out
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ParamsError(f"{_where(src, field)} must be an integer, got {value!r}")
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ParamsError(f"{_where(src, field)} must be true or false, got {value!r}")
        return value
    if tp is str:
        if not isinstance(value, str):
            raise ParamsError(f"{_where(src, field)} must be a string, got {value!r}")
        return value
    return value


# -- small validation helpers used by section classes -------------------------------------
def require(cond: bool, msg: str) -> None:
    """Raise ``ValueError(msg)`` unless ``cond``. Use in ``validate()``; never ``assert``."""
    if not cond:
        raise UserError(msg)


def device_name(name: str, value: Any) -> None:
    """A device param: ``auto`` (CUDA when there is one), ``cpu``, ``cuda`` or ``cuda:N``."""
    import re

    ok = isinstance(value, str) and re.fullmatch(r"auto|cpu|cuda(:\d+)?", value) is not None
    require(ok, f"{name} must be auto, cpu, cuda or cuda:N; got {value!r}")


def resolve_device(name: str, field: str) -> Any:
    """The ``torch.device`` of a device param (see :func:`device_name`); ``field`` (e.g. ``cache.device``) names it
    when it asks for CUDA on a machine without."""
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"{field}: {name!r}, but no CUDA device is available here; set it to auto or cpu")
    return torch.device(name)


def one_of(name: str, value: Any, choices: typing.Iterable[Any]) -> None:
    choices = tuple(choices)
    if value not in choices:
        raise UserError(f"{name} must be one of {', '.join(map(str, choices))}; got {value!r}")


def positive(name: str, value: float) -> None:
    if not value > 0:
        raise UserError(f"{name} must be > 0; got {value!r}")


def non_negative(name: str, value: float) -> None:
    if not value >= 0:
        raise UserError(f"{name} must be >= 0; got {value!r}")

"""One form for every entry point's options: ``options=SomeOptions(...)`` or the same
fields as keywords, never both (watch, scan, patch)."""

from __future__ import annotations

from typing import Any, TypeVar

from fp16lens._core.errors import OptionError

T = TypeVar("T")


def one_form(
    cls: type[T], options: T | None, fields: dict[str, Any], error: type[Exception] = OptionError
) -> T:
    """``options`` itself, or ``cls(**fields)``; ``error`` (one line naming the fix) when
    both are given or a keyword is not one of ``cls``'s fields."""
    if options is not None:
        if fields:
            raise error(f"pass either options={cls.__name__}(...) or keyword options, not both")
        return options
    try:
        return cls(**fields)
    except TypeError as exc:
        raise error(
            f"{exc}; the options are the fields of {cls.__module__.split('._')[0]}.{cls.__name__}"
        ) from None


def given(**keywords: Any) -> dict[str, Any]:
    """The keywords a caller gave: those not left at None (an entry point whose keyword
    options default to None passes them all; ``one_form`` then sees only the given ones)."""
    return {k: v for k, v in keywords.items() if v is not None}

"""The one error type a user can fix: bad config, model path or data.

The CLI turns it into one line on stderr and exit status 2; every other exception is a bug and keeps
its traceback.
"""

import math
from collections.abc import Mapping, Sequence


class QftError(Exception):
    """A user-fixable problem, named by the config key it concerns."""

    def __init__(self, key: str, value, allowed: str):
        allowed = " ".join(str(allowed).split())  # a wrapped library message may run over several lines: one line
        self.key, self.value, self.allowed = key, value, allowed
        super().__init__(f"{key}={value!r}: {allowed}")


def one_of(key: str, value, allowed) -> None:
    """Raise QftError naming `key` unless `value` is one of `allowed`."""
    if value not in allowed:
        raise QftError(key, value, f"allowed: {', '.join(map(str, allowed))}")


def integer(key: str, value, low: int | None = None, high: int | None = None, what: str | None = None,
            null: bool = False) -> None:
    """Raise QftError naming `key` unless `value` is an integer (not a bool) in [`low`, `high`]; `null` also allows
    None; `what` replaces the default wording."""
    if null and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or (low is not None and value < low) \
            or (high is not None and value > high):
        bounds = f" from {low} to {high}" if low is not None and high is not None else \
            f" >= {low}" if low is not None else ""
        raise QftError(key, value, what or f"an integer{bounds}" + (", or null" if null else ""))


def number(key: str, value, above: float | None = None, at_least: float | None = None, what: str | None = None,
           null: bool = False, infinite: bool = False, below: float | None = None) -> None:
    """Raise QftError naming `key` unless `value` is a finite real number (not a bool) > `above` or >= `at_least`,
    and < `below`; `null` also allows None, `infinite` +inf; `what` replaces the default wording."""
    if null and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (isinstance(value, float) and (
            math.isnan(value) or (math.isinf(value) and not (infinite and value > 0)))) \
            or (above is not None and not value > above) or (at_least is not None and not value >= at_least) \
            or (below is not None and not value < below):
        bound = (f" > {above}" if above is not None else f" >= {at_least}" if at_least is not None else "") \
            + (f" and < {below}" if below is not None else "")
        raise QftError(key, value, what or f"a finite number{bound}" + (", or null" if null else ""))


def boolean(key: str, value) -> None:
    """Raise QftError naming `key` unless `value` is true or false, never a string: Hydra reads `no` as the text 'no',
    which Python takes for true."""
    if not isinstance(value, bool):
        raise QftError(key, value, "true or false")


def text(key: str, value, what: str = "a non-empty string", null: bool = False) -> None:
    """Raise QftError naming `key` (saying `what` is allowed) unless `value` is a non-empty string; `null` also
    allows None and the empty string, both meaning unset."""
    if not (null and value in (None, "")) and not (isinstance(value, str) and value.strip()):
        raise QftError(key, value, what + (", or null" if null else ""))


def mapping(key: str, value, what: str, null: bool = False) -> None:
    """Raise QftError naming `key` (saying `what` is allowed) unless `value` is a mapping; `null` also allows None."""
    if not (null and value is None) and not isinstance(value, Mapping):
        raise QftError(key, value, what + (", or null" if null else ""))


def listing(key: str, value, what: str) -> None:
    """Raise QftError naming `key` (saying `what` is allowed) unless `value` is a list (ListConfig included), not a
    string, which would be walked letter by letter."""
    if isinstance(value, str) or not isinstance(value, Sequence):
        raise QftError(key, value, what)


def integers(key: str, value, low: int, what: str) -> None:
    """Raise QftError naming `key` (saying `what` is allowed) unless `value` is a list of integers >= `low`."""
    listing(key, value, what)
    for item in value:
        integer(key, item, low, what=what)


def fail(prog: str, e: QftError) -> int:
    """Print QftError `e` as one line on stderr after `prog`'s name; returns 2, the exit status of bad input."""
    import sys

    print(f"{prog}: error: {e}", file=sys.stderr)
    return 2

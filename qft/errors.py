"""The one error type a user can fix: bad config, model path or data.

The CLI turns it into one line on stderr and exit status 2; every other exception is a bug and keeps
its traceback.
"""


class QftError(Exception):
    """A user-fixable problem, named by the config key it concerns."""

    def __init__(self, key: str, value, allowed: str):
        allowed = " ".join(str(allowed).split())  # a wrapped library message may run over several lines: one line
        self.key, self.value, self.allowed = key, value, allowed
        super().__init__(f"{key}={value!r}: {allowed}")


def one_of(key: str, value, allowed) -> None:
    """The commonest check: a value from a fixed list, named in the error."""
    if value not in allowed:
        raise QftError(key, value, f"allowed: {', '.join(map(str, allowed))}")

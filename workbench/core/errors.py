"""User-facing errors.

A `UserError` is a mistake the user can fix (config, data, environment). The CLI prints it as
one line, `error: <message>`, and exits with status 2 — no traceback. Everything else is a bug
and keeps its traceback.
"""


class UserError(Exception):
    """A problem in the user's config, data or environment, explained in one line."""


def missing_package(package: str, extra: str | None = None) -> UserError:
    """The error for an optional dependency that is not installed, with the install hint."""
    hint = f"pip install -e '.[{extra}]'" if extra else f"pip install {package}"
    return UserError(f"the optional package '{package}' is not installed; install it with: {hint}")

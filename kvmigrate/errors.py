"""Typed library errors, mapped to the exit-code bits of interface.md §4 at the CLI edge."""

from __future__ import annotations

EXIT_CLEAN = 0
EXIT_FINDINGS = 1
EXIT_USAGE = 2
EXIT_INTEGRITY = 4
EXIT_OPERATIONAL = 8
EXIT_INTERRUPTED = 32


class KvMigrateError(Exception):
    """Base class: every library error carries the exit code the CLI should use."""

    exit_code = EXIT_OPERATIONAL

    def __init__(self, message: str, *, path: str | None = None, hint: str | None = None):
        self.path = path
        self.hint = hint
        full = message
        if path is not None and path not in message:
            full = f"{path}: {message}"
        if hint:
            full = f"{full}\n  hint: {hint}"
        super().__init__(full)


class UsageError(KvMigrateError):
    """Bad option or missing deployment fact (exit 2)."""

    exit_code = EXIT_USAGE


class MissingFactError(UsageError):
    """A deployment fact needed to compute a target identity is unknown."""

    def __init__(self, fact: str, flag: str, why: str, *, path: str | None = None):
        self.fact = fact
        self.flag = flag
        super().__init__(
            f"missing deployment fact '{fact}': {why}",
            path=path,
            hint=f"pass {flag} (or '{fact}' for this namespace in --facts FACTS.json)",
        )


class IntegrityError(KvMigrateError):
    """Data does not match what it claims (exit 4)."""

    exit_code = EXIT_INTEGRITY


class OperationalError(KvMigrateError):
    """I/O, permission, space, lock or filesystem problem (exit 8)."""

    exit_code = EXIT_OPERATIONAL

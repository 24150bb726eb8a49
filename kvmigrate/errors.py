"""Typed library errors, mapped to the exit-code bits of interface.md §4 at the CLI edge."""

from __future__ import annotations

import errno

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


class FactsRefusedError(UsageError):
    """Stated facts refused for a namespace (a model config or a kind meant for other
    models): `flag` is the flag that stated them, None when FACTS.json did."""

    def __init__(self, message: str, flag: str | None):
        self.flag = flag
        super().__init__(message)


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


# what an errno means for a write, in words (messages of every command that writes)
OS_WHAT = {errno.ENOSPC: "no space left on device", errno.EDQUOT: "disk quota exceeded",
           errno.EACCES: "permission denied", errno.EPERM: "operation not permitted",
           errno.EROFS: "read-only filesystem", errno.EXDEV: "destination is on another filesystem",
           errno.EMLINK: "too many hard links to the source file", errno.EIO: "I/O error"}


def write_error(exc: OSError, doing: str, path: str, *, elsewhere: str | None = None,
                read_only: str | None = None) -> OperationalError:
    """An OSError of a write at `path` as the operational error (exit 8) it is, with a
    hint that fits its errno: a read-only filesystem is remounted read-write (or
    `read_only`, the whole hint where the caller knows better), a permission error needs
    a user who may write there, a full one space; else `elsewhere` (where else to write:
    "pass --history DIR on a writable filesystem")."""
    code = exc.errno or 0
    what = OS_WHAT.get(code, exc.strerror or str(exc))
    alt = f", or {elsewhere}" if elsewhere else ""
    hint = {errno.EROFS: read_only or f"the filesystem is read-only: remount it read-write{alt}",
            errno.EACCES: f"run as a user who may write there{alt}",
            errno.EPERM: f"run as a user who may write there{alt}",
            errno.ENOSPC: f"free space there{alt}",
            errno.EDQUOT: f"raise the quota or free space there{alt}"}.get(code, f"fix the cause{alt}")
    return OperationalError(f"{doing}: {what}", path=path, hint=hint)

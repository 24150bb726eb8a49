"""`audit`: scan a root into a manifest and summarize it, in one call (for cron).

The manifest goes to `manifest_out` when given (the hints then point at it), else to a
private temporary directory outside the cache root that is removed afterwards: an audit
never writes into the tree it inspects.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from typing import Any

from kvmigrate.identity.values import DEFAULT_PROFILE


@dataclass
class AuditResult:
    summary: dict[str, Any]
    exit_code: int
    manifest: str | None  # None when the manifest was temporary


def audit(root: str | os.PathLike[str], *, manifest_out: str | os.PathLike[str] | None = None,
          target: str = DEFAULT_PROFILE, facts_resolver: Any = None, verify: str = "size",
          threads: int | None = None, shard: tuple[int, int] = (0, 1), progress: bool = False,
          command: str | None = None) -> AuditResult:
    """Scan ROOT (kvmigrate.scan.scan) and return the report summary and the exit code
    (OR of the states' bits, +8 when the walk failed)."""
    from kvmigrate.report.summary import summarize
    from kvmigrate.scan import scan

    kwargs = dict(target=target, facts_resolver=facts_resolver, verify=verify, threads=threads, shard=shard,
                  progress=progress, command=command)
    if manifest_out is not None:
        result = scan(root, manifest_out, **kwargs)
        summary = summarize(result.output, verb="audit")
        return AuditResult(summary, summary["exit_code"] | result.exit_code, str(result.output))
    tmp = tempfile.mkdtemp(prefix="kvmigrate-audit-")
    try:
        result = scan(root, os.path.join(tmp, "manifest.parquet"), **kwargs)
        summary = summarize(result.output, manifest=None, verb="audit")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return AuditResult(summary, summary["exit_code"] | result.exit_code, None)

"""`audit --prometheus FILE`: the audit as node_exporter textfile-collector gauges, and
`--log-format json`: the audit as one JSON object per event, for log pipelines.

Metric names follow the Prometheus conventions (a `kvmigrate_` prefix, base units:
bytes, seconds; `_total` only on counters, and these are all gauges: each audit states
the tree as it is). Label values are escaped as the text format asks (backslash, double
quote, newline)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from kvmigrate.classify import STATUS_BITS

if TYPE_CHECKING:  # the JSON models are types only (kvmigrate.outputs)
    from kvmigrate.outputs import ReportOutput

# the finding classes of the exit bits (interface.md §4)
CLASSES = (("integrity", 4), ("operational", 8), ("finding", 1))


def _label(value: Any) -> str:
    return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _labels(**labels: Any) -> str:
    if not labels:
        return ""
    return "{" + ",".join(f'{k}="{_label(v)}"' for k, v in labels.items()) + "}"


def finding_class(status: str) -> str | None:
    """integrity / operational / finding for a status with exit bits, None for a clean one."""
    bits = STATUS_BITS.get(status, 1)
    for name, bit in CLASSES:
        if bits & bit:
            return name
    return None


def textfile(summary: ReportOutput, *, seconds: float, carried: int, now: float | None = None,
             previous: str | None = None) -> str:
    """The textfile of one audit: gauges per namespace x status and x action, pending and
    not-reusable ("reclaimable") blocks and bytes, findings by class, the run's duration,
    rows carried over from the baseline vs read, the exit code and its bits, and
    kvmigrate_last_success_timestamp_seconds: now when the audit finished without an
    operational error (exit bit 8: an empty or unmounted root is one), else the value the
    `previous` textfile holds for the root (none: left out), so an alert on its age fires
    instead of losing its series."""
    now = time.time() if now is None else now
    metrics: dict[str, tuple[str, list[str]]] = {}

    def gauge(name: str, help_text: str, value: float, **labels: Any) -> None:
        entry = metrics.setdefault(name, (help_text, []))
        entry[1].append(f"kvmigrate_{name}{_labels(**labels)} {_number(value)}")

    root = summary.get("root") or ""
    for ns in summary.get("namespaces", []):
        base = ns["source_base"]
        for status, c in sorted(ns["by_status"].items()):
            gauge("files", "Files by namespace and status.", c["files"], root=root, namespace=base, status=status)
            gauge("bytes", "Bytes by namespace and status.", c["bytes"], root=root, namespace=base, status=status)
        for action, a in sorted(ns["by_action"].items()):
            gauge("action_blocks", "Blocks by namespace and planned action.", a["blocks"], root=root,
                  namespace=base, action=action)
            gauge("action_bytes", "Bytes of blocks by namespace and planned action.", a["bytes"], root=root,
                  namespace=base, action=action)
        gauge("pending_blocks", "Reusable blocks not yet in their target namespace.", ns["pending"]["blocks"],
              root=root, namespace=base)
        gauge("pending_bytes", "Bytes of reusable blocks not yet in their target namespace.",
              ns["pending"]["bytes"], root=root, namespace=base)
        gauge("reclaimable_bytes", "Bytes of blocks that are never reused (not reusable).",
              ns["not_reusable"]["bytes"], root=root, namespace=base)
    outside = summary["outside_namespaces"]
    for status, c in sorted((outside["by_status"] if outside else {}).items()):
        gauge("files", "Files by namespace and status.", c["files"], root=root, namespace="", status=status)
        gauge("bytes", "Bytes by namespace and status.", c["bytes"], root=root, namespace="", status=status)
    by_class = {name: 0 for name, _ in CLASSES}
    for status, c in summary["totals"]["by_status"].items():
        cls = finding_class(status)
        if cls is not None:
            by_class[cls] += c["files"]
    for cls, n in by_class.items():
        gauge("findings", "Files with a finding, by class of its exit bit.", n, root=root, **{"class": cls})
    files = summary["totals"]["files"]
    gauge("audit_duration_seconds", "Wall time of the audit's scan.", seconds, root=root)
    gauge("rows", "Manifest rows: carried over from the --baseline unopened, or read.", carried, root=root,
          source="carried")
    gauge("rows", "Manifest rows: carried over from the --baseline unopened, or read.", files - carried, root=root,
          source="read")
    code = summary["exit_code"]
    gauge("exit_code", "The audit's exit code (OR of the bits).", code, root=root)
    for name, bit in (("findings", 1), ("integrity", 4), ("operational", 8)):
        gauge("exit_bit", "Whether each exit-code bit is set.", 1 if code & bit else 0, root=root, bit=name)
    last_success = now if not code & 8 else _last_success(previous, root)
    if last_success is not None:
        gauge("last_success_timestamp_seconds", "When an audit last finished without an operational error.",
              last_success, root=root)
    lines = []
    for name, (help_text, samples) in metrics.items():
        lines += [f"# HELP kvmigrate_{name} {help_text}", f"# TYPE kvmigrate_{name} gauge", *samples]
    return "\n".join(lines) + "\n"


def previous_textfile(path: str) -> str | None:
    """The textfile an earlier audit wrote at `path`, if one can be read."""
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError):
        return None


def _last_success(previous: str | None, root: str) -> float | None:
    """The root's kvmigrate_last_success_timestamp_seconds in an earlier textfile."""
    prefix = f"kvmigrate_last_success_timestamp_seconds{_labels(root=root)} "
    for line in (previous or "").splitlines():
        if line.startswith(prefix):
            try:
                return float(line[len(prefix):])
            except ValueError:
                return None
    return None


def _number(v: float) -> str:
    return repr(float(v)) if isinstance(v, float) else str(int(v))


def events(summary: ReportOutput, *, seconds: float, carried: int) -> Iterator[dict[str, Any]]:
    """The audit's end events for --log-format json (the start event is the CLI's): one
    per namespace, one for the finding classes, one at the end."""
    root = summary.get("root")
    for ns in summary.get("namespaces", []):
        yield {"event": "namespace", "root": root, "namespace": ns["source_base"], "family": ns.get("family"),
               "status": ns.get("status"), "files": ns["files"], "bytes": ns["bytes"], "blocks": ns["blocks"],
               "by_status": {s: c["files"] for s, c in ns["by_status"].items()},
               "by_action": {a: c["blocks"] for a, c in ns["by_action"].items()},
               "pending_blocks": ns["pending"]["blocks"]}
    by_class: dict[str, dict[str, int]] = {name: {} for name, _ in CLASSES}
    for status, c in summary["totals"]["by_status"].items():
        cls = finding_class(status)
        if cls is not None:
            by_class[cls][status] = c["files"]
    yield {"event": "findings", "root": root, **by_class}
    yield {"event": "end", "root": root, "exit_code": summary["exit_code"], "seconds": round(seconds, 3),
           "files": summary["totals"]["files"], "bytes": summary["totals"]["bytes"], "carried": carried,
           "read": summary["totals"]["files"] - carried}


def log_line(event: dict[str, Any]) -> str:
    return json.dumps({"ts": round(time.time(), 3), **event}, sort_keys=False, default=str)

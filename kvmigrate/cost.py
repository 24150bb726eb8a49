"""What transforms cost: bytes to write, an estimated time, and the space saved or spent.

The time is an estimate from one documented constant, never a promise. Measured on the
development VM (reports/TRANSFORMS.md, scripts/bench_transforms.py): file to file with a
warm page cache transforms write 0.9-1.9 GB/s (cp of the same bytes: 1.6-3.4 GB/s); with
the fsync every migrated block gets, 0.3-0.85 GB/s, as fast as cp + fsync. The disk sets
the pace, so plans assume 500 MB/s of output: a fast NVMe disk beats it, a network
filesystem or a cold HDD does not.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from kvmigrate.units import plural

if TYPE_CHECKING:
    from kvmigrate.outputs import TransformCost

TRANSFORMS = ("slice", "concat", "relayout", "reshard")
# The bytes a transform writes per block are the manifest's `output_bytes` column (the
# finding classify gives its row): reports, which only have the manifest, read it there.
TRANSFORM_BYTES_PER_SECOND = 500 * 10**6
"""Assumed output rate of a transform on disk (see above and reports/TRANSFORMS.md)."""


def transform_cost(action: str, blocks: int, source_bytes: int, output_bytes: int) -> dict[str, int | float]:
    """Cost of `blocks` blocks of one transform. `source_bytes`: the legacy files they
    read (every rank); `output_bytes`: the new rows. A slice keeps 1/N of its rows, so it
    saves space against the legacy layout; concat and relayout add a new copy."""
    cost: dict[str, int | float] = {
        "blocks": blocks, "source_bytes": source_bytes, "output_bytes": output_bytes,
        "seconds_estimate": round(output_bytes / TRANSFORM_BYTES_PER_SECOND, 3),
    }
    if action == "slice":
        cost["saves_bytes"] = max(0, source_bytes - output_bytes)
    else:
        cost["new_bytes"] = output_bytes
    return cost


def human_seconds(seconds: float) -> str:
    if seconds < 0.1:
        return "under 0.1 s"
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def cost_line(action: str, cost: dict, fmt_bytes: Callable[[int], str]) -> str:
    """One sentence for reports and the dry run."""
    rate = TRANSFORM_BYTES_PER_SECOND // 10**6
    text = (f"{action}: {plural(cost['blocks'], 'block')}, writes {fmt_bytes(int(cost['output_bytes']))} "
            f"(est. {human_seconds(float(cost['seconds_estimate']))} at an assumed {rate} MB/s)")
    if "saves_bytes" in cost:
        return text + f"; saves {fmt_bytes(int(cost['saves_bytes']))} against the legacy rows (once those are removed)"
    return text + f"; costs {fmt_bytes(int(cost['new_bytes']))} of new space (the legacy files stay)"

def transform_cost_of(cost: Mapping[str, int | float]) -> TransformCost:
    """kvmigrate.cost.transform_cost's dict as the model (the same keys, in its order)."""
    out: TransformCost = {"blocks": int(cost["blocks"]), "source_bytes": int(cost["source_bytes"]),
                          "output_bytes": int(cost["output_bytes"]), "seconds_estimate": float(cost["seconds_estimate"])}
    if "saves_bytes" in cost:
        out["saves_bytes"] = int(cost["saves_bytes"])
    if "new_bytes" in cost:
        out["new_bytes"] = int(cost["new_bytes"])
    return out

#!/usr/bin/env python3
"""The operator's lifecycle, model-based, at campaign size (tests/lifecycle/lifecycle_model.py).

    python scripts/lifecycle_campaign.py                 # 60 roots x 40 steps -> reports/RELIABILITY.md §6
    python scripts/lifecycle_campaign.py --examples 5 --steps 10 --out /tmp/x.md   # a short one

Each example is a fresh root of three families; hypothesis draws the operator's commands
(audit, `migrate --apply` killed with SIGKILL at random crash points, reruns through
another journal, rollback with its dry run, prune, restore, purge, an engine writing and
evicting blocks, the commands audit's hints print) and the state machine checks its
invariants after every step. The figures (examples, steps, kills, invariant checks,
violations) replace section 6 of the report; a violation makes the script exit 1 and the
report shows the failing sequence.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import subprocess
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "tests" / "lifecycle"), str(REPO / "tests")]

SECTION = "## 6. The operator's lifecycle (model-based)"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--examples", type=int, default=60)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--seed", type=int, default=20261206)
    ap.add_argument("--out", default=str(REPO / "reports" / "RELIABILITY.md"))
    args = ap.parse_args()

    import lifecycle_model as model
    from hypothesis import HealthCheck, Phase, seed, settings
    from hypothesis.stateful import run_state_machine_as_test

    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    dirty = bool(subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "kvmigrate"],
                                capture_output=True, text=True).stdout.strip())
    t0 = time.monotonic()
    load0 = os.getloadavg()[0]
    failure = None
    cfg = settings(max_examples=args.examples, stateful_step_count=args.steps, deadline=None, database=None,
                   suppress_health_check=list(HealthCheck), phases=(Phase.explicit, Phase.generate, Phase.shrink))
    try:
        seed(args.seed)(lambda: run_state_machine_as_test(model.Lifecycle, settings=cfg))()
    except Exception:  # a violated invariant: the report shows the sequence hypothesis found
        failure = traceback.format_exc(limit=3)[-4000:]
    seconds = time.monotonic() - t0
    stats = dict(model.STATS)
    figures = {"examples": args.examples, "steps_per_example": args.steps, "commands": stats["steps"],
               "sigkills": stats["kills"], "hint_commands_run": stats["hints_run"],
               "invariant_checks": stats["invariant_checks"], "violations": 0 if failure is None else 1,
               "seconds": round(seconds), "seed": args.seed, "commit": commit + ("+dirty" if dirty else ""),
               "load_average": [round(load0, 2), round(os.getloadavg()[0], 2)]}
    now = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [SECTION, "",
             f"Run {now} on {platform.processor() or platform.machine()} ({os.cpu_count()} cores), Python "
             f"{platform.python_version()}; kvmigrate at {figures['commit']}; seed {args.seed}; "
             f"{seconds / 60:.1f} min; 1-minute load average {figures['load_average'][0]} at the start, "
             f"{figures['load_average'][1]} at the end. Regenerate: `python scripts/lifecycle_campaign.py`; the "
             "CI-sized run is `tests/lifecycle/test_lifecycle_model.py`; the rules and invariants are in "
             "`tests/lifecycle/lifecycle_model.py`.", "",
             "| figure | value |", "|---|---|",
             f"| roots (hypothesis examples) x steps | {args.examples} x {args.steps} |",
             f"| kvmigrate commands run | {stats['steps']} |",
             f"| SIGKILLs landed in `migrate --apply` | {stats['kills']} |",
             f"| commands printed by audit's hints, run as printed | {stats['hints_run']} |",
             f"| invariant checks | {stats['invariant_checks']} |",
             f"| **violations** | **{figures['violations']}** |", ""]
    if failure:
        lines += ["The failing sequence:", "", "```", failure.rstrip(), "```", ""]
    out = Path(args.out)
    text = out.read_text() if out.exists() else ""
    if SECTION in text:
        head, _, rest = text.partition(SECTION)
        tail = rest[rest.find("\n## ") + 1:] if "\n## " in rest else ""
        text = head + "\n".join(lines) + ("\n" + tail if tail else "")
    else:
        text = text.rstrip("\n") + "\n\n" + "\n".join(lines)
    out.write_text(text)
    (out.parent / "lifecycle.json").write_text(json.dumps(figures, indent=2) + "\n")
    print(json.dumps(figures))
    return 1 if failure else 0


if __name__ == "__main__":
    sys.exit(main())

"""Other revisions of kvmigrate to time against: a git worktree with its own venv (the
journal group's --journal-before) and the --before installs by commit."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from .harness import REPO, capture, rmtree, tail


def before_kvmigrate(rev: str, workdir: Path, log: Any) -> tuple[str, str]:
    """(kvmigrate executable, commit) of REV: a detached git worktree of it under the
    workdir with its own venv (`pip install -e .`, reused by the next run)."""
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", rev], capture_output=True, text=True,
                            check=True).stdout.strip()
    wt = workdir / f"before-{commit[:12]}"
    exe = wt / ".venv" / "bin" / "kvmigrate"
    if not exe.exists():
        log(f"journal: building {rev} ({commit[:12]}) in {wt}")
        if not wt.exists():
            subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(wt), commit], check=True,
                           capture_output=True)
        subprocess.run([sys.executable, "-m", "venv", str(wt / ".venv")], check=True)
        subprocess.run([str(wt / ".venv" / "bin" / "pip"), "install", "-q", "-e", str(wt)], check=True,
                       capture_output=True)
    return str(exe), commit


def git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True,
                          check=True).stdout.strip()


def resolve(rev: str) -> dict:
    try:
        sha = git("rev-parse", "--verify", f"{rev}^{{commit}}")
    except subprocess.CalledProcessError:
        sys.exit(f"bench: {rev!r} is not a commit of {REPO} (git rev-parse); give a commit, tag or branch")
    return {"rev": rev, "commit": sha, "subject": git("log", "-1", "--format=%h %s", sha)[:160],
            "date": git("log", "-1", "--format=%cI", sha)}


def install(side: dict, cache: Path, log: Any) -> str:
    """kvmigrate of one commit in its own venv (cached by commit); exits naming the log
    when pip fails or the C leaf walk was not built (an optional extension: pip succeeds
    without it, and the Python walk would be timed instead)."""
    dest = cache / side["commit"]
    exe = dest / "venv" / "bin" / "kvmigrate"
    stamp = dest / "installed.json"
    if stamp.is_file() and exe.exists():
        side.update(json.loads(stamp.read_text()), reused=True)
        log(f"install {side['commit'][:12]}: reusing {dest}")
        return str(exe)
    rmtree(dest)
    src = dest / "src"
    src.mkdir(parents=True)
    start = time.perf_counter()
    archive = subprocess.Popen(["git", "-C", str(REPO), "archive", "--format=tar", side["commit"]],
                               stdout=subprocess.PIPE)
    subprocess.run(["tar", "-x", "-C", str(src)], stdin=archive.stdout, check=True)
    if archive.wait() != 0:
        sys.exit(f"bench: git archive {side['commit']} failed")
    subprocess.run([sys.executable, "-m", "venv", str(dest / "venv")], check=True)
    pip_log = dest / "pip.log"
    log(f"install {side['commit'][:12]}: pip install {src} (log {pip_log})")
    with open(pip_log, "wb") as f:
        rc = subprocess.run([str(dest / "venv" / "bin" / "pip"), "install", str(src)], stdout=f,
                            stderr=subprocess.STDOUT).returncode
    if rc != 0:
        sys.exit(f"bench: pip install of {side['commit'][:12]} failed (exit {rc}): {tail(pip_log)}")
    py = str(dest / "venv" / "bin" / "python")
    probe = subprocess.run([py, "-I", "-c", "import kvmigrate, kvmigrate._leafwalk as w; print(w.__file__)"],
                           capture_output=True, text=True, cwd="/")
    if probe.returncode != 0:
        sys.exit(f"bench: {side['commit'][:12]} installed without its C leaf walk (kvmigrate._leafwalk): "
                 f"{(probe.stderr.strip().splitlines() or ['?'])[-1]}; see {pip_log} (a C compiler and the "
                 "Python headers are needed: apt-get install -y gcc python3-dev)")
    facts = {"install_dir": str(dest), "install_s": round(time.perf_counter() - start, 1),
             "leaf_walk": Path(probe.stdout.strip()).name,
             "python": capture([py, "-c", "import sys; print(sys.version.split()[0])"])}
    stamp.write_text(json.dumps(facts, indent=1))
    side.update(facts, reused=False)
    log(f"install {side['commit'][:12]}: done in {facts['install_s']} s ({facts['leaf_walk']})")
    return str(exe)

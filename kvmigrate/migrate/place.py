"""Placing a block at its target path, the no-clobber way (migration.md §3): a hard
link, or a new file (copy, padded copy, header rewrite, transform) written to a temp
next to the final name, fsynced and published by link(); a name already taken is
compared, never overwritten (already_present or conflict). The action kinds
(`actions.py`) call these primitives."""

from __future__ import annotations

import errno
import os
import stat
from typing import TYPE_CHECKING, Any

import xxhash

from kvmigrate import layout, pacing
from kvmigrate.errors import EXIT_INTEGRITY, EXIT_OPERATIONAL, OperationalError
from kvmigrate.formats import checksum
from kvmigrate.fsio import open_noatime
from kvmigrate.migrate.fsops import CHUNK
from kvmigrate.migrate.outputs import (
    HashingWriter,
    SourceInvalid,
    TransformSpec,
    output_chunks,
    output_hash,
    transform_output_hash,
    write_transform,
)
from kvmigrate.migrate.reconcile import tmp_name, unlink_quiet
from kvmigrate.migrate.result import Stop, oserror_stop
from kvmigrate.migrate.sources import stat_differs
from kvmigrate.transforms import TransformError

if TYPE_CHECKING:
    from kvmigrate.migrate.model import BlockAction, TargetPlan
    from kvmigrate.migrate.sources import SourceChecks
    from kvmigrate.migrate.state import ApplyState


class Placer:
    """Places blocks and config.json files for one run: the primitives an action kind
    executes through (`actions.Placing`: `link`, `copy`, `transform`). It writes only
    through the run's tree and journal and counts into its result (`state`); the sources
    of a transform are opened and checked by the run's `SourceChecks` (`sources`), the
    same checks as every other block's."""

    def __init__(self, state: ApplyState, sources: SourceChecks) -> None:
        self.tree = state.tree
        self.journal = state.journal
        self.result = state.result
        self.crash = state.crash
        self.mode = state.mode
        self.outcome = state.outcome
        self.src_abs = state.src_abs
        self.sources = sources

    def place_config(self, tp: TargetPlan) -> str | None:
        """Write the target config.json (byte-exact) unless one exists; an existing one
        must describe the same identity. Returns a problem message or None."""
        rel = f"{tp.base_name}/{layout.CONFIG_NAME}"
        want = tp.config_bytes
        problem = self._existing_config_problem(tp, rel)
        if problem != "absent":
            return problem
        tmp = tmp_name(rel)
        self.journal.intent([{"kind": "config", "path": rel, "tmp": tmp,
                              "xxh3_128": xxhash.xxh3_128(want).hexdigest()}])
        try:
            ino = self._write_new(tmp, [want])
            try:
                self.tree.link_local(tmp, rel)
            except FileExistsError:
                unlink_quiet(self.tree, tmp)
                problem = self._existing_config_problem(tp, rel)
                return None if problem == "absent" else problem
            unlink_quiet(self.tree, tmp)
        except OSError as exc:
            unlink_quiet(self.tree, tmp)
            raise oserror_stop(exc, self.tree.abspath(rel), "writing config.json") from None
        self.tree.fsync_dir(tp.base_name)
        self.journal.done({"kind": "config", "path": rel, "ino": ino, "size": len(want),
                           "xxh3_128": xxhash.xxh3_128(want).hexdigest()})
        self.journal.sync()
        return None

    def _existing_config_problem(self, tp: TargetPlan, rel: str) -> str | None:
        st = self.tree.lstat(rel)
        if st is None:
            return "absent"
        where = self.tree.abspath(rel)
        if not stat.S_ISREG(st.st_mode):
            return f"{where} exists and is not a regular file; not touching namespace {tp.base_name}"
        try:
            data = self.tree.read_bytes(rel, limit=1 << 22)
        except OSError as exc:
            raise oserror_stop(exc, where, "reading the existing config.json") from None
        if tp.fam.config_matches(data, tp.fields):  # as the engine compares it (bytes or fields)
            return None
        return (f"{where} exists and describes a different identity than the target; no block of {tp.base_name} "
                "was written (never overwritten: move it aside if it is stale, then rerun)")

    def link(self, tp: TargetPlan, act: BlockAction, src_hash: bytes | None) -> None:
        target = act.target_relpath
        src_abs = self.src_abs(act.source.relpath)
        try:
            self.tree.link_in(src_abs, target)
        except FileExistsError:
            return self._compare_existing(tp, act, "link", None)
        except FileNotFoundError:
            return self.outcome(tp, act, "changed_since_scan", "source vanished since the scan")
        except OSError as exc:
            if exc.errno in (errno.EXDEV, errno.EMLINK) and self.mode == "auto":
                return self.copy(tp, act, "link", src_hash)
            if exc.errno == errno.EXDEV:
                raise Stop(OperationalError(
                    f"cannot hard-link across filesystems: {src_abs} -> {self.tree.abspath(target)}",
                    path=self.tree.abspath(target),
                    hint="use --mode copy or --mode auto; rerun the same command to resume")) from None
            if exc.errno == errno.EMLINK:
                return self.outcome(tp, act, "failed", "too many hard links to the source file; "
                                     "rerun with --mode auto to copy such blocks", bits=EXIT_OPERATIONAL)
            if exc.errno == errno.EPERM:
                # fs.protected_hardlinks: only the owner of a file (or a user who may write
                # it) may hard-link it, even into a folder this user may write
                raise Stop(OperationalError(
                    f"hard-linking a block failed: operation not permitted on {src_abs} (the kernel refuses "
                    "hard links to files this user does not own: fs.protected_hardlinks)",
                    path=self.tree.abspath(target),
                    hint="run as the user that owns the cache files, or use --mode copy; then rerun the same "
                         "command to resume")) from None
            raise oserror_stop(exc, self.tree.abspath(target), "hard-linking a block") from None
        st = self.tree.lstat(target)
        if st is None or st.st_ino != act.source.inode or st.st_dev != act.source.dev:
            # the source name was replaced between our check and link(): this fresh name
            # is ours and points at a file the scan never saw
            unlink_quiet(self.tree, target)
            return self.outcome(tp, act, "changed_since_scan", "source replaced since the scan")
        # A hard link IS the source inode: its identity (dev, inode, size, mtime) is
        # journaled, and its hash when the manifest or the replica check has it (no read
        # just for the journal; verify and rollback check mtime where no hash is recorded).
        self.journal.done_link(target, st, act.action, src_hash)
        self.result.linked += 1
        self.outcome(tp, act, "created")
        self.crash.hit("created")

    def copy(self, tp: TargetPlan, act: BlockAction, action: str, src_hash: bytes | None) -> None:
        """A new file with the action's output: temp in the final folder, fsync, then
        link() to the final name (no clobber), then unlink the temp. The bytes read must
        hash to `src_hash` (the scan's, or the one this run's check read)."""
        target = act.target_relpath
        digest = tp.digest if action == "rewrite_header" else None
        if self.tree.lstat(target) is not None:
            return self._compare_existing(tp, act, action, digest)
        tmp = tmp_name(target)
        try:
            src_fd = open_noatime(self.src_abs(act.source.relpath))
        except FileNotFoundError:
            return self.outcome(tp, act, "changed_since_scan", "source vanished since the scan")
        except OSError as exc:
            return self.outcome(tp, act, "failed", f"cannot read the source: {exc.strerror}", bits=EXIT_OPERATIONAL)
        was_cached = pacing.cached(src_fd)
        try:
            why = stat_differs(os.fstat(src_fd), act.source, bytes_checked=src_hash is not None)
            if why:
                return self.outcome(tp, act, "changed_since_scan", why)
            src_h = xxhash.xxh3_128()
            try:
                # a copy of the same bytes keeps the engine's checksum attribute; changed bytes never do
                ino, size, out_digest = self._write_new(tmp, output_chunks(src_fd, action, digest, src_h),
                                                        same_bytes_as=src_fd if action == "link" else None)
            except SourceInvalid as exc:
                unlink_quiet(self.tree, tmp)
                return self.outcome(tp, act, "failed", str(exc), bits=EXIT_INTEGRITY)
            except OSError as exc:
                unlink_quiet(self.tree, tmp)
                raise oserror_stop(exc, self.tree.abspath(target), "writing a block") from None
        finally:
            if not was_cached:
                pacing.drop_cache(src_fd)
            os.close(src_fd)
        if src_hash is not None and src_h.digest() != src_hash:
            unlink_quiet(self.tree, tmp)
            return self.outcome(tp, act, "changed_since_scan", "source content differs from the scan's hash"
                                 if act.source.content_hash is not None else "source changed while it was read")
        self._publish(tp, act, tmp, ino, size, out_digest, action, digest)

    def _publish(self, tp: TargetPlan, act: BlockAction, tmp: str, ino: int, size: int, out_digest: bytes,
                 action: str, digest: bytes | None) -> None:
        """A fsynced temp becomes the final name only if that name is free (link, never
        rename); EEXIST means compare. Then the temp goes and a done record follows."""
        target = act.target_relpath
        self.crash.hit("tmp_written")
        try:
            self.tree.link_local(tmp, target)
        except FileExistsError:
            unlink_quiet(self.tree, tmp)
            return self._compare_existing(tp, act, action, digest, expected=(size, out_digest))
        except OSError as exc:
            unlink_quiet(self.tree, tmp)
            raise oserror_stop(exc, self.tree.abspath(target), "publishing a block") from None
        self.crash.hit("linked")
        unlink_quiet(self.tree, tmp)
        self.journal.done({"kind": "block", "path": target, "ino": ino, "size": size,
                           "xxh3_128": out_digest.hex(), "how": "transform" if act.transform else "copy",
                           "action": act.action})
        self.result.copied += 1
        self.result.bytes_written += size
        if act.action == "link":
            self.result.link_copies += 1
        if act.transform is not None:
            self.result.transformed += 1
        self.outcome(tp, act, "created")
        self.crash.hit("created")

    def transform(self, tp: TargetPlan, act: BlockAction, spec: TransformSpec) -> None:
        """slice / concat / relayout into a temp file through a hashing writer (the output
        hash is known when the last byte is written), fsync, then publish like a copy."""
        target = act.target_relpath
        if self.tree.lstat(target) is not None:
            return self._compare_existing(tp, act, act.action, None)
        fds = self.sources.open_sources(tp, act)
        if fds is None:
            return
        cold = [fd for fd in fds if not pacing.cached(fd)]  # let go of once written (the check reads them too)
        tmp = tmp_name(target)
        try:
            if not self.sources.check_transform_sources(tp, act, fds):
                return
            try:
                ino, size, out_digest = self._write_transform(tmp, spec, fds)
            except (TransformError, SourceInvalid) as exc:
                unlink_quiet(self.tree, tmp)
                return self.outcome(tp, act, "failed", f"{act.action}: {exc}", bits=EXIT_INTEGRITY)
            except OSError as exc:
                unlink_quiet(self.tree, tmp)
                raise oserror_stop(exc, self.tree.abspath(target), f"writing a block ({act.action})") from None
            files = act.sources if spec.action != "slice" else (act.source,)
            for f, fd in zip(files, fds):  # a writer may have appended while we read
                why = stat_differs(os.fstat(fd), f, bytes_checked=f.content_hash is not None)
                if why:
                    unlink_quiet(self.tree, tmp)
                    return self.outcome(tp, act, "changed_since_scan", f"{f.relpath}: {why}")
        finally:
            for fd in fds:
                if fd in cold:
                    pacing.drop_cache(fd)
                os.close(fd)
        if size != spec.output_size:
            unlink_quiet(self.tree, tmp)
            return self.outcome(tp, act, "failed", f"{act.action} wrote {size} bytes, the plan says "
                                 f"{spec.output_size}", bits=EXIT_INTEGRITY)
        self._publish(tp, act, tmp, ino, size, out_digest, act.action, None)

    def _write_transform(self, tmp: str, spec: TransformSpec, fds: list[int]) -> tuple[int, int, bytes]:
        try:
            fd = self.tree.create_excl(tmp)
        except FileExistsError:
            self.tree.unlink(tmp)  # our own pid's temp name: a leftover of this process
            fd = self.tree.create_excl(tmp)
        try:
            # the crash seam "transform_write:<n>" kills after the n-th write to the temp
            # file; small writes then leave a temp that is really half-written
            seam = self.crash.point == "transform_write"
            out = HashingWriter(fd, chunk=1024 if seam else CHUNK,
                                on_flush=(lambda: self.crash.hit("transform_write")) if seam else None)
            write_transform(spec, fds, out)
            out.flush()
            os.fsync(fd)
            ino = os.fstat(fd).st_ino
        finally:
            os.close(fd)
        return ino, out.size, out.digest()

    def _transform_expected(self, tp: TargetPlan, act: BlockAction) -> tuple[int, bytes] | None:
        """(size, hash) of the row the transform would write, to compare with a file that
        is already at the target path; None: the block has its outcome."""
        fds = self.sources.open_sources(tp, act)
        if fds is None:
            return None
        try:
            spec = act.transform_spec
            if ((spec.action == "slice" or spec.replicas or spec.flat and len(act.sources) > 1)
                    and not self.sources.check_transform_sources(tp, act, fds)):
                return None
            out_digest, size = transform_output_hash(spec, fds)
        except SourceInvalid as exc:
            self.outcome(tp, act, "failed", f"{act.action}: {exc}", bits=EXIT_INTEGRITY)
            return None
        except OSError as exc:
            self.outcome(tp, act, "failed", f"cannot read the sources of {act.action}: {exc.strerror or exc}",
                          bits=EXIT_OPERATIONAL)
            return None
        finally:
            for fd in fds:
                os.close(fd)
        return size, out_digest

    def _write_new(self, tmp: str, chunks, same_bytes_as: int | None = None) -> Any:
        """Write chunks to a new file (O_EXCL; a leftover of this pid is replaced), fsync.
        `same_bytes_as`: the fd of a file with the same bytes, whose checksum attributes
        (formats/checksum.py) the new file takes. Returns inode for a bytes list, (inode,
        size, xxh3) for a generator."""
        try:
            fd = self.tree.create_excl(tmp)
        except FileExistsError:
            self.tree.unlink(tmp)  # our own pid's temp name: a leftover of this process
            fd = self.tree.create_excl(tmp)
        h = xxhash.xxh3_128()
        size = 0
        try:
            for chunk in chunks:
                pacing.charge(len(chunk))  # a copy's read bandwidth (--bwlimit)
                view = memoryview(chunk)
                while view:
                    n = os.write(fd, view)
                    view = view[n:]
                h.update(chunk)
                size += len(chunk)
            if same_bytes_as is not None:
                checksum.copy_values(same_bytes_as, fd)
            os.fsync(fd)
            ino = os.fstat(fd).st_ino
        finally:
            os.close(fd)
        if isinstance(chunks, list):
            return ino
        return ino, size, h.digest()

    def _compare_existing(self, tp: TargetPlan, act: BlockAction, action: str, digest: bytes | None,
                          expected: tuple[int, bytes] | None = None) -> None:
        """Something already sits at the target path: the same bytes -> already_present,
        anything else -> conflict (never overwritten)."""
        target = act.target_relpath
        st = self.tree.lstat(target)
        if st is None:
            return self.outcome(tp, act, "failed", "target path appeared and vanished during the run; rerun")
        if not stat.S_ISREG(st.st_mode):
            return self.outcome(tp, act, "conflict", "a non-regular file (symlink?) is in the way")
        if action == "link" and st.st_ino == act.source.inode and st.st_dev == act.source.dev:
            return self.outcome(tp, act, "already_present")
        if expected is None and act.transform is not None:
            expected = self._transform_expected(tp, act)
            if expected is None:
                return None
        if expected is None:
            try:
                fd = open_noatime(self.src_abs(act.source.relpath))
            except OSError as exc:
                return self.outcome(tp, act, "changed_since_scan", f"source cannot be read: {exc.strerror}")
            try:
                why = stat_differs(os.fstat(fd), act.source)
                if why:
                    return self.outcome(tp, act, "changed_since_scan", why)
                try:
                    out_digest, size, _ = output_hash(fd, action, digest)
                except SourceInvalid as exc:
                    return self.outcome(tp, act, "failed", str(exc), bits=EXIT_INTEGRITY)
            finally:
                os.close(fd)
            expected = (size, out_digest)
        size, out_digest = expected
        if st.st_size != size:
            return self.outcome(tp, act, "conflict", f"a different file is in the way ({st.st_size} bytes, "
                                 f"expected {size}); left untouched")
        try:
            have, _ = self.tree.hash(target)
        except OSError as exc:
            return self.outcome(tp, act, "failed", f"cannot read the existing target: {exc.strerror}",
                                 bits=EXIT_OPERATIONAL)
        if have == out_digest:
            return self.outcome(tp, act, "already_present")
        return self.outcome(tp, act, "conflict", "a file with different content is in the way; left untouched")

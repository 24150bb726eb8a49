"""Walk a cache root and write the manifest: one row per file, an action per block.

Phases (each a module of this package):

1. `list_root` (roots): the top level of ROOT: base folders, rank folders (siblings), kvmigrate's
   own files, old llm-d deep layouts, anything else (foreign).
2. `resolve_namespaces` (roots): per base folder read config.json, prove its digest against the
   folder name, detect the family (with evidence), resolve facts, compute the target.
   A missing fact fails that namespace only (`target_error`), never the scan.
3. `build_units` (units): what the walker visits side by side: a vLLM / llm-d namespace with its
   rank folders, or a vllm.cpp deployment (one namespace per rank).
4. The walk (walker, parallel), a run of `<hhh>` buckets of one unit per task (memory bounded by a task):
   scandir the bucket in every rank folder, `lstat` each file (DirEntry, no symlink
   follow) or, with --verify hash, open + fstat + read it (no lstat), read vllm.cpp
   headers, and classify (`kvmigrate.classify`; a healthy block's verdict is computed once
   per shape and replayed). The plain block files of vLLM / llm-d buckets go through the
   compiled leaf walk where it is built (`kvmigrate._leafwalk`: by file descriptor, GIL
   released); anything unusual it hands back to the Python code here, which words it.
   Rows the Python code makes go to column lists, the leaf walk's stay in C structs
   (`Rows`), one Arrow batch per task. Tasks run in worker processes (the
   rest of the walk is Python work: the GIL would serialise threads) or in this process,
   with threads for I/O concurrency; their batches are written in task order, so every
   mode writes the same manifest.
5. Sizes that must be equal within a (namespace, rank, group) are only known at the end:
   when some are odd (or the walk met errors, which the metadata records), the manifest
   is rewritten once with those blocks re-classified (`sizes.finalize`); a healthy tree is
   written once.

Files that vanish between listing and reading (a live engine's evictor, temp + rename)
are dropped: they are not there. Permission and I/O errors are findings (`unreadable`,
with errno and path). Nothing under ROOT is ever opened for writing.

Modules, in phase order: `roots` (1, 2), `units` (3), `walker` (4, per bucket; its block
verdicts in `blocks`, rows outside buckets in `toplevel`), `rows` (the row store and its Arrow table), `parallel`
(tasks, workers, threads), `sizes` (5), `run` (`scan()`: the phases in turn, the
manifest written). The block reader is `kvmigrate.fsio.read_file`.
"""

from kvmigrate.scan.roots import Namespace, RootListing, list_root, resolve_namespaces  # noqa: F401
from kvmigrate.scan.rows import Rows  # noqa: F401
from kvmigrate.scan.run import WalkResult, scan  # noqa: F401
from kvmigrate.scan.units import Member, Unit, build_units  # noqa: F401
from kvmigrate.scan.walker import Walker, leaf_walk  # noqa: F401

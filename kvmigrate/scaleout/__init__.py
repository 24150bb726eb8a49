"""Scale-out: the same `--shard K/N` partition of the `<hhh>` buckets, run as N parts.

* `dataset`: a manifest dataset directory (one Parquet part per shard, named
  `part-KKKKK-of-NNNNN.parquet`), its completeness rules, and the migration partition
  of manifest rows (a block's replicas, sources and target all fall in one part).
* `ray_runner`: `--run-on ray --shards N [--ray-address ADDR]` for `scan`, `audit` and
  `migrate --apply`: the parts run as Ray tasks; the driver merges the summaries and,
  for a migration, creates target folders and config.json once and holds every
  namespace lock while the parts run. Ray is imported only there, and only when asked
  for (`pip install 'kvmigrate[ray]'`).

Not to be confused with the deployment fact `--executor`, which describes how the
inference engine ran.
"""

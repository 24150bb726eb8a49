"""Migration engine: plan (data), apply (link / copy / rewrite, journaled), rollback,
verify. See migration.md; the CLI commands `migrate`, `rollback` and `verify` are thin
wrappers over `build_plan` + `apply_plan`, `rollback` and `verify_root`."""

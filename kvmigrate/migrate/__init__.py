"""Migration engine: plan (data), apply (link / copy / rewrite, journaled), rollback,
verify. See migration.md; the CLI commands `migrate`, `rollback` and `verify` are thin
wrappers over `build_plan` + `apply_plan`, `rollback` and `verify_root`, through
kvmigrate.pipeline where they need a scan (this stage never imports the scanner)."""

"""kvmigrate: scan, audit and migrate persistent LLM KV caches on disk.

Data flow: ROOT --scan--> manifest (Parquet) --report/plan--> actions --apply--> target
namespaces. Identity computation (kvmigrate.identity) is pure and shared by every step.
"""

__version__ = "0.1.0"

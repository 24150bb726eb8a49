"""Per-family block-file formats (only vllm.cpp has a header)."""

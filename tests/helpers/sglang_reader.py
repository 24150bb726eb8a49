"""A reference reader of SGLang 0.5.23's HiCache `file` backend, for the end-to-end tests:
the name `HiCacheFile` opens for a deployment and its read rule, transcribed from the
0.5.23 wheel (`sglang/srt/mem_cache/hicache_storage.py` L748-771 suffixes, L822-831 key ->
stem, L853-864 read; /work/shared/reference/sglang-format.md §1.1, §2), not from kvmigrate.

Read rule: a file shorter than the page raises (`IOError("Short read")`, never caught but
for FileNotFoundError), a longer one is silently truncated to the page."""

from __future__ import annotations

import os


class HiCacheFile:
    def __init__(self, file_path: str, *, model_name: str | None, tp_rank: int = 0, tp_size: int = 1,
                 pp_rank: int = 0, pp_size: int = 1, attn_cp_rank: int = 0, attn_cp_size: int = 1,
                 is_mla_model: bool = False, dcp_rank: int = 0, dcp_size: int = 1, logical_page_size: int = 64):
        self.file_path = file_path
        model_name = "-".join(model_name.split("/")) if model_name else ""
        shard_suffix = f"_{pp_size}_{pp_rank}" if pp_size > 1 else ""
        if attn_cp_size > 1:
            shard_suffix += f"_cp{attn_cp_rank}_{attn_cp_size}"
        self.tp_config_suffix = f"_{model_name}_{tp_rank}_{tp_size}{shard_suffix}"
        self.config_suffix = f"_{model_name}{shard_suffix}" if is_mla_model else self.tp_config_suffix
        if dcp_size > 1:
            dcp_suffix = f"_tp{tp_size}_dcp{dcp_rank}_{dcp_size}_page{logical_page_size}"
            self.config_suffix += dcp_suffix
            self.tp_config_suffix += dcp_suffix

    def _get_suffixed_key(self, key: str) -> str:
        if key.endswith(".mamba"):
            return key + self.tp_config_suffix
        return key + self.config_suffix

    def path(self, key: str, pool: str | None = None) -> str:
        """The file it opens for a page key (and side pool)."""
        log_key = key if pool is None else f"{key}.{pool}"
        return os.path.join(self.file_path, f"{self._get_suffixed_key(log_key)}.bin")

    def get(self, key: str, page_bytes: int, pool: str | None = None) -> bytes | None:
        """The page as the engine reads it into a `page_bytes` buffer; None: a miss."""
        buf = bytearray(page_bytes)
        try:
            with open(self.path(key, pool), "rb") as f:
                n = f.readinto(memoryview(buf))
        except FileNotFoundError:
            return None
        if n != page_bytes:
            raise OSError("Short read")
        return bytes(buf)

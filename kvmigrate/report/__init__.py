"""Reports over a manifest: one summary model (`summary.summarize`), findings and hints,
and renderers for text, JSON, Markdown and a self-contained HTML page; `diff` compares
two audits."""

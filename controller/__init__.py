"""The cache-controller process (docs/architecture.md §2, §5)."""

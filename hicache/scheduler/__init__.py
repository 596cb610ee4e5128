"""The scheduler process: the radix tree, admission and batching, the model runner
(docs/architecture.md §2)."""

"""The scheduler process: the radix tree, admission and batching, the model runner (DESIGN §2)."""

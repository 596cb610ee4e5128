"""The cache-controller process (DESIGN §2, §5)."""

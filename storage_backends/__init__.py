"""L3 storage backends (DESIGN §6-§7)."""

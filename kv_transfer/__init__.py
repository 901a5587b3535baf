"""Filled by its issue; see ../shared/ARCHITECTURE.md."""

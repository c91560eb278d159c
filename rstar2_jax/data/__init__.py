"""Problem sets and synthetic tasks."""

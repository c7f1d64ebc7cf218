"""Structured output in the engine: the grammar's mask on every verify row, forced runs as
drafts, the matcher following the slot (docs/structured.md)."""

"""specfleet's shared package: wire protocol, Redis key naming, settings and logging."""

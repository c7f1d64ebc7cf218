"""specfleet's shared package: wire protocol, Redis key naming, settings and logging."""

__version__ = "0.1.0"

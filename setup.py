"""The one native part of specfleet: the suffix drafter's token index
(worker/engine/proposers/_lookup.c; docs/engine.md, "Host work the drafter does every
step anyway"). Everything else is in pyproject.toml.

Optional: a gateway or client install (docker/Dockerfile's gateway image has no compiler)
never imports the drafter, so a failed build there leaves only that module out; a worker
without it refuses to start and names it (worker/engine/proposers/token_index.py)."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("worker.engine.proposers._lookup",
                             ["worker/engine/proposers/_lookup.c"],
                             extra_compile_args=["-O2"], optional=True)])

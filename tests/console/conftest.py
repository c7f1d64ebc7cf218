"""The console tests use the service tests' per-test settings (own key prefix, cleaned up)."""

from service.conftest import settings  # noqa: F401  isort: skip

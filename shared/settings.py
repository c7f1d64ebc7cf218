"""Settings from the environment (``SPECFLEET_*`` and ``REDIS_URL``), validated once at start."""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Literal

from pydantic import AfterValidator, AliasChoices, Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from shared.keys import Keys
from shared.redact import RedisURL

#: Where the Redis URL is read from, first found wins (``specfleet worker --redis`` too).
REDIS_URL_VARIABLES = ("REDIS_URL", "SPECFLEET_REDIS_URL")


class Settings(BaseSettings):
    """Process-wide configuration; every field can be set as ``SPECFLEET_<FIELD>``."""

    model_config = SettingsConfigDict(env_prefix="SPECFLEET_", extra="ignore")

    #: A ``str`` whose repr masks the password (a printed settings object shows no secret).
    redis_url: Annotated[str, AfterValidator(RedisURL)] = Field(
        default="redis://127.0.0.1:6379/0", validate_default=True,
        validation_alias=AliasChoices(*REDIS_URL_VARIABLES),
    )
    prefix: str = Field(default="specfleet", pattern=r"^[\w.\-]+$")
    log_level: str = "info"
    log_format: str = Field(default="json", pattern=r"^(json|console)$")
    heartbeat_seconds: float = Field(default=2.0, gt=0)
    worker_ttl_seconds: float = Field(default=8.0, gt=0, description="missed-heartbeat deadline")
    job_timeout_seconds: int = Field(default=3600, gt=0)
    result_ttl_seconds: int = Field(default=86400, gt=0)
    stream_maxlen: int = Field(default=10000, gt=0)
    stream_ttl_seconds: int = Field(default=86400, gt=0)
    token_chunk: int = Field(default=8, ge=1, description="tokens per streamed token event")
    require_live_worker: bool = Field(
        default=True, description="reject submits for models with no live worker"
    )
    wait_for_worker_seconds: float = Field(
        default=600.0, ge=0, le=86400,
        description="how long a request for a coming model (declared, or a worker of it "
                    "loading) waits for a live worker before it is refused (503); 0: refused "
                    "at once",
    )
    token_flush_seconds: float = Field(
        default=0.05, ge=0, description="a partial token chunk is streamed after this long"
    )
    redis_outage_seconds: float = Field(
        default=300.0, gt=0,
        description="how long workers and stream readers wait out an unreachable Redis",
    )
    batch_window_seconds: int = Field(
        default=86400, gt=0,
        description="how long a batch's lines may wait for workers and run (OpenAI's "
                    "completion_window '24h'); past it the batch is expired. Shorter only "
                    "for drills and tests",
    )
    thread_wait: Literal["auto", "active", "passive"] = Field(
        default="auto", description="worker: how its llama.cpp threads wait at a barrier: "
        "'passive' sleeps (a busy neighbour costs its share), 'active' spins (fastest on "
        "cores of its own); 'auto': passive when --threads takes every core it may run on "
        "(worker/threads.py; OMP_WAIT_POLICY, when set, is kept)",
    )
    chat_template: str | None = Field(
        default=None, description="worker: a named chat template (chatml, gemma, llama3) "
        "to render chats with instead of the model's own",
    )
    cost_cache_dir: str | None = Field(
        default=None, description="worker: where row-cost curves are kept between starts, "
        "one per model, device, build and thread count (worker/engine/drafting/cache.py); unset: "
        "$SPECFLEET_CACHE_DIR/rowcosts or ~/.cache/specfleet/rowcosts; empty: time at every "
        "start",
    )
    step_delay_seconds: float = Field(
        default=0.0, ge=0, le=10,
        description="test/drill only: sleep this long per decode step (slows a worker down)",
    )
    fail_device_checkpoint: bool = Field(
        default=False, description="fault injection: every device checkpoint save fails"
    )

    @property
    def keys(self) -> Keys:
        return Keys(self.prefix)

    def cost_cache(self) -> str | None:
        """The row-cost cache's directory (None: none is kept)."""
        if self.cost_cache_dir is not None:
            return self.cost_cache_dir or None
        base = os.environ.get("SPECFLEET_CACHE_DIR") or str(Path.home() / ".cache" / "specfleet")
        return str(Path(base) / "rowcosts")


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    """The process's settings, read from the environment once."""
    return Settings()

"""Declared models: the catalog an operator keeps in Redis, so a model is known before any
worker of it runs (``specfleet models``, ``POST /v1/specfleet/models``; docs/service.md).

Without a declaration a model is known only from its workers: served while one is alive, and
remembered after (``Keys.models``). That cannot scale from zero: a request that comes before
the first worker was refused as an unknown model. A declared model is *coming* while none of
its workers is live, and requests for it wait for one (``coordinator/models.py`` decides).

A worker's own registration does not declare its model: the catalog is what an operator (or
an autoscaler) means to run, the registry what runs. A fleet with an empty catalog works as
before.

An entry holds what a worker of the model is started with (``model``, the GGUF path or URI
it loads; ``contexts``, the per-slot contexts its workers run with, which are its context
tiers; ``slots``; ``chat_template``; ``device``, the kind of device) and the other names
clients may call it by (``aliases``). Names and aliases are one namespace: an alias never
names a declared model, a model that has had workers, or another model's alias, so a name
always means one model. Declaring, redeclaring and removing are each one script.
"""

from __future__ import annotations

import time
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from redis import Redis

from shared.keys import Keys
from shared.protocol import MODEL_NAME_PATTERN
from shared.replies import text

#: Most aliases one model may have.
MAX_ALIASES = 32

_Name = Annotated[str, Field(min_length=1, max_length=128, pattern=MODEL_NAME_PATTERN)]

#: KEYS: catalog, aliases, models that have had workers. ARGV: name, entry JSON, aliases...
#: Replies {'ok'} or {why, the name at fault, the model it already names}: a name that is
#: another model's alias, or an alias that is a declared name, a served model's name or
#: another model's alias. A redeclared model's old aliases go.
_DECLARE_LUA = """
local name = ARGV[1]
local owner = redis.call('HGET', KEYS[2], name)
if owner then return {'name_is_alias', name, owner} end
for i = 3, #ARGV do
  local alias = ARGV[i]
  if redis.call('HEXISTS', KEYS[1], alias) == 1 or redis.call('SISMEMBER', KEYS[3], alias) == 1
  then return {'alias_is_model', alias, alias} end
  owner = redis.call('HGET', KEYS[2], alias)
  if owner and owner ~= name then return {'alias_taken', alias, owner} end
end
local old = redis.call('HGET', KEYS[1], name)
if old then
  for _, alias in ipairs(cjson.decode(old)['aliases']) do
    if redis.call('HGET', KEYS[2], alias) == name then redis.call('HDEL', KEYS[2], alias) end
  end
end
redis.call('HSET', KEYS[1], name, ARGV[2])
for i = 3, #ARGV do redis.call('HSET', KEYS[2], ARGV[i], name) end
return {'ok'}
"""
#: KEYS: catalog, aliases. ARGV: name. Removes the entry and its aliases; 1 when it was there.
_REMOVE_LUA = """
local old = redis.call('HGET', KEYS[1], ARGV[1])
if not old then return 0 end
for _, alias in ipairs(cjson.decode(old)['aliases']) do
  if redis.call('HGET', KEYS[2], alias) == ARGV[1] then redis.call('HDEL', KEYS[2], alias) end
end
redis.call('HDEL', KEYS[1], ARGV[1])
return 1
"""


class ModelEntry(BaseModel):
    """One declared model: its name, the names clients may also use, and what its workers
    are started with (an autoscaler starts them from it; a request that surely cannot fit
    the declared contexts is refused before any worker runs)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    name: _Name
    model: str = Field(min_length=1, max_length=4096,
                       description="the GGUF path or URI its workers load (--model)")
    aliases: list[_Name] = Field(default_factory=list, max_length=MAX_ALIASES,
                                 description="other names clients may call it by")
    contexts: list[Annotated[int, Field(ge=16)]] = Field(
        default_factory=list, max_length=16,
        description="per-slot contexts its workers run with (--ctx): its context tiers")
    slots: int | None = Field(default=None, ge=1, le=256,
                              description="generation slots per worker (--slots)")
    chat_template: str | None = Field(
        default=None, min_length=1, max_length=64, pattern=MODEL_NAME_PATTERN,
        description="a named chat template its workers use (SPECFLEET_CHAT_TEMPLATE)")
    device: Literal["cpu", "cuda"] | None = Field(
        default=None, description="the kind of device its workers run on")
    declared_at: float = Field(default_factory=time.time)

    @field_validator("aliases")
    @classmethod
    def _distinct(cls, aliases: list[str]) -> list[str]:
        if len(set(aliases)) != len(aliases):
            raise ValueError("an alias is listed twice")
        return aliases

    @field_validator("contexts")
    @classmethod
    def _sorted(cls, contexts: list[int]) -> list[int]:
        return sorted(set(contexts))

    @model_validator(mode="after")
    def _not_its_own_alias(self) -> ModelEntry:
        if self.name in self.aliases:
            raise ValueError(f"aliases: '{self.name}' is the model's own name")
        return self


class CatalogError(ValueError):
    """A declaration the catalog refuses; ``param`` names the field at fault."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


class ModelCatalog:
    """The declared models of one deployment."""

    def __init__(self, connection: Redis, keys: Keys) -> None:
        self._conn = connection
        self._keys = keys
        self._declare = connection.register_script(_DECLARE_LUA)
        self._remove = connection.register_script(_REMOVE_LUA)

    def declare(self, entry: ModelEntry) -> ModelEntry:
        """Add ``entry``, or replace the entry of its name (its old aliases go);
        :class:`CatalogError` when one of its names already means another model."""
        k = self._keys
        reply = [text(r) for r in self._declare(
            keys=[k.catalog(), k.catalog_aliases(), k.models()],
            args=[entry.name, entry.model_dump_json(), *entry.aliases])]
        if reply[0] == "name_is_alias":
            raise CatalogError(f"name: '{reply[1]}' is an alias of model '{reply[2]}'", "name")
        if reply[0] == "alias_is_model":
            raise CatalogError(f"aliases: '{reply[1]}' is the name of a model (declared, or "
                               "served by workers)", "aliases")
        if reply[0] == "alias_taken":
            raise CatalogError(f"aliases: '{reply[1]}' is already an alias of model "
                               f"'{reply[2]}'", "aliases")
        return entry

    def remove(self, name: str) -> bool:
        """Forget a declared model and its aliases (its workers, if any, serve on); False
        when it was not declared."""
        k = self._keys
        return bool(self._remove(keys=[k.catalog(), k.catalog_aliases()], args=[name]))

    def get(self, name: str) -> ModelEntry | None:
        raw = self._conn.hget(self._keys.catalog(), name)
        return ModelEntry.model_validate_json(raw) if raw else None

    def entries(self) -> list[ModelEntry]:
        """Every declared model, by name."""
        raw = self._conn.hgetall(self._keys.catalog())
        return sorted((ModelEntry.model_validate_json(v) for v in raw.values()),
                      key=lambda e: e.name)

    def resolve(self, name: str) -> str | None:
        """The declared model ``name`` is an alias of, or None."""
        return text(self._conn.hget(self._keys.catalog_aliases(), name)) or None

"""OpenAI's Files API over Redis: the JSON Lines files a batch is created from (uploads), and
each batch's output and error files, assembled from its results when read.

An upload is a hash ``file:{id}`` (its file object, bytes and owner) in the ``files`` listing
and its owner's (``owner:{key id}:files``, with the bytes its quota counts), all expiring
``SPECFLEET_RESULT_TTL_SECONDS`` after it was stored; the quota is checked and booked in the
script that stores it, so concurrent uploads cannot overshoot it. A result file has no key of
its own: its id names its batch (``file-batch_…-output`` / ``-errors``), it is seen by whoever
sees the batch, and expires with it. :class:`FileStore` serves both kinds behind one id space,
as OpenAI does; the batches themselves are ``coordinator/batch.py``'s.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from typing import Any, Literal, Protocol

from redis import Redis

from coordinator.tenancy import ANONYMOUS, OPERATOR, StoreError, Tenant, listing
from shared.keys import Keys
from shared.replies import text

#: Largest input file, in bytes.
MAX_FILE_BYTES = 32 * 1024 * 1024

#: An owner's uploads (KEYS[3]: id -> when it expires) and their bytes (KEYS[4]: id -> bytes,
#: ``total``): ``forget`` takes one out of both.
_FILES_LUA = """
local function forget(id)
  local size = redis.call('HGET', KEYS[4], id)
  if size then
    redis.call('HINCRBY', KEYS[4], 'total', -tonumber(size))
    redis.call('HDEL', KEYS[4], id)
  end
  redis.call('ZREM', KEYS[3], id)
end
"""
#: Store upload ARGV[1] (hash KEYS[1], listing KEYS[2] scored ARGV[2]) for owner ARGV[8] with
#: TTL ARGV[3], unless its ARGV[4] bytes bring the owner's live uploads past ARGV[5] (-1: no
#: limit); expired uploads leave the count first. Returns -1 once stored, else the bytes the
#: owner holds.
_UPLOAD_LUA = _FILES_LUA + """
local now = tonumber(redis.call('TIME')[1])
for _, id in ipairs(redis.call('ZRANGEBYSCORE', KEYS[3], '-inf', now)) do forget(id) end
local used = tonumber(redis.call('HGET', KEYS[4], 'total') or '0')
local size, limit = tonumber(ARGV[4]), tonumber(ARGV[5])
if limit >= 0 and used + size > limit then return used end
redis.call('HSET', KEYS[1], 'meta', ARGV[6], 'content', ARGV[7], 'owner', ARGV[8])
redis.call('EXPIRE', KEYS[1], ARGV[3])
redis.call('ZADD', KEYS[2], ARGV[2], ARGV[1])
redis.call('ZADD', KEYS[3], now + tonumber(ARGV[3]), ARGV[1])
redis.call('HSET', KEYS[4], ARGV[1], size)
redis.call('HINCRBY', KEYS[4], 'total', size)
redis.call('EXPIRE', KEYS[3], ARGV[3])
redis.call('EXPIRE', KEYS[4], ARGV[3])
return -1
"""
#: Delete upload ARGV[1] (hash KEYS[1], listing KEYS[2]) and its owner's count of it; 1 when
#: it was there.
_DELETE_FILE_LUA = _FILES_LUA + """
local existed = redis.call('DEL', KEYS[1])
redis.call('ZREM', KEYS[2], ARGV[1])
forget(ARGV[1])
return existed
"""


class BatchResults(Protocol):
    """What a result file is read from (``BatchStore``): its batch, if the tenant sees it,
    and the batch's result lines."""

    def get(self, batch_id: str, *, tenant: Tenant = OPERATOR) -> dict[str, Any]: ...

    def result_lines(self, batch_id: str, which: Literal["output", "errors", "all"], *,
                     tenant: Tenant = OPERATOR) -> Iterator[dict[str, Any]]: ...


def result_file_id(batch_id: str, kind: Literal["output", "errors"]) -> str:
    """The id of a batch's output or error file."""
    return f"file-{batch_id}-{kind}"


class FileStore:
    """Uploads and batches' result files of one deployment (see the module docstring).

    Every method takes the ``tenant`` asking (the operator's view unless told otherwise: the
    gateway always tells it)."""

    def __init__(self, conn: Redis, keys: Keys, ttl: int, batches: BatchResults) -> None:
        self.conn = conn
        self.keys = keys
        self.ttl = ttl
        self._batches = batches
        self._upload = conn.register_script(_UPLOAD_LUA)
        self._delete_file = conn.register_script(_DELETE_FILE_LUA)

    def upload(self, content: bytes, filename: str, purpose: str = "batch", *,
               tenant: Tenant = OPERATOR) -> dict[str, Any]:
        """Store an input file owned by ``tenant``; returns its OpenAI file object. A file
        that is not JSON Lines at all is refused here (:func:`check_jsonl`), and so is one
        that would bring the tenant's live uploads past its quota (429)."""
        if purpose != "batch":
            raise StoreError(f"purpose must be 'batch', not {purpose!r}", param="purpose")
        if len(content) > MAX_FILE_BYTES:
            raise StoreError(f"file of {len(content)} bytes exceeds the limit of "
                             f"{MAX_FILE_BYTES} bytes", status=413, param="file")
        check_jsonl(content)
        file_id = f"file-{uuid.uuid4().hex}"
        info: dict[str, Any] = {"id": file_id, "object": "file", "bytes": len(content),
                "created_at": int(time.time()), "filename": filename[:256], "purpose": purpose,
                "status": "processed"}
        limit = tenant.quota.stored_bytes if tenant.quota is not None else -1
        held = int(self._upload(
            keys=[self.keys.file(file_id), self.keys.files(), *self._owner_files(tenant.owner)],
            args=[file_id, info["created_at"], self.ttl, len(content), limit, json.dumps(info),
                  content, tenant.owner]))
        if held >= 0:
            raise StoreError(f"this file of {len(content)} bytes would bring this API key's "
                             f"live uploads to {held + len(content)} bytes, over "
                             f"SPECFLEET_MAX_STORED_BYTES_PER_KEY ({limit}): delete files or "
                             "wait for them to expire", status=429, param="file",
                             code="quota_exceeded")
        return {**info, "expires_at": info["created_at"] + self.ttl}

    def _owner_files(self, owner: str) -> list[str]:
        """The keys of an owner's uploads and their bytes (the scripts' KEYS[3], KEYS[4])."""
        return [self.keys.owner_files(owner), self.keys.owner_file_bytes(owner)]

    def uploads(self, limit: int = 20, after: str | None = None, *,
                tenant: Tenant = OPERATOR) -> list[dict[str, Any]]:
        """The uploads ``tenant`` sees (an admin: everyone's), newest first (``after``:
        continue after that file); a file whose TTL ran out leaves the listing when met."""
        if tenant.admin:
            index = self.keys.files()
            return listing(self.conn, index, self.file, limit, after,
                           lambda file_id: self.conn.zrem(index, file_id))
        return listing(self.conn, self.keys.owner_files(tenant.owner), self.file, limit, after,
                       lambda file_id: self._unstore(file_id, tenant.owner))

    def delete(self, file_id: str, *, tenant: Tenant = OPERATOR) -> dict[str, Any]:
        """Delete an upload (a batch already created from it has its lines queued; one
        still queueing them reads the file and fails the lines it no longer finds)."""
        if self._result_batch(file_id, tenant) is not None:
            raise StoreError(f"{file_id} is a batch's result file: it expires with its batch",
                             param="file_id")
        _, owner = self._upload_fields(file_id, tenant)
        if not self._unstore(file_id, owner):
            raise _no_file(file_id)
        return {"id": file_id, "object": "file", "deleted": True}

    def _unstore(self, file_id: str, owner: str) -> bool:
        """Delete an upload and its owner's count of it; whether it was there."""
        return bool(self._delete_file(
            keys=[self.keys.file(file_id), self.keys.files(), *self._owner_files(owner)],
            args=[file_id]))

    def _result_batch(self, file_id: str, tenant: Tenant) -> tuple[str, str] | None:
        """``(batch id, "output" | "errors")`` of a batch's result file, None for an upload;
        "no such file" for the result file of a batch ``tenant`` does not see (or of none)."""
        batch_id, kind = batch_of_file(file_id)
        if batch_id is None:
            return None
        try:
            self._batches.get(batch_id, tenant=tenant)
        except StoreError:
            raise _no_file(file_id) from None
        return batch_id, kind

    def _upload_fields(self, file_id: str, tenant: Tenant, *fields: str) -> list[Any]:
        """``[meta, owner, *fields]`` of an upload ``tenant`` sees, else "no such file" (the
        same 404 whether it is missing or another's: existence does not leak)."""
        meta, raw_owner, *values = self.conn.hmget(self.keys.file(file_id), "meta", "owner",
                                                   *fields)
        owner = text(raw_owner) or ANONYMOUS
        if meta is None or not tenant.sees(owner):
            raise _no_file(file_id)
        return [meta, owner, *values]

    def file(self, file_id: str, *, tenant: Tenant = OPERATOR) -> dict[str, Any]:
        """The file object of an upload or of a batch's output/error file."""
        result = self._result_batch(file_id, tenant)
        if result is not None:
            batch_id, kind = result
            content = self.content(file_id, tenant=tenant)
            batch = self._batches.get(batch_id, tenant=tenant)
            return {"id": file_id, "object": "file", "bytes": len(content),
                    "created_at": batch.get("completed_at") or batch["created_at"],
                    "filename": f"{batch_id}_{kind}.jsonl", "purpose": "batch_output",
                    "status": "processed"}
        meta, _ = self._upload_fields(file_id, tenant)
        ttl = int(self.conn.ttl(self.keys.file(file_id)))
        # OpenAI's expires_at: when the file's TTL ends
        return {**json.loads(meta), "expires_at": int(time.time()) + max(ttl, 0)}

    def content(self, file_id: str, *, tenant: Tenant = OPERATOR) -> bytes:
        """An upload's bytes, or a batch's output/error file assembled from its results."""
        result = self._result_batch(file_id, tenant)
        if result is not None:
            batch_id, kind = result
            which: Literal["output", "errors"] = "errors" if kind == "errors" else "output"
            lines = self._batches.result_lines(batch_id, which, tenant=tenant)
            return "".join(json.dumps(line) + "\n" for line in lines).encode()
        _, _, raw = self._upload_fields(file_id, tenant, "content")
        if raw is None:  # expired between the fields
            raise _no_file(file_id)
        return raw.encode() if isinstance(raw, str) else raw


def jsonl_lines(content: bytes) -> list[bytes]:
    """A file's non-blank lines, in order."""
    return [line for line in content.split(b"\n") if line.strip()]


def json_value(raw: bytes | None) -> Any:
    """A line's JSON value, or None when it is none: missing, malformed, not UTF-8, or nested
    past the interpreter's recursion limit (``json`` raises ``RecursionError`` there, not
    ``ValueError``: a line 100,000 brackets deep was a 500)."""
    if raw is None:
        return None
    try:
        return json.loads(raw)
    except (ValueError, RecursionError):
        return None


def check_jsonl(content: bytes) -> None:
    """Refuse a file that is not JSON Lines at all (an image, a spreadsheet, a JSON array):
    one holding a NUL byte (no JSON text does), or lines none of which is a JSON object. A
    file of objects with some broken lines is taken: each bad line fails on its own."""
    nul = content.find(b"\x00")
    if nul >= 0:
        raise StoreError(f"the file is not JSONL (one JSON object per line): byte {nul} is "
                         "NUL, so it is binary data", param="file")
    lines = jsonl_lines(content)
    if lines and not any(isinstance(json_value(line), dict) for line in lines):
        # an empty file is refused at create, for having no lines
        raise StoreError("the file is not JSONL (one JSON object per line): no line is a "
                         "JSON object", param="file")


def _no_file(file_id: str) -> StoreError:
    return StoreError(f"no such file: {file_id}", status=404, param="file_id")


def batch_of_file(file_id: str) -> tuple[str | None, str]:
    """``(batch id, "output" | "errors")`` for a batch's result file id, else ``(None, "")``."""
    if file_id.startswith("file-batch_"):
        batch_id, _, kind = file_id[len("file-"):].rpartition("-")
        if kind in ("output", "errors"):
            return batch_id, kind
    return None, ""

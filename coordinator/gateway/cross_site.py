"""Requests a web page could make a browser send the gateway, refused before they run.

A keyless gateway on loopback is reachable by every page its user opens: a page needs no CORS
preflight to POST JSON as ``text/plain`` (or with no Content-Type) and cannot read the answer,
but the job runs (CSRF); a page whose own name it re-points at the gateway (DNS rebinding) is
the gateway's origin to the browser, so it reads answers too. :class:`CrossSite` checks the
Host, the Origin and the Content-Type of every request first (docs/http.md, "Cross-site
requests"); :func:`allowed_hosts` decides which Host names a gateway answers to.
"""

from __future__ import annotations

import ipaddress

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from coordinator.gateway.errors import APIError
from shared.logs import get_logger

#: Answered whatever the Host and Origin: load balancers and orchestrators probe a gateway by
#: its address, and health changes nothing and shows only model names and worker counts.
CROSS_SITE_EXEMPT = frozenset({"/health"})
#: What a POST's body must be sent as, where it is not JSON.
UPLOAD_TYPES = {"/v1/files": "multipart/form-data"}
#: The names a gateway bound to a loopback address is reached by (any port).
LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "[::1]"})
#: ``Sec-Fetch-Site`` of a browser request made by a page of another site.
_OTHER_SITES = frozenset({"cross-site", "same-site"})

log = get_logger("gateway")


def host_name(value: str) -> str:
    """A host as the Host header names it, without its port: lower case, an IPv6 address in
    brackets (``[::1]``), so a setting, a bind address and a header compare."""
    value = value.strip().lower()
    if value.startswith("["):
        address = value[1:].partition("]")[0]
    elif value.count(":") > 1:  # a bare IPv6 address (a setting, a bind)
        address = value
    else:
        return value.partition(":")[0]
    try:
        return f"[{ipaddress.IPv6Address(address)}]"
    except ValueError:
        return f"[{address}]"


def allowed_hosts(setting: str, bind: str) -> frozenset[str] | None:
    """The host names a request's Host may carry (None: any). ``setting`` when it names
    any (comma-separated; ``*``: any), else what the gateway is reached by at ``bind``: a
    loopback address by the loopback names (no page elsewhere can make a browser send
    those: DNS rebinding cannot), a wildcard by any name (an exposed gateway should be
    given its names, or sit behind a proxy that checks them), any other by itself."""
    names = {n.strip() for n in setting.split(",") if n.strip()}
    if names:
        return None if "*" in names else frozenset(host_name(n) for n in names)
    try:
        address = ipaddress.ip_address(bind.strip("[]"))
    except ValueError:
        address = None
    if not bind or (address is not None and address.is_unspecified):
        return None
    if bind.lower() == "localhost" or (address is not None and address.is_loopback):
        return LOOPBACK_NAMES | {host_name(bind)}
    return frozenset({host_name(bind)})


class CrossSite:
    """Refuses what a web page could otherwise make a browser send a gateway, before it
    runs (docs/http.md, "Cross-site requests"). A page needs no CORS preflight to POST
    JSON as ``text/plain`` (or with no Content-Type) and cannot read the answer, but the job
    runs (CSRF); and a page whose own name it re-points at the gateway (DNS rebinding) is
    the gateway's origin to the browser, so it reads answers too. So:

    - 421 for a Host the gateway is not reached by (``allowed`` hosts; None: any);
    - 403 for an ``Origin`` that is neither the request's own (its Host) nor allowed by the
      CORS setting, whatever the method (a resumed stream cancels its job when the page
      lets go), and for a browser request without one that another site made
      (``Sec-Fetch-Site``: an ``<img>``, a link); preflights pass (they run nothing and the
      CORS setting answers them);
    - 415 for a POST body that is not ``application/json`` (``multipart/form-data`` on
      ``/v1/files``).

    Clients that are not browsers send neither Origin nor Sec-Fetch-Site and are unaffected.
    ``/health`` is exempt (:data:`CROSS_SITE_EXEMPT`)."""

    def __init__(self, app: ASGIApp, allowed: frozenset[str] | None,
                 origins: list[str]) -> None:
        self.app = app
        self.allowed = allowed
        self.origins = frozenset(origins)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in CROSS_SITE_EXEMPT:
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        refusal = (self._host(headers) or self._origin(scope["method"], headers)
                   or _media_type(scope["method"], scope["path"], headers))
        if refusal is None:
            await self.app(scope, receive, send)
            return
        log.warning("gateway.cross_site_refused", status=refusal.status, param=refusal.param,
                    path=scope["path"], method=scope["method"], host=headers.get("host"),
                    origin=headers.get("origin"), content_type=headers.get("content-type"))
        await refusal.response()(scope, receive, send)

    def _host(self, headers: Headers) -> APIError | None:
        if self.allowed is None or host_name(headers.get("host", "")) in self.allowed:
            return None
        return APIError(421, f"this gateway does not serve the host {headers.get('host')!r} "
                        "(specfleet serve --allowed-hosts, SPECFLEET_ALLOWED_HOSTS)",
                        param="Host", code="host_not_allowed")

    def _origin(self, method: str, headers: Headers) -> APIError | None:
        origin = headers.get("origin")
        if method == "OPTIONS" or (origin is None
                                   and headers.get("sec-fetch-site") not in _OTHER_SITES):
            return None
        if origin is not None and ("*" in self.origins or origin in self.origins
                                   or _same_origin(origin, headers.get("host", ""))):
            return None
        shown = "another site" if origin is None else f"origin {origin!r}"
        return APIError(403, f"requests from {shown} are not allowed: only the gateway's own "
                        "origin and those of specfleet serve --cors-origins "
                        "(SPECFLEET_CORS_ORIGINS)", "permission_error", param="Origin",
                        code="origin_not_allowed")


def _same_origin(origin: str, host: str) -> bool:
    """Whether ``origin`` (``scheme://host[:port]``) names the host the request was sent to
    (a browser leaves the default port out of both)."""
    authority = origin.partition("://")[2].lower()
    return bool(authority) and authority == host.strip().lower()


def _media_type(method: str, path: str, headers: Headers) -> APIError | None:
    """415 for a POST body sent as anything but JSON (or, to ``/v1/files``, multipart): a
    browser sends ``text/plain`` (or a typeless body) cross-site without asking first."""
    length = headers.get("content-length", "0")
    if method != "POST" or (length.isdigit() and int(length) == 0
                            and "transfer-encoding" not in headers):
        return None
    wanted = UPLOAD_TYPES.get(path, "application/json")
    given = headers.get("content-type", "")
    if given.partition(";")[0].strip().lower() == wanted:
        return None
    return APIError(415, f"send the body as Content-Type: {wanted}"
                    + (f", not {given!r}" if given else " (the request named none)"),
                    param="Content-Type", code="unsupported_media_type")

"""Who may change a server's state, and from where: the control-request gate.

A *control request* is one that changes what the server does (today: ``POST`` or
``PATCH`` on ``/v2/models/{name}/batching``, ``POST`` on Triton's trace settings,
``/v2[/models/{name}]/trace/setting``, and the gRPC ``TraceSetting`` call that changes
them); inference and every ``GET`` are not.
``AuthConfig.check(method, headers, peer)`` decides one control request and gives
the identity it is recorded under, or raises an error that
``runtime.api.errors.error_answer`` answers:

1. **Cross-site requests are refused, always** (403). A request that carries an
   ``Origin`` must come from the server's own origin (the ``Origin`` names the same
   host and port as the ``Host`` header); one without ``Origin`` is refused when
   ``Sec-Fetch-Site`` says another site sent it. Without a token, the ``Host``
   header must also name a loopback address, so a page whose name was made to
   resolve to 127.0.0.1 (DNS rebinding) is refused as well.
2. **A token, when the server has one** (401 when missing, 403 when wrong, compared
   in constant time): ``Authorization: Bearer <token>``. A server that listens
   beyond loopback must have one (``auth_for_listening`` refuses to build it
   otherwise); on loopback it is optional, and without one only loopback peers may
   send control requests.
3. **A JSON body** (400 otherwise): ``Content-Type: application/json``. A browser
   cannot send that cross-origin without asking first (a CORS preflight, which this
   server does not grant), so a page cannot forge a control request by posting a
   form or ``text/plain``. A route may also take a body sent without any
   ``Content-Type`` (``untyped_json``: the trace settings, which ``tritonclient.http``
   posts without one): a form or ``text/plain`` post always carries one, and a page
   that sends a body without one from another site sends its ``Origin`` too (rule 1).

``check_costly_read(headers)`` applies rule 1 (and, without a token, the loopback
``Host``) to a ``GET`` that is costly and hands out recordings: the trace export.

``check_rpc(authorization, peer)`` decides a control call over gRPC, which no browser
can make (there is no origin or body type to check): rule 2, and without a token the
peer must be a loopback address.

The identity is ``"token:<first 8 hex digits of the token's SHA-256>"`` with a token
and ``"loopback"`` without: what the request proved, never what it claims
(``X-Requested-By`` is only a note).

``token_from(flag, path, environ)`` reads the token from ``--control-token``,
``--control-token-file`` (refused when group or others may read it) or
``$BATCHSCOPE_CONTROL_TOKEN``. Nothing here runs on the inference path.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping
from urllib.parse import urlsplit

from runtime.api.errors import BatchScopeError, ClientError, ConfigError

#: the environment variable a token may come from
ENV_TOKEN = "BATCHSCOPE_CONTROL_TOKEN"
#: the shortest token accepted: long enough that guessing it over HTTP is hopeless
MIN_TOKEN_CHARS = 16
#: methods that change nothing; ``check`` lets them through untouched
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
#: how to make a good token, quoted by the errors that ask for one
MAKE_TOKEN = "python -c 'import secrets; print(secrets.token_urlsafe(32))'"
#: the identity of a control request allowed because it came from this machine
LOOPBACK = "loopback"

_HOW_TO_SEND = "send it as the header 'Authorization: Bearer <token>'"
_HOW_TO_CONFIGURE = (f"give the server one with --control-token-file PATH (a file only its "
                     f"owner can read), ${ENV_TOKEN}, or --control-token")


class Unauthorized(BatchScopeError):
    """A control request without the credentials the server asks for."""

    http_status = 401
    reason = "unauthorized"
    #: the ``WWW-Authenticate`` header of the answer
    challenge = 'Bearer realm="batchscope control"'


class Forbidden(BatchScopeError):
    """A control request the server refuses: a wrong token, or sent by another site."""

    http_status = 403
    reason = "forbidden"


def is_loopback(host: str | None) -> bool:
    """Whether ``host`` (an address, ``localhost``, or a peer address) is this machine's
    loopback; unknown names and wildcards (``0.0.0.0``, ``::``) are not."""
    if not host:
        return False
    host = host.strip().strip("[]").lower()
    if host == "localhost":
        return True
    try:
        addr = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return False
    mapped = getattr(addr, "ipv4_mapped", None)
    return bool(addr.is_loopback or (mapped is not None and mapped.is_loopback))


def token_identity(token: str) -> str:
    """How the history names a request that sent ``token``: a short digest, not the token."""
    return "token:" + hashlib.sha256(token.encode("utf-8")).hexdigest()[:8]


def check_token(token: str, source: str) -> str:
    """``token`` if it is usable in a header and long enough, else a ``ConfigError``."""
    if len(token) < MIN_TOKEN_CHARS:
        raise ConfigError(f"the control token from {source} has {len(token)} characters; use "
                          f"at least {MIN_TOKEN_CHARS}, e.g. from {MAKE_TOKEN}")
    if not all(33 <= ord(c) <= 126 for c in token):
        raise ConfigError(f"the control token from {source} must be printable ASCII without "
                          f"spaces (it travels in a header); make one with {MAKE_TOKEN}")
    return token


def read_token_file(path: str | Path) -> str:
    """The token in ``path`` (surrounding whitespace dropped). Refused when the file is
    readable or writable by group or others, as ssh refuses a private key."""
    path = Path(path)
    try:
        mode = path.stat().st_mode
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"--control-token-file {path}: cannot read it "
                          f"({getattr(exc, 'strerror', None) or exc})") from None
    if not stat.S_ISREG(mode):
        raise ConfigError(f"--control-token-file {path} is not a regular file")
    if mode & 0o077:
        raise ConfigError(f"--control-token-file {path} can be read or written by other users "
                          f"(mode {stat.S_IMODE(mode):03o}); run: chmod 600 {path}")
    token = text.strip()
    if not token:
        raise ConfigError(f"--control-token-file {path} is empty; write the token in it, e.g. "
                          f"{MAKE_TOKEN} > {path}")
    return check_token(token, f"--control-token-file {path}")


def token_from(flag: str | None, path: str | None,
               environ: Mapping[str, str] | None = None) -> str | None:
    """The configured token: ``--control-token``, else ``--control-token-file``, else
    ``$BATCHSCOPE_CONTROL_TOKEN``; None when none is given. Giving both flags is an error."""
    if flag is not None and path is not None:
        raise ConfigError("give the control token once: --control-token or "
                          "--control-token-file, not both")
    if flag is not None:
        return check_token(flag.strip(), "--control-token")
    if path is not None:
        return read_token_file(path)
    value = (os.environ if environ is None else environ).get(ENV_TOKEN, "").strip()
    return check_token(value, f"${ENV_TOKEN}") if value else None


def _authority(netloc: str, scheme: str | None = None) -> str:
    """``host[:port]`` lowercased, the port dropped when it is the scheme's default."""
    netloc = netloc.strip().lower()
    for default in ((":80",) if scheme == "http" else (":443",) if scheme == "https"
                    else (":80", ":443")):
        if netloc.endswith(default):
            return netloc[:-len(default)]
    return netloc


def _host_name(host_header: str) -> str:
    """The host of a ``Host`` header, without its port (``[::1]:80`` -> ``::1``)."""
    if host_header.startswith("["):
        return host_header[1:].split("]", 1)[0]
    return host_header.rsplit(":", 1)[0] if host_header.count(":") == 1 else host_header


@dataclass(frozen=True)
class AuthConfig:
    """How control requests are authorized.

    ``token``: the bearer token control requests must send (None: no token).
    ``loopback_only``: the server listens on loopback addresses only; without a token
    that is the only case where control requests are accepted (from loopback peers).
    A server beyond loopback without a token refuses every control request; build
    one with ``auth_for_listening``, which refuses that combination up front.
    """

    token: str | None = None
    loopback_only: bool = True

    @property
    def identity(self) -> str:
        """The identity every accepted control request of this server gets."""
        return token_identity(self.token) if self.token is not None else LOOPBACK

    def describe(self) -> str:
        """One phrase for the start-up line."""
        if self.token is not None:
            return f"control requests need the token ({self.identity})"
        return "control requests from this machine only (no token)"

    def check(self, method: str, headers: Mapping[str, str], peer: str | None, *,
              untyped_json: bool = False) -> str:
        """The identity of the control request ``method`` with ``headers`` (lowercase
        names, as ASGI gives them) from ``peer`` (its address), or ``Unauthorized``,
        ``Forbidden`` or ``ClientError``. Safe methods pass as the configured identity.
        ``untyped_json``: a body without ``Content-Type`` is taken as JSON."""
        if method.upper() in SAFE_METHODS:
            return self.identity
        self._check_same_origin(headers)
        if self.token is not None:
            self._check_token(headers.get("authorization"))
        elif not self.loopback_only:
            raise Forbidden("this server listens beyond loopback without a control token, so "
                            f"it accepts no control requests; {_HOW_TO_CONFIGURE}")
        else:
            self._check_local(headers, peer)
        kind = (headers.get("content-type") or "").split(";", 1)[0].strip().lower()
        if kind != "application/json" and not (untyped_json and not kind):
            shown = f"Content-Type {kind!r}" if kind else "no Content-Type"
            raise ClientError(f"a control request must send a JSON body with 'Content-Type: "
                              f"application/json' (this one has {shown})")
        return self.identity

    def check_costly_read(self, headers: Mapping[str, str]) -> None:
        """A ``GET`` that costs the server work and hands out what it recorded (a trace
        export): no token needed, but rule 1 as for a control request (cross-site
        pages refused), and on a server without a token a ``Host`` that names loopback
        (a page whose name was made to resolve to 127.0.0.1 may not read it either)."""
        self._check_same_origin(headers, "trace exports")
        if self.token is None and self.loopback_only:
            _check_loopback_host(headers, "trace exports")

    def check_rpc(self, authorization: str | None, peer: str | None) -> str:
        """The identity of a control call over gRPC with the ``authorization`` metadata
        (``Bearer <token>``) from ``peer`` (its address), or ``Unauthorized`` or
        ``Forbidden``: the token when the server has one, else a loopback peer."""
        if self.token is not None:
            self._check_token(authorization)
        elif not self.loopback_only:
            raise Forbidden("this server listens beyond loopback without a control token, so "
                            f"it accepts no control requests; {_HOW_TO_CONFIGURE}")
        elif not is_loopback(peer):
            raise Unauthorized(f"this server has no control token, so it accepts control "
                               f"calls from this machine only ({peer or 'unknown peer'} is "
                               f"not); {_HOW_TO_CONFIGURE}, then send the metadata "
                               "'authorization: Bearer <token>'")
        return self.identity

    # -- the steps --------------------------------------------------------------------
    @staticmethod
    def _check_same_origin(headers: Mapping[str, str], what: str = "control requests") -> None:
        # a browser's word that the page is another site's counts whatever Origin says;
        # every copy of a header counts (a proxy may join a forged one to the real one)
        for site in _every(headers, "sec-fetch-site"):
            site = site.strip().lower()
            if site in ("cross-site", "same-site"):
                raise Forbidden(f"{what} from web pages of other sites are refused "
                                f"(Sec-Fetch-Site: {site[:40]}); send them from a script or a "
                                "command-line client")
        host = headers.get("host")
        for origin in _every(headers, "origin"):
            parts = urlsplit(origin.strip())
            same = (host is not None and parts.scheme in ("http", "https")
                    and _authority(parts.netloc, parts.scheme) == _authority(host))
            if not same:
                raise Forbidden(f"{what} from web pages of other origins are "
                                f"refused (Origin {origin[:100]!r} is not this server, "
                                f"{(host or 'no Host')[:100]!r}); send them from a script or "
                                "a command-line client")

    def _check_token(self, authorization: str | None) -> None:
        assert self.token is not None
        if not authorization:
            raise Unauthorized(f"this control request needs the server's control token; "
                               f"{_HOW_TO_SEND}")
        scheme, _, given = authorization.strip().partition(" ")
        if scheme.lower() != "bearer" or not given.strip():
            raise Unauthorized(f"the Authorization header must be 'Bearer <token>' (got scheme "
                               f"{scheme[:20]!r}); {_HOW_TO_SEND}")
        # digests of equal length: the comparison takes the same time whatever was sent
        sent = hashlib.sha256(given.strip().encode("utf-8", "replace")).digest()
        if not hmac.compare_digest(sent, hashlib.sha256(self.token.encode("utf-8")).digest()):
            raise Forbidden("the control token sent is not this server's; send the one the "
                            "server was started with (--control-token-file, "
                            f"${ENV_TOKEN} or --control-token)")

    @staticmethod
    def _check_local(headers: Mapping[str, str], peer: str | None) -> None:
        if not is_loopback(peer):
            raise Unauthorized(f"this server has no control token, so it accepts control "
                               f"requests from this machine only ({peer or 'unknown peer'} is "
                               f"not); {_HOW_TO_CONFIGURE}, then {_HOW_TO_SEND}")
        _check_loopback_host(headers, "control requests")


def _check_loopback_host(headers: Mapping[str, str], what: str) -> None:
    """``Forbidden`` unless the request's ``Host`` (if any) names a loopback address: on a
    server without a token, a page whose name was made to resolve to 127.0.0.1 (DNS
    rebinding) is refused so."""
    host = headers.get("host")
    if host is not None and not is_loopback(_host_name(host.strip())):
        raise Forbidden(f"without a control token, {what} must name this machine's "
                        f"loopback address in Host (got {host[:100]!r}); use "
                        "http://127.0.0.1:PORT, or give the server a token")


def _every(headers: Mapping[str, str], name: str) -> list[str]:
    """Every value of header ``name`` (lowercase) a request carried: ASGI's ``Headers``
    hold them all (``getlist``); a plain mapping, one."""
    getlist = getattr(headers, "getlist", None)
    if getlist is not None:
        return getlist(name)
    value = headers.get(name)
    return [] if value is None else [value]


def auth_for_listening(host: str, token: str | None) -> AuthConfig:
    """The ``AuthConfig`` of a server listening on ``host``: loopback-only or not, and a
    ``ConfigError`` when it would listen beyond loopback without a token."""
    loopback_only = is_loopback(host)
    if not loopback_only and token is None:
        raise ConfigError(f"listening on {host} reaches beyond this machine, so changing "
                          f"settings needs a control token: {_HOW_TO_CONFIGURE} (make one "
                          f"with {MAKE_TOKEN}), or listen on 127.0.0.1")
    return AuthConfig(token=token, loopback_only=loopback_only)

"""Who may use the server: Host and Origin rules for browsers, and API keys.

Pure decisions (no HTTP framework): app.py asks them before a route runs. The threat
model and the defaults are in docs/security.md. In short:

- Bound to a loopback address, a request whose `Host` names anything but a loopback
  address or name, the bound address, or an `--allowed-hosts` entry is refused: a page
  whose domain resolves to 127.0.0.1 (DNS rebinding) cannot read the answers.
- A request with an `Origin` header (every cross-site POST from a browser, including the
  "simple" text/plain ones that skip the preflight) runs only from a loopback origin, the
  server's own origin at an address, or an `--cors-origins` entry. curl and the SDKs send
  no `Origin` and are not affected.
- API keys: any of `--api-key` and the lines of `--api-key-file`, compared in constant
  time; the file is read again on SIGHUP.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
from collections.abc import Iterable
from pathlib import Path
from urllib.parse import urlsplit

import attrs

log = logging.getLogger("butter")

ANY = "*"
# Preflight answers stay valid this long in the browser (seconds).
PREFLIGHT_MAX_AGE_SECONDS = 600
CORS_METHODS = "GET, HEAD, POST, OPTIONS"


def _ip(name: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(name)
    except ValueError:
        return None


def is_loopback_name(name: str) -> bool:
    """`localhost`, `*.localhost` (RFC 6761: always loopback), or a loopback address.
    Not 0.0.0.0: browsers reach the local machine through it too ("0.0.0.0 day")."""
    name = name.lower().rstrip(".")
    if name == "localhost" or name.endswith(".localhost"):
        return True
    address = _ip(name)
    return address is not None and address.is_loopback


def host_name(authority: str) -> str:
    """`example.com:8000` → `example.com`; `[::1]:8000` → `::1`; lowercased."""
    authority = authority.strip().lower()
    if authority.startswith("["):
        return authority[1:].partition("]")[0]
    if authority.count(":") > 1:  # a bare IPv6 address
        return authority
    return authority.partition(":")[0].rstrip(".")


def _matches(name: str, patterns: Iterable[str]) -> bool:
    """Exact names, `*`, and `.example.com` for the domain and every name below it."""
    for pattern in patterns:
        pattern = pattern.lower()
        if pattern == ANY or pattern == name:
            return True
        if pattern.startswith(".") and (name == pattern[1:] or name.endswith(pattern)):
            return True
    return False


def normalize_origin(origin: str) -> str:
    return origin.strip().lower().rstrip("/")


@attrs.frozen
class AccessPolicy:
    """The Host and Origin rules for one listening address (see the module docstring)."""

    bound_host: str = "127.0.0.1"
    allowed_hosts: tuple[str, ...] = ()
    cors_origins: tuple[str, ...] = ()

    @property
    def checks_host(self) -> bool:
        """Only a loopback listener knows which names it may be reached by: one on a LAN
        address is reached by whatever names the network gives it."""
        return is_loopback_name(self.bound_host) and ANY not in self.allowed_hosts

    @property
    def any_origin(self) -> bool:
        return ANY in self.cors_origins

    def host_allowed(self, host: str | None) -> bool:
        if not self.checks_host or not host:  # HTTP/1.0 without Host: not a browser
            return True
        name = host_name(host)
        return (is_loopback_name(name) or name == host_name(self.bound_host)
                or _matches(name, self.allowed_hosts))

    def origin_allowed(self, origin: str, host: str | None) -> bool:
        """`origin`: the request's Origin header; `host`: its Host header."""
        origin = normalize_origin(origin)
        if self.any_origin or origin in {normalize_origin(o) for o in self.cors_origins}:
            return True
        parts = urlsplit(origin)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            return False  # `null` (sandboxed frames, file: pages) and the like
        if is_loopback_name(parts.hostname):
            return True
        # The server's own page, reached at an address or an allowed name. Never by an
        # arbitrary name: under DNS rebinding the page's origin matches its Host too.
        same_origin = host is not None and parts.netloc == host.strip().lower()
        trusted_name = (_ip(parts.hostname) is not None
                        or _matches(parts.hostname, self.allowed_hosts))
        return same_origin and trusted_name

    def cors_headers(self, origin: str) -> dict[str, str]:
        """For a response to an allowed origin: the origin echoed, never `*`, so that pages
        that send credentials or an Authorization header can read it too."""
        return {"Access-Control-Allow-Origin": origin, "Vary": "Origin"}

    def preflight_headers(self, origin: str, requested_headers: str | None,
                          private_network: bool) -> dict[str, str]:
        headers = {
            **self.cors_headers(origin),
            "Access-Control-Allow-Methods": CORS_METHODS,
            "Access-Control-Max-Age": str(PREFLIGHT_MAX_AGE_SECONDS),
            "Vary": "Origin, Access-Control-Request-Method, Access-Control-Request-Headers",
        }
        if requested_headers:  # the origin is allowed: so is every header it asks for
            headers["Access-Control-Allow-Headers"] = requested_headers
        if private_network:  # Chrome's Private Network Access, from a public page
            headers["Access-Control-Allow-Private-Network"] = "true"
        return headers


class ApiKeys:
    """The keys a request may present: `--api-key` and the lines of `--api-key-file`
    (blank lines and `#` comments skipped). `reload()` reads the file again (SIGHUP)."""

    def __init__(self, keys: Iterable[str] = (), *, key_file: str | None = None) -> None:
        self._fixed = frozenset(key for key in keys if key)
        self.key_file = Path(key_file).expanduser() if key_file else None
        self._keys = self._fixed | self._read_file()

    @property
    def required(self) -> bool:
        """Whether requests must carry a key. A key file makes them required even while
        it holds none: an emptied file locks the server, it never opens it."""
        return bool(self._fixed) or self.key_file is not None

    def __len__(self) -> int:
        return len(self._keys)

    def _read_file(self) -> frozenset[str]:
        """OSError where the file cannot be read."""
        if self.key_file is None:
            return frozenset()
        lines = self.key_file.read_text(encoding="utf-8").splitlines()
        return frozenset(line.strip() for line in lines
                         if line.strip() and not line.lstrip().startswith("#"))

    def reload(self) -> None:
        """Read the key file again; on an error keep the keys in use, and log why."""
        try:
            keys = self._fixed | self._read_file()
        except (OSError, UnicodeDecodeError) as exc:
            log.error("could not reload --api-key-file %s (%s): keeping the %d key(s) in use",
                      self.key_file, exc, len(self._keys))
            return
        self._keys = keys
        log.info("reloaded --api-key-file %s: %d key(s)", self.key_file, len(keys))

    def accepts(self, given: str) -> bool:
        """Constant time in the key presented: every key is compared, and none is
        compared by its length first."""
        presented = given.encode()
        matched = False
        for key in self._keys:
            matched |= hmac.compare_digest(presented, key.encode())
        return matched

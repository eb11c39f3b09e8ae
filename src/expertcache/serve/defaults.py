"""What the command line (``cli/serve.py``) and the app (``serve/app.py``) both read, declared once here and
importable without torch, transformers or fastapi (``expertcache serve --help`` stays fast)."""

from __future__ import annotations

__all__ = ["DEFAULT_MAX_REQUEST_BYTES", "LOOPBACK_HOSTS", "is_loopback"]

#: the largest request body taken by default (``--max-request-bytes``), in bytes
DEFAULT_MAX_REQUEST_BYTES = 1 << 20

#: the names a loopback server answers to by default: a browser resolves them to this machine itself
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")


def is_loopback(host: str) -> bool:
    """Whether listening on ``host`` (``--host``) listens on this machine only: a name of :data:`LOOPBACK_HOSTS`,
    Debian's ``ip6-localhost`` (``::1`` in /etc/hosts), or a loopback address (127.0.0.0/8, ``::1``)."""
    import ipaddress

    if host in LOOPBACK_HOSTS or host == "ip6-localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False

"""The routing-trace format: per-token, per-layer router logits and selections, plus metadata."""

from expertcache.trace.format import FORMAT_VERSION, RoutingTrace, TraceError, TraceMeta, atomic_write_bytes

__all__ = ["FORMAT_VERSION", "RoutingTrace", "TraceError", "TraceMeta", "atomic_write_bytes"]

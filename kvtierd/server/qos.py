"""A request's QoS class: what it asks for, else its session's, else its tenant's default; capped per tenant."""

from __future__ import annotations

from kvtierd.engine.config import QOS_CLASSES
from kvtierd.server.settings import Settings

RANK = {c: i for i, c in enumerate(QOS_CLASSES)}  # 0: high


def request_class(settings: Settings, tenant: str, priority: str | None, session_class: str | None = None) -> str:
    """`priority` (the request's) > `session_class` > `[qos] tenant_classes` > normal, then lowered to
    `[qos] tenant_max_classes` when above it: an admin's cap cannot be asked around."""
    cls = priority or session_class or settings.tenant_classes.get(tenant) or "normal"
    cap = settings.tenant_max_classes.get(tenant)
    if cap is not None and RANK[cls] < RANK[cap]:
        return cap
    return cls

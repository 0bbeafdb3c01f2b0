"""Placement: which tenants this instance serves, and where the others belong.

One daemon per GPU (`kvtierd@N`, named by `[server] instance`), all reading one settings file whose
`[server] placement` says which instance each placed tenant belongs to; tenants not placed may use any
instance (nginx hashes their conversations over the instances: deploy/nginx/kvtierd-placement.conf).
`[server] tenants`, when set, is an instance's own allow-list. A request that reaches an instance its
tenant is not served by (a misrouted front, a stale map) is refused with 421 naming where it belongs, so
it is never served from another instance's cache and never silently fills this one's. Admin routes, the
health check and /metrics answer whatever the tenant.
"""

from __future__ import annotations

from typing import Any

from kvtierd.server.errors import ApiError


def parse_tenant_list(value: Any) -> tuple[str, ...]:
    """`"alice, bob"` -> ("alice", "bob"); "" -> () (every tenant)."""
    return tuple(dict.fromkeys(t.strip() for t in str(value).split(",") if t.strip()))


def parse_placement(value: Any) -> dict[str, str]:
    """`"bob=gpu1,carol=gpu1"` -> tenant -> the instance that serves it."""
    out = {}
    for item in filter(None, (i.strip() for i in str(value).split(","))):
        tenant, _, instance = item.partition("=")
        if not tenant.strip() or not instance.strip():
            raise ValueError(f"{item!r} is not tenant=instance")
        out[tenant.strip()] = instance.strip()
    return out


def placed_here(instance: str, placement: dict[str, str]) -> list[str]:
    return sorted(t for t, where in placement.items() if where == instance)


def refusal(tenant: str, instance: str, placement: dict[str, str], tenants: tuple[str, ...]) -> ApiError | None:
    """None when this instance serves `tenant`, else the 421 that says where it belongs."""
    here = f"instance {instance!r}" if instance else "this instance"
    where = placement.get(tenant)
    if where is not None and where != instance:
        message = f"tenant {tenant!r} is placed on instance {where!r}, not {here}; send its requests there"
    elif tenants and tenant not in tenants:
        message = f"tenant {tenant!r} is not served by {here} (it serves {', '.join(tenants)}); ask the operator " \
                  "where it is placed"
    else:
        return None
    return ApiError(421, message, type="invalid_request_error", code="tenant_placed_elsewhere")

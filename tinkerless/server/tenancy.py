"""Tenant isolation on a shared worker: every policy name a tenant sends is scoped to it.

The server rewrites `policy` fields on the way in (`alice`'s "default" becomes
`<tenant-hash>_default` on the worker) and back on the way out, and lists only
the tenant's own policies. A tenant therefore cannot name, read or train another
tenant's adapters: whatever name it sends lands inside its own prefix. The base
model ("base") is shared read-only.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
from typing import Any, Callable

from tinkerless.wire.messages import BASE_POLICY


_SCOPED_NAME = re.compile(r"t[0-9a-f]{12}_")  # what tenant_prefix makes


def tenant_prefix(tenant: str) -> str:
    # Fixed-length hex keeps prefixes distinct and free of the separator, so scoping is injective.
    return "t" + hashlib.sha256(tenant.encode()).hexdigest()[:12] + "_"


def scope(value: Any, prefix: str) -> Any:
    """Prefix every policy name inside a request."""
    return _rewrite(value, lambda name: name if name in (None, BASE_POLICY) else prefix + name)


def unscope(value: Any, prefix: str) -> Any:
    """Strip the tenant prefix from policy names in a reply; keep only the tenant's own policies in listings."""
    if isinstance(value, dict) and isinstance(value.get("policies"), dict):
        value = {**value, "policies": {k[len(prefix):]: v for k, v in value["policies"].items() if k.startswith(prefix)}}
    return _rewrite(value, lambda name: name[len(prefix):] if isinstance(name, str) and name.startswith(prefix) else name)


def _rewrite(value: Any, rename) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        changes = {}
        for f in dataclasses.fields(value):
            current = getattr(value, f.name)
            if f.name == "policy" and (current is None or isinstance(current, str)):
                changes[f.name] = rename(current)
            else:
                changes[f.name] = _rewrite(current, rename)
        return dataclasses.replace(value, **changes)
    if isinstance(value, list):
        return [_rewrite(v, rename) for v in value]
    if isinstance(value, dict):
        return {k: (rename(v) if k == "policy" and isinstance(v, str) else _rewrite(v, rename)) for k, v in value.items()}
    return value


def policy_quota(worker: Any, limits: Any) -> Callable[[str], None]:
    """The worker's `policy_guard` on a shared server: a tenant's new policy is refused once the tenant holds
    `limits.max_policies_per_tenant` policies. The server's own adapter slots (OpenAI adapters, Tinker sampler
    snapshots) carry no tenant prefix: their caches bound them."""

    def guard(name: str) -> None:
        scoped = _SCOPED_NAME.match(name)
        if scoped is not None:
            limits.check_policies(sum(p.startswith(scoped.group(0)) for p in worker.policies))

    return guard

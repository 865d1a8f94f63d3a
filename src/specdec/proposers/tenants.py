"""What a proposer learns across requests, kept per tenant (docs/security.md): suffix decoding's
cache and scored copying's corpus of earlier requests. A request drafts from its own tenant's
earlier text only: another tenant's would show through the acceptance counts a response reports."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class PerTenant(Generic[T]):
    """One T per tenant (server/guards.py: an API key, or a trusted header), made on first use by
    `make`; the MAX_TENANTS most recently used are kept."""

    MAX_TENANTS = 64

    def __init__(self, make: Callable[[], T]) -> None:
        self._make = make
        self._held: OrderedDict[str | None, T] = OrderedDict()

    def for_tenant(self, tenant: str | None) -> T:
        held = self._held.pop(tenant, None)  # (an empty cache may be falsy: no `or` here)
        if held is None:
            held = self._make()
        self._held[tenant] = held  # most recent last
        while len(self._held) > self.MAX_TENANTS:
            self._held.popitem(last=False)
        return held

    def clear(self) -> None:
        self._held.clear()

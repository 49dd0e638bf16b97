"""The plan cache every op shares: what a call's metadata (shapes, strides, dtypes, devices, scalar
arguments) decided, keyed by that metadata, so that later calls with the same metadata skip the
checks and only fill in pointers. Each op builds its own key; this holds the plans."""
from __future__ import annotations

from typing import Any


class PlanCache(dict):
    """A dict of plans that forgets everything once it holds `limit` (a workload has few distinct
    metadata; a stream of new shapes must not grow it without bound)."""

    def __init__(self, limit: int = 256):
        super().__init__()
        self.limit = limit

    def remember(self, key: Any, plan: Any) -> Any:
        if key is not None:
            if len(self) >= self.limit:
                self.clear()
            self[key] = plan
        return plan

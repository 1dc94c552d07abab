"""The bounded recently-seen id list of the multicast algorithm (step 4-5), insertion-ordered."""

from __future__ import annotations

from collections import OrderedDict


class SeenIds:
    """A set of message ids that forgets the oldest once it holds ``capacity`` ids."""

    __slots__ = ("ids", "capacity")

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError("capacity must be at least 1")
        self.capacity = capacity
        # The ids, oldest first. Read it directly where every message is looked up (``mid in seen.ids`` costs
        # no Python call); change it only through add().
        self.ids: OrderedDict[bytes, None] = OrderedDict()

    def __contains__(self, mid: object) -> bool:
        return mid in self.ids

    def __len__(self) -> int:
        return len(self.ids)

    def add(self, mid: bytes) -> None:
        """Remember ``mid``, evicting the oldest id when full."""
        ids = self.ids
        if mid in ids:
            return
        ids[mid] = None
        if len(ids) > self.capacity:
            ids.popitem(last=False)

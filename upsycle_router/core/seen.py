"""The bounded recently-seen id list of the multicast algorithm (step 4-5), insertion-ordered."""

from __future__ import annotations

from collections import OrderedDict


class SeenIds:
    """A set of message ids that forgets the oldest once it holds ``capacity`` ids."""

    __slots__ = ("_ids", "capacity")

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError("capacity must be at least 1")
        self.capacity = capacity
        self._ids: OrderedDict[bytes, None] = OrderedDict()

    def __contains__(self, mid: object) -> bool:
        return mid in self._ids

    def __len__(self) -> int:
        return len(self._ids)

    def add(self, mid: bytes) -> None:
        """Remember ``mid``, evicting the oldest id when full."""
        if mid in self._ids:
            return
        self._ids[mid] = None
        if len(self._ids) > self.capacity:
            self._ids.popitem(last=False)

"""The bounded recently-seen id list of the multicast algorithm (step 4-5), insertion-ordered."""

from __future__ import annotations

from collections import deque


class SeenIds:
    """A set of message ids that forgets the oldest once it holds ``capacity`` ids."""

    __slots__ = ("ids", "_order", "capacity", "added")

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError("capacity must be at least 1")
        self.capacity = capacity
        # The ids. Read it directly where every message is looked up (``mid in seen.ids`` costs no Python call);
        # change it only through add(). ``_order`` holds them oldest first. (A set and a deque cost a third
        # less per id than an OrderedDict, which keeps a linked list besides its table.)
        self.ids: set[bytes] = set()
        self._order: deque[bytes] = deque()
        self.added = 0  # ids added so far (a mark for forget_since)

    def __contains__(self, mid: object) -> bool:
        return mid in self.ids

    def __len__(self) -> int:
        return len(self.ids)

    def add(self, mid: bytes) -> None:
        """Remember ``mid``, forgetting the oldest id when full."""
        ids = self.ids
        if mid in ids:
            return
        ids.add(mid)
        self.added += 1
        order = self._order
        order.append(mid)
        if len(order) > self.capacity:
            ids.discard(order.popleft())

    def discard(self, mid: bytes) -> None:
        """Forget ``mid`` (a message taken and then refused by the next router: sent again, it is routed anew). Its
        place in the order stays until it comes round, when it is discarded again - harmless: ``mid`` is then at
        most forgotten sooner than the capacity says, which makes a duplicate routed, never a message lost."""
        self.ids.discard(mid)

    def forget_since(self, mark: int) -> None:
        """Forget the ids added since ``added`` was ``mark`` (those still remembered: the newest)."""
        order = self._order
        for _ in range(min(self.added - mark, len(order))):
            self.ids.discard(order.pop())
        self.added = min(self.added, mark)

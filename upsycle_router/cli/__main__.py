"""``python -m upsycle_router.cli`` runs the CLI (as ``python -m upsycle_router`` and ``upsycle-router`` do)."""

from __future__ import annotations

import sys

from upsycle_router.cli import main

if __name__ == "__main__":
    sys.exit(main())

"""The strangers' pipeline bound counts each run by the flag it was added with (real verifier, inline): a reload
that makes a connected key trusted (or a stranger) between two reads of it must not join them into one run, or
the count goes wrong - what was added as bounded is taken off exactly once, and nothing else is."""

from __future__ import annotations

import time

from upsycle_router.crypto import Identity, sign_message
from upsycle_router.expiry import exp_in
from upsycle_router.runtime.pipeline import Run, VerifyPipeline
from upsycle_router.runtime.verify import Verifier
from upsycle_router.wire.messages import Message, UnicastHeader


def _msgs(n: int) -> list[Message]:
    a, b = Identity.generate(), Identity.generate()
    now = time.time()
    return [sign_message(UnicastHeader(a.public, b.public, 60, exp_in(now, 60)), b"%d" % i, a) for i in range(n)]


def test_a_connections_reads_with_another_bound_flag_are_runs_of_their_own() -> None:
    verifier = Verifier(0)
    try:
        p = VerifyPipeline(verifier, {"bad_signature_total": 0})
        p.add_messages(7, _msgs(3), bounded=True)  # a stranger's ...
        p.add_messages(7, _msgs(2), bounded=False)  # ... trusted now (a reload): not counted
        p.add_messages(7, _msgs(1), bounded=False)  # (joined: the same flag)
        assert [(r.bounded, len(r.msgs)) for r in p.pending if isinstance(r, Run)] == [(True, 3), (False, 3)]
        assert p.bounded_total == 3
        p.seal(None, lambda _f: None, inline=True)
        events, _ = p.take(1000)
        assert sum(len(e.messages) for e in events) == 6  # type: ignore[attr-defined]
        assert p.bounded_total == 0
    finally:
        verifier.close()

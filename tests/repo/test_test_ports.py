"""The tests' listening ports come from below the kernel's ephemeral range (tests/support/netutil.py): a daemon that
restarts on its fixed port cannot find it taken by some connection's source port meanwhile (CI: "Address already
in use" when a node of a network came back)."""

from __future__ import annotations

import socket

from netutil import HOST, PORT_RANGE_FILE, PortReservation, free_port, listen_ports


def test_listeners_take_ports_below_the_range_source_ports_come_from() -> None:
    low, high = (int(x) for x in PORT_RANGE_FILE.read_text().split()[:2])
    ports = listen_ports()
    assert ports and ports.stop == low and ports.start >= 1024
    reserved = PortReservation()
    try:
        taken = [reserved.take() for _ in range(20)]
        assert len(set(taken)) == 20 and all(p in ports for p in taken)
    finally:
        reserved.release()
    assert free_port() in ports
    with socket.socket() as server:  # and a connection's own port is never one of them
        server.bind((HOST, 0))
        server.listen(64)
        clients = [socket.create_connection(server.getsockname(), timeout=5) for _ in range(20)]
        try:
            assert all(low <= c.getsockname()[1] <= high and c.getsockname()[1] not in ports for c in clients)
        finally:
            for c in clients:
                c.close()

"""End-to-end: a real daemon whose store is damaged between two runs refuses to start - exit 2 within seconds,
one line on stderr naming ``data.mdb`` - instead of dying of SIGBUS or starting empty; ``store check`` tells a
sound store (exit 0, while the daemon runs) from a damaged one (exit 2); a backup taken while the daemon runs,
restored after the damage, gives an offline subscriber every message it was waiting for."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
from pathlib import Path

import lmdb
import pytest
from conftest import Daemon, DaemonFactory, cli

from upsycle_router.client import Client
from upsycle_router.crypto import Identity

pytestmark = pytest.mark.slow

REFUSE_TIMEOUT = 10.0  # a refusing daemon exits well within this


async def wait_offline(d: Daemon, sender: Client, dst: bytes) -> None:
    await d.wait_offline(lambda body: sender.send(dst, body, ttl=0), dst)


async def queue_for_offline_subscriber(d: Daemon) -> tuple[Identity, list[bytes]]:
    """A subscriber joins a group and goes away; two unicast and three group messages are queued for it."""
    group, sub_id = Identity.generate(), Identity.generate()
    sub = await Client.connect(d.sock, sub_id, timeout=5)
    assert await sub.join(group.public)
    await sub.close()
    pub = await Client.connect(d.sock, Identity.generate(), timeout=5)
    try:
        await wait_offline(d, pub, sub_id.public)
        sent = [
            await pub.send(sub_id.public, b"unicast one", ttl=3600),
            await pub.publish(group, b"group one", ttl=3600),
            await pub.publish(group, b"group two", ttl=3600),
            await pub.send(sub_id.public, b"unicast two", ttl=3600),
            await pub.publish(group, b"group three", ttl=3600),
        ]
        await pub.sync()
        for mid in sent:
            await d.wait_trace(event="queued", id=mid, dst=sub_id.public)
    finally:
        await pub.close()
    return sub_id, sent


def start_expecting_refusal(d: Daemon) -> subprocess.CompletedProcess[str]:
    """Run the daemon's command on its damaged store: it must exit by itself, soon."""
    return d.run_expecting_exit(timeout=REFUSE_TIMEOUT)


def assert_refused(r: subprocess.CompletedProcess[str], what: str) -> None:
    assert r.returncode == 2, f"exit {r.returncode} (negative: killed by a signal)\n{r.stdout}\n{r.stderr}"
    assert "Traceback" not in r.stderr + r.stdout, r.stderr
    naming = [line for line in r.stderr.splitlines() if "data.mdb" in line]
    assert len(naming) == 1, r.stderr
    line = naming[0]
    assert line.startswith("error: ") and what in line, line
    assert "store restore" in line and "store check" in line, line


def damage(data: Path, how: str) -> None:
    size = data.stat().st_size
    if how == "empty":
        os.truncate(data, 0)
    elif how == "half":
        os.truncate(data, size // 2 // 4096 * 4096)
    elif how == "deleted":
        data.unlink()
    elif how == "pages":  # every page after the meta pages overwritten with random bytes
        with open(data, "r+b") as f:
            f.seek(2 * 4096)
            f.write(os.urandom(size - 2 * 4096))
    else:
        raise AssertionError(how)


@pytest.mark.parametrize(("how", "what"), [("empty", "empty (0 bytes)"), ("half", "truncated"),
                                           ("deleted", "missing"), ("pages", "overwritten")])
async def test_a_damaged_store_is_refused_with_one_line_and_exit_2(
    daemon: DaemonFactory, how: str, what: str
) -> None:
    d = daemon()
    await queue_for_offline_subscriber(d)
    d.stop()
    assert cli("store", "check", "--data-dir", str(d.dir)).returncode == 0
    data = d.dir / "store" / "data.mdb"
    damage(data, how)
    assert_refused(start_expecting_refusal(d), what)
    if how != "deleted":
        assert data.stat().st_size < 2 * 4096 or how in ("half", "pages")  # nothing written: not started empty
    check = cli("store", "check", "--data-dir", str(d.dir))
    assert check.returncode == 2, check.stdout + check.stderr
    assert "DAMAGED" in check.stdout
    assert_refused(start_expecting_refusal(d), what)  # (and again: no state left behind that would let it start)


@pytest.mark.parametrize(
    ("table", "key", "value"), [("meta", b"seq", b"\x00" * 7), ("sqstats", b"\x0a" * 32, b"\x00" * 5)]
)
async def test_a_record_that_does_not_decode_is_refused_with_one_line_and_exit_2(
    daemon: DaemonFactory, table: str, key: bytes, value: bytes
) -> None:
    """LMDB's file is sound but a record the router reads whole when it opens the store does not decode (the
    next sequence number; a recipient's count of strangers' entries): one line, exit 2, no traceback, and
    store check names the record."""
    d = daemon()
    await queue_for_offline_subscriber(d)
    d.stop()
    env = lmdb.open(str(d.dir / "store"), max_dbs=32)
    try:
        with env.begin(write=True) as txn:
            txn.put(key, value, db=env.open_db(table.encode(), txn=txn, create=False))
    finally:
        env.close()
    check = cli("store", "check", "--data-dir", str(d.dir))
    assert check.returncode == 1 and f"is {len(value)} bytes, not" in check.stdout, check.stdout + check.stderr
    r = start_expecting_refusal(d)  # (the file was written by another program: the start walks it first, INFO)
    assert r.returncode == 2 and "Traceback" not in r.stderr + r.stdout, f"exit {r.returncode}\n{r.stderr}"
    errors = [line for line in r.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "data.mdb: a record does not decode" in errors[0], r.stderr
    assert "store restore" in errors[0] and "store check" in errors[0], errors


async def test_backup_while_running_then_restore_after_damage_gives_the_messages_back(
    daemon: DaemonFactory, tmp_path: Path
) -> None:
    d = daemon()
    sub_id, sent = await queue_for_offline_subscriber(d)
    data_dir = str(d.dir)
    check = cli("store", "check", "--data-dir", data_dir)  # while it runs
    assert check.returncode == 0, check.stdout + check.stderr
    assert "OK" in check.stdout
    bk = tmp_path / "router-store.backup"
    r = cli("store", "backup", str(bk), "--data-dir", data_dir)  # while it runs
    assert r.returncode == 0, r.stderr
    assert bk.is_file() and "backed up" in r.stdout
    r = cli("store", "restore", str(bk), "--data-dir", data_dir, "--force")  # refused: the router runs
    assert r.returncode == 1 and "running" in r.stderr, r.stderr
    assert d.running
    d.stop()
    damage(d.dir / "store" / "data.mdb", "half")
    assert_refused(start_expecting_refusal(d), "truncated")
    r = cli("store", "restore", str(bk), "--data-dir", data_dir)
    assert r.returncode == 0, r.stdout + r.stderr
    assert list((d.dir / "store").glob("data.mdb.damaged-*")), "the damaged file was not kept"
    assert cli("store", "check", "--data-dir", data_dir).returncode == 0
    d.start()
    sub = await Client.connect(d.sock, sub_id, timeout=5)
    try:
        got = [await sub.recv(timeout=5) for _ in sent]
        assert [m.id for m in got] == sent
        assert [m.body for m in got] == [b"unicast one", b"group one", b"group two", b"unicast two", b"group three"]
    finally:
        await sub.close()


async def test_messages_changed_on_the_disk_are_dropped_as_damage_and_the_rest_delivered(daemon: DaemonFactory) -> None:
    """A byte of two stored messages changes while the daemon is stopped (every copy in the file, as bit rot
    would leave them; the file itself stays sound): store check names both (exit 1); the daemon starts, and the
    subscriber gets the three intact messages in order - never the changed ones under their old ids -, while
    the daemon logs each drop at ERROR and counts it as store_damaged."""
    d = daemon()
    sub_id, sent = await queue_for_offline_subscriber(d)
    d.stop()
    data = d.dir / "store" / "data.mdb"
    raw = bytearray(data.read_bytes())
    for body in (b"unicast two", b"group two"):
        at, n = raw.find(body), 0
        while at >= 0:
            raw[at] ^= 0x20  # 'u' -> 'U', 'g' -> 'G'
            n += 1
            at = raw.find(body, at + 1)
        assert n >= 1, body
    data.write_bytes(bytes(raw))
    check = cli("store", "check", "--data-dir", str(d.dir))
    assert check.returncode == 1, check.stdout + check.stderr
    assert check.stdout.count("its bytes do not match its id") == 2, check.stdout
    d.start()
    sub = await Client.connect(d.sock, sub_id, timeout=5)
    try:
        got = [await sub.recv(timeout=5) for _ in range(3)]
        assert [m.id for m in got] == [sent[0], sent[1], sent[4]]
        assert [m.body for m in got] == [b"unicast one", b"group one", b"group three"]
        with pytest.raises(TimeoutError):
            await sub.recv(timeout=0.5)
    finally:
        await sub.close()
    for mid in (sent[3], sent[2]):
        await d.wait_trace(event="dropped", id=mid, reason="store_damaged", dst=sub_id.public)
    errors = [ln for ln in d.log_text().splitlines() if " ERROR " in ln and "damaged in the store" in ln]
    assert len(errors) == 2, d.log_text()
    status = cli("status", "--json", "--socket", str(d.sock))
    assert status.returncode == 0 and '"dropped_store_damaged_total": 2' in status.stdout, status.stdout


def overflow_pages(data: Path, table: str) -> tuple[int, list[int]]:
    """The page size and the first pages of the values of ``table`` too large for a leaf page (LMDB keeps each on
    pages of its own, "overflow" pages, read only when the value is): from the table's leaf pages, each node
    with F_BIGDATA (0x01) holds its value's first page number."""
    from upsycle_router.store.integrity import leaf_pages

    with open(data, "rb") as f:
        psize, leaves = leaf_pages(f.fileno(), data.stat().st_size, table)
        firsts = []
        for pgno in leaves:
            f.seek(pgno * psize)
            page = f.read(psize)
            lower = int.from_bytes(page[12:14], "little")
            for i in range(16, lower, 2):
                node = int.from_bytes(page[i : i + 2], "little")
                flags, ksize = (int.from_bytes(page[node + k : node + k + 2], "little") for k in (4, 6))
                if flags & 0x01:
                    firsts.append(int.from_bytes(page[node + 8 + ksize : node + 16 + ksize], "little"))
    return psize, firsts


async def _drain_until_it_exits(d: Daemon, sub_id: Identity, read_for: float) -> tuple[int, str]:
    """The subscriber ``sub_id`` connects (its queue is read from the store) and the daemon exits by itself: its
    exit status and log (the process reaped)."""
    assert d.proc is not None
    with contextlib.suppress(Exception):  # (the connection may end as the daemon stops)
        sub = await Client.connect(d.sock, sub_id, timeout=5)
        with contextlib.suppress(Exception):
            await sub.recv(timeout=read_for)
        await sub.close()
    rc = await asyncio.wait_for(asyncio.to_thread(d.proc.wait, 20), 25)
    log = d.log_text()
    d.kill()  # (reaps it)
    return rc, log


async def test_damage_found_while_running_stops_the_daemon_and_the_next_start_refuses(daemon: DaemonFactory) -> None:
    """Silent damage after a clean stop: the pages of the queued messages made pages of no kind (what a disk's
    bit rot can do), with the file's size, inode and modification time kept - so the start
    skips its walk (the clean close's record still matches). (From a black-box audit: the router then answered
    the subscriber ERROR 6 "store error" at each connect, went on acknowledging messages into a queue it could
    not drain, said /healthz ok, and marked the store clean again at its stop.) Now the first transaction that
    meets the damage stops the daemon: one CRITICAL line, exit 2 with one line naming data.mdb; it is not
    marked clean, so the next start walks the store and refuses it, as store check does."""
    d = daemon()
    sub_id = Identity.generate()
    pub = await Client.connect(d.sock, Identity.generate(), timeout=5)
    await (await Client.connect(d.sock, sub_id, timeout=5)).close()  # (connected once: a local app, queued for)
    await wait_offline(d, pub, sub_id.public)
    await pub.sync()  # (the probes' refusals: ttl 0 to an app away)
    for k in range(6):
        await pub.send(sub_id.public, b"%d " % k + os.urandom(8000), ttl=3600)
    assert (await pub.sync()).ok
    await pub.close()
    d.stop()
    data = d.dir / "store" / "data.mdb"
    st = data.stat()
    psize, pages = overflow_pages(data, "msgs")
    assert len(pages) == 6, pages
    with open(data, "r+b") as f:
        for pgno in pages:
            f.seek(pgno * psize + 10)  # the page's flags (P_OVERFLOW): none
            f.write(b"\x00\x00")
    os.utime(data, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert (data.stat().st_size, data.stat().st_mtime_ns, data.stat().st_ino) == (st.st_size, st.st_mtime_ns,
                                                                                 st.st_ino)  # fmt: skip
    await d.start_async()
    rc, log = await _drain_until_it_exits(d, sub_id, 2)  # (the connection may end as the daemon stops)
    assert rc == 2, f"exit {rc}\n{log}"
    assert "CRITICAL" in log and "store damaged" in log, log
    errors = [line for line in log.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "data.mdb" in errors[0] and "damage" in errors[0], log
    assert_refused(start_expecting_refusal(d), "")  # not marked clean: the next start walks and refuses
    check = cli("store", "check", "--data-dir", str(d.dir))
    assert check.returncode == 2 and "DAMAGED" in check.stdout, check.stdout + check.stderr


async def test_a_store_of_a_newer_schema_is_refused_with_one_line_and_exit_2(daemon: DaemonFactory) -> None:
    """A store a newer version wrote (its schema record says 6): `run` exits 2 with one line saying so (exit 1
    would have systemd retry it for ever; before, a RuntimeError with Python's bytes repr), and `store check`
    exits 2 saying it is not supported, not that the tables disagree."""
    d = daemon()
    d.stop()
    env = lmdb.open(str(d.dir / "store"), max_dbs=32)
    try:
        with env.begin(write=True) as txn:
            txn.put(b"schema", b"6", db=env.open_db(b"meta", txn=txn, create=False))
    finally:
        env.close()
    r = start_expecting_refusal(d)
    assert r.returncode == 2 and "Traceback" not in r.stderr + r.stdout, f"exit {r.returncode}\n{r.stderr}"
    errors = [line for line in r.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "data.mdb: the store's schema is '6'" in errors[0] and "b'" not in errors[0], errors
    assert "a newer version wrote it" in errors[0] and "move the store away" in errors[0], errors
    check = cli("store", "check", "--data-dir", str(d.dir))
    assert check.returncode == 2, check.stdout + check.stderr
    assert "NOT SUPPORTED: the store's schema is '6'" in check.stdout and "INCONSISTENT" not in check.stdout


async def test_a_store_file_cut_short_under_the_running_router_leaves_a_line_in_its_log(daemon: DaemonFactory) -> None:
    """data.mdb truncated while the router runs: its memory map then ends before the pages it reads, and the
    process gets SIGBUS - nothing Python can turn into an exception. (An audit: it ended with signal 7 and
    nothing in the log.) The fault handler writes a line and the stacks first; the next start refuses the
    store, exit 2 (as before)."""
    d = daemon()
    sub_id = Identity.generate()
    pub = await Client.connect(d.sock, Identity.generate(), timeout=5)
    await (await Client.connect(d.sock, sub_id, timeout=5)).close()  # (connected once: a local app, queued for)
    await wait_offline(d, pub, sub_id.public)
    await pub.sync()
    for k in range(40):
        await pub.send(sub_id.public, b"%d " % k + os.urandom(8000), ttl=3600)
    assert (await pub.sync()).ok
    await pub.close()
    os.truncate(d.dir / "store" / "data.mdb", 0)
    rc, log = await _drain_until_it_exits(d, sub_id, 5)  # (the subscriber's queue is read from the map: the fault)
    assert rc == -7, f"exit {rc}\n{log}"
    assert "Fatal Python error: Bus error" in log, log
    assert_refused(start_expecting_refusal(d), "")


async def test_a_reader_killed_while_it_read_the_store_is_freed_by_the_running_router(daemon: DaemonFactory) -> None:
    """A process that dies inside a read transaction of the store (a ``store backup`` killed by a cron timeout or
    the OOM killer) leaves its slot in LMDB's reader table, and LMDB reuses no page that reader could see: a
    store holding nothing filled up, refused ``store_full`` and failed drains with MDB_MAP_FULL (an audit). The
    running router frees such slots within seconds, logs it and counts it."""
    import signal
    import sys

    d = daemon()
    reader = subprocess.Popen(
        [sys.executable, "-c", "import lmdb, sys, time\n"
         f"env = lmdb.open({str(d.dir / 'store')!r}, readonly=True, max_dbs=32)\n"
         "txn = env.begin()\nprint('reading', flush=True)\ntime.sleep(60)\n"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert reader.stdout is not None and reader.stdout.readline().strip() == "reading"
        os.kill(reader.pid, signal.SIGKILL)
    finally:
        reader.wait(10)
        assert reader.stdout is not None
        reader.stdout.close()
    for _ in range(100):
        if "freed 1 reader slot(s) of a process that died" in d.log_text():
            break
        await asyncio.sleep(0.1)
    assert "freed 1 reader slot(s) of a process that died" in d.log_text()
    async with await Client.connect(d.sock, Identity.generate()) as c:
        assert (await c.status())["store_stale_readers_cleared_total"] == 1


async def test_a_map_size_below_the_stores_file_is_refused_by_run_and_config(daemon: DaemonFactory) -> None:
    """``store.map_size`` lowered below the size the store's file has grown to: LMDB opens the file at its own size,
    full - an audit: the router started in silence, then every drain failed with MDB_MAP_FULL (the same messages
    sent again without end) and nothing expired. ``run`` and ``config`` refuse it with one line naming both sizes
    and what to do; the store is left as it was, and the router starts again with a size that fits."""
    d = daemon()
    pub = await Client.connect(d.sock, Identity.generate(), timeout=5)
    away = Identity.generate()
    async with await Client.connect(d.sock, away):
        pass
    for i in range(300):
        await pub.send(away.public, b"%04d" % i + b"x" * 3000, ttl=3600)
    assert (await pub.sync()).ok
    await pub.close()
    d.stop()
    data = d.dir / "store" / "data.mdb"
    size, before = data.stat().st_size, data.read_bytes()
    assert size > 1 << 20
    d.write_config({"store": {"map_size": 1 << 20}})
    r = start_expecting_refusal(d)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    [line] = [x for x in r.stderr.splitlines() if x.startswith("error: ")]
    assert "store.map_size" in line and f"at least {size}" in line and "store backup" in line, line
    c = cli("config", "--config", str(d.config_path), "--data-dir", str(d.dir))
    assert c.returncode == 2 and f"at least {size}" in c.stderr, c.stdout + c.stderr
    assert data.read_bytes() == before
    d.write_config({"store": {"map_size": size}})
    d.start()
    async with await Client.connect(d.sock, away) as again:
        got = 0
        while got < 300:
            await again.recv(timeout=10)
            got += 1

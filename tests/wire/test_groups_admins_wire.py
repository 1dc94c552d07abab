"""Wire values of groups with several admins: the GROUP_OP application body (type 13, ``upsycle.cddl``), the
welcome's history fields and the key share (``groups.cddl``): round trips, the schemas, strict decoding that
names the field, and a version 1 welcome that still decodes byte for byte."""

from __future__ import annotations

from functools import cache
from typing import Any

import cbor2
import pycddl
import pytest

from upsycle_router.crypto import Identity, sign_app_message
from upsycle_router.errors import RemoteProtocolError
from upsycle_router.wire import cddl_text
from upsycle_router.wire.app import (
    OP_ADD,
    OP_REMOVE,
    OP_ROTATE,
    AppHeader,
    AppMessage,
    GroupOp,
    decode_app_message,
)
from upsycle_router.wire.cbor import enc
from upsycle_router.wire.groups import (
    History,
    KeyShare,
    KeyShareMessage,
    OpRecord,
    SharedEpoch,
    Welcome,
    decode_key_share,
    decode_key_share_message,
    decode_welcome,
)

K1, K2, K3 = b"\x01" * 32, b"\x02" * 32, b"\x03" * 32
H1 = b"\xaa" * 32
S1, S2 = b"\x11" * 32, b"\x22" * 32


@cache
def schema(file: str, root: str) -> pycddl.Schema:
    return pycddl.Schema(f"root = {root}\n" + cddl_text(file))


def valid(file: str, root: str, data: bytes) -> bool:
    try:
        schema(file, root).validate_cbor(data)
    except pycddl.ValidationError:
        return False
    return True


def app(body: GroupOp) -> bytes:
    key = Identity.from_seed(b"\x05" * 32)
    return sign_app_message(AppMessage(AppHeader((H1,), key.public, K3, 9), body), key).encode()


@pytest.mark.parametrize("body", [
    GroupOp(OP_ADD, (K1, K2), ((K1, 3),)),
    GroupOp(OP_REMOVE, (K2,), ((K1, 3), (K2, 1)), b"sealed boxes"),
    GroupOp(OP_ROTATE, (), (), b"sealed boxes"),
])  # fmt: skip
def test_group_op_round_trip_and_cddl(body: GroupOp) -> None:
    data = app(body)
    assert decode_app_message(data).body == body
    assert valid("upsycle.cddl", "app-message", data)


@pytest.mark.parametrize(("value", "field"), [
    ({"op": 6, "mem": [K1], "past": []}, "op"),
    ({"op": 1, "mem": [K2, K1], "past": []}, "mem"),
    ({"op": 1, "mem": [], "past": []}, "mem"),
    ({"op": 5, "mem": [K1], "past": [], "keys": b""}, "mem"),
    ({"op": 2, "mem": [K1], "past": []}, "keys"),
    ({"op": 1, "mem": [K1], "past": [], "keys": b""}, "keys"),
    ({"op": 1, "mem": [K1], "past": [[K1, 0]]}, "past"),
    ({"op": 1, "mem": [K1], "past": [[K2, 1], [K1, 1]]}, "past"),
    ({"op": 1, "mem": [K1]}, "past"),
    ({"op": 1, "mem": [K1], "past": [], "x": 1}, "x"),
])  # fmt: skip
def test_group_op_errors_name_the_field(value: dict[str, Any], field: str) -> None:
    key = Identity.from_seed(b"\x05" * 32)
    header = {"deps": [], "from": key.public, "to": K3, "seq": 1, "sig": b"\x00" * 64}
    with pytest.raises(RemoteProtocolError) as e:
        decode_app_message(enc([header, [13, value]]))
    assert e.value.field == field


def welcome(**over: Any) -> Welcome:
    v: dict[str, Any] = dict(gid=K3, admin=K1, mem=(K1, K2), epoch=2, gseed=S1, ckey=S2, adm=7,
                             vv=((K1, 7), (K2, 3)), base=(H1,))  # fmt: skip
    v.update(over)
    return Welcome(**v)


HIST = History((), (K1,), (K1,), 0, (
    OpRecord(K1, 1, OP_ADD, (K2,), (), 0, True),
    OpRecord(K1, 4, 3, (K2,), ((K1, 1),)),
    OpRecord(K2, 2, OP_REMOVE, (K3,), ((K1, 4),), 1),
))  # fmt: skip


def test_a_version_1_welcome_is_unchanged() -> None:
    w = welcome()
    data = w.encode()
    assert set(cbor2.loads(data)) == {"gid", "admin", "mem", "epoch", "gseed", "ckey", "adm", "vv", "base"}
    assert decode_welcome(data) == w and w.hist is None
    assert valid("groups.cddl", "welcome", data)


def test_a_welcome_with_history_round_trips() -> None:
    w = welcome(admin=K2, creator=K1, hist=HIST, opv=((K1, 4), (K2, 2)), keys=((K2, 2, S1, S2),))
    data = w.encode()
    assert decode_welcome(data) == w
    assert valid("groups.cddl", "welcome", data)
    same = welcome(hist=HIST, creator=K1, opv=((K1, 4),))  # the creator is the admin: not repeated
    assert "creator" not in cbor2.loads(same.encode()) and decode_welcome(same.encode()).creator is None


@pytest.mark.parametrize(("change", "field"), [
    (lambda m: m.pop("opv"), "opv"),
    (lambda m: m.update(creator=K2), "creator"),
    (lambda m: m["hist"]["ops"][0].__setitem__(2, 9), "kind"),
    (lambda m: m["hist"]["ops"][0].__setitem__(6, 1), "legacy"),
    (lambda m: m["hist"].update(mem=[]), "mem"),
    (lambda m: m.update(keys=[[K2, 2, S1, S2[:31]]]), "ckey"),
])  # fmt: skip
def test_welcome_history_errors_name_the_field(change: Any, field: str) -> None:
    m = cbor2.loads(welcome(admin=K2, creator=K1, hist=HIST, opv=((K1, 4),), keys=()).encode())
    if field == "creator":
        for k in ("hist", "opv", "keys", "creator"):
            m.pop(k, None)
    change(m)
    with pytest.raises(RemoteProtocolError) as e:
        decode_welcome(enc(m))
    assert e.value.field == field


def test_key_share_round_trip_cddl_and_errors() -> None:
    share = KeyShare(K3, (SharedEpoch(((K1, 3),), 1, S1, S2), SharedEpoch(((K1, 3), (K2, 1)), 2, S2, S1)))
    data = share.encode()
    assert decode_key_share(data) == share
    assert valid("groups.cddl", "key-share", data)
    msg = KeyShareMessage(b"box").encode()
    assert decode_key_share_message(msg) == KeyShareMessage(b"box")
    assert valid("groups.cddl", "group-keys", msg)
    assert "S1" not in repr(share) and S1.hex() not in repr(share)
    for bad, field in ((enc({"gid": K3, "epochs": []}), "epochs"),
                       (enc({"gid": K3, "epochs": [[[], 0, S1, S2[:5]]]}), "ckey"),
                       (enc(["group-keys", 2, b"x"]), "version")):  # fmt: skip
        with pytest.raises(RemoteProtocolError) as e:
            (decode_key_share_message if field == "version" else decode_key_share)(bad)
        assert e.value.field == field

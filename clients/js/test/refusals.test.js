// Wire v1.1 refusals in the JS client: the codec against tests/vectors/wire-v1.1.json, and RouterClient's
// sync() against a scripted router behind a fake WebSocket (real handshake, router-signed answers).
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { readFileSync } from 'node:fs';
import {
  Control, Identity, MessagesRefused, Reason, Refusal, RouterClient, RouterError, SyncResult, auth, controlBody,
  dec, decodeControl, decodeMessage, decodeRefused, describeReason, equalBytes, fromHex, hello, randomBytes,
  reasonLabel, refusedBody, toHex, unicast,
} from '../src/index.js';
import { errorItem } from '../src/codec.js';

const vectors = JSON.parse(readFileSync(new URL('../../../tests/vectors/wire-v1.1.json', import.meta.url)));
const v1 = JSON.parse(readFileSync(new URL('../../../tests/vectors/wire-v1.json', import.meta.url)));
const keys = Object.fromEntries(vectors.keys.map((k) => [k.name, Identity.fromHex(k.seed)]));
const control = Object.fromEntries(vectors.control.map((c) => [c.name, c]));

// `fields` with {"hex": ...} as Uint8Array
const plain = (v) => {
  if (v && typeof v === 'object' && !Array.isArray(v)) {
    if (Object.keys(v).join() === 'hex') return fromHex(v.hex);
    return Object.fromEntries(Object.entries(v).map(([k, x]) => [k, plain(x)]));
  }
  return v;
};

// ------------------------------------------------------------------------------------------ golden vectors

test('the v1.1 vectors use the v1 keys', () => {
  assert.deepEqual(vectors.keys, v1.keys);
  for (const k of vectors.keys) assert.equal(keys[k.name].hex, k.public);
});

test('control bodies encode and decode byte for byte', () => {
  for (const c of vectors.control) {
    const body = fromHex(c.body_hex);
    const fields = plain(c.fields);
    assert.equal(toHex(controlBody(c.type, fields)), c.body_hex, c.name);
    const got = decodeControl(body);
    assert.equal(got.type, c.type, c.name);
    assert.deepEqual(got.fields, fields, c.name);
  }
  assert.equal(Control.REFUSED, 9);
  assert.equal(Control.STATUS, control.status.type);
  assert.equal(Control.STATUS_REPLY, control['status-reply'].type);
});

test('REFUSED bodies: fields, reason names, the encoder', () => {
  for (const name of ['refused', 'refused-partial']) {
    const c = control[name];
    const r = decodeRefused(decodeControl(fromHex(c.body_hex)));
    assert.equal(toHex(r.id), c.fields.id.hex);
    assert.equal(r.reason, c.fields.reason);
    assert.equal(r.count, c.fields.count);
    assert.equal(reasonLabel(r.reason), c.reason_label);
    assert.equal(toHex(refusedBody(r.id, r.reason, r.count)), c.body_hex);
  }
  assert.equal(decodeRefused(decodeControl(fromHex(control['sync-ack-refused'].body_hex))), null);
  assert.equal(decodeRefused(decodeControl(controlBody(9, { id: new Uint8Array(31), reason: 1, count: 0 }))), null);
  assert.equal(reasonLabel(42), 'reason_42');
  assert.equal(describeReason(Reason.QUOTA), "quota (the recipient's queue is full)");
  for (const code of Object.values(Reason)) assert.match(describeReason(code), /^[a-z_]+ \(.+\)$/);
});

test('SYNC_ACK: the refused count, and a v1.0 SYNC_ACK without it', () => {
  const ack = decodeControl(fromHex(control['sync-ack-refused'].body_hex));
  assert.deepEqual(ack.fields, { n: 7, result: 1, refused: 2 });
  assert.equal(decodeControl(fromHex(control['sync-ack-v1.0'].body_hex)).fields.refused, undefined);
});

test('router-signed unicasts carrying REFUSED and SYNC_ACK are fixed bytes', () => {
  for (const m of vectors.messages) {
    const body = fromHex(control[m.control].body_hex);
    const msg = unicast(keys.router, keys.alice.publicKey, body, { ttl: 60, exp: 3600000 });
    assert.equal(toHex(msg.encode()), m.message_hex, m.name);
    assert.equal(toHex(msg.sig), m.sig_hex, m.name);
    assert.equal(toHex(msg.id), m.id_hex, m.name);
    const back = decodeMessage(fromHex(m.message_hex));
    assert.equal(toHex(back.signedBytes), m.signed_bytes_hex, m.name);
    assert.equal(back.signatureValid, m.signature_valid, m.name);
    assert.ok(equalBytes(back.body, body), m.name);
  }
});

// ------------------------------------------------------------------------------------------ a scripted router

const utf8 = new TextDecoder();

class FakeRouter {
  constructor() {
    this.identity = Identity.generate();
    this.nonce = randomBytes(32);
    this.refuse = new Map(); // body text -> [reason, count]
    this.refuseControl = new Map(); // control type -> [reason, count]
    this.ackExtra = 0; // a lying router
    this.v10 = false; // SYNC_ACK without `refused`
    this.holdAcks = false; // a SYNC_ACK waits until the next message has been handled
    this.mute = false; // SYNCs are not answered (a router that does not answer in time)
    this.syncs = 0; // SYNCs received
    this.received = [];
    this._held = [];
    this._pending = 0;
    this._state = 'hello';
    this.errors = [];
    this.ws = null;
    const router = this;
    this.WebSocket = class {
      constructor() {
        router.ws = this;
        this.readyState = 0;
        setImmediate(() => { this.readyState = 1; this.onopen?.(); });
      }

      send(bytes) { router._receive(new Uint8Array(bytes)); }

      close(code = 1000) {
        if (this.readyState === 3) return;
        this.readyState = 3;
        setImmediate(() => this.onclose?.({ code, reason: '' }));
      }
    };
  }

  _deliver(bytes) {
    const ws = this.ws;
    const buf = new Uint8Array(bytes).slice().buffer;
    setImmediate(() => { if (ws.readyState === 1) ws.onmessage?.({ data: buf }); });
  }

  signed(body, dst = this.peer) {
    return unicast(this.identity, dst, body, { ttl: 60 });
  }

  refused(id, reason, count = 0) {
    return this.signed(refusedBody(id, reason, count));
  }

  push(msg) { this._deliver(msg.encode()); }

  _receive(bytes) {
    if (this._state === 'hello') {
      if (this.silent) return; // (a router that never answers the handshake)
      const item = dec(bytes);
      this.peer = item[2];
      this._deliver(hello(this.identity, this.nonce));
      this._deliver(auth(this.identity, this.peer, item[3]));
      this._state = 'auth';
      return;
    }
    if (this._state === 'auth') {
      this._state = 'open';
      return;
    }
    const item = dec(bytes);
    if (Array.isArray(item) && item[0] === 'error') { // the client's ERROR before it closes
      this.errors.push(item);
      return;
    }
    this._handle(decodeMessage(bytes));
  }

  _handle(msg) {
    const held = this._held;
    this._held = [];
    let rule = this.refuse.get(utf8.decode(msg.body));
    if (msg.type === 0 && equalBytes(msg.header.dst, this.identity.publicKey)) {
      const c = decodeControl(msg.body);
      rule = this.refuseControl.get(c.type);
      if (c.type === Control.SYNC) this.syncs += 1;
      if (c.type === Control.SYNC && this.mute) return;
      if (c.type === Control.SYNC && !rule) {
        const k = this._pending + this.ackExtra;
        this._pending = 0;
        const fields = this.v10 ? { n: c.fields.n, result: 0 } : { n: c.fields.n, result: k ? 1 : 0, refused: k };
        const ack = this.signed(controlBody(Control.SYNC_ACK, fields)).encode();
        if (this.holdAcks) {
          this._held = [...held, ack];
        } else {
          for (const h of held) this._deliver(h);
          this._deliver(ack);
        }
        return;
      }
      if (!rule && c.type === Control.STATUS) {
        this.push(this.signed(controlBody(Control.STATUS_REPLY, { stats: this.stats ?? { connections: 1 } })));
      }
      if (!rule && c.type === Control.JOIN) {
        this.push(this.signed(controlBody(Control.JOIN_ACK, { addr: c.fields.addr, result: 0 })));
      }
    } else {
      this.received.push(msg);
    }
    if (rule) {
      this.push(this.refused(msg.id, ...rule));
      this._pending += 1;
    }
    for (const h of held) this._deliver(h);
  }
}

async function connect(router) {
  return RouterClient.connect('ws://fake/', Identity.generate(), { WebSocket: router.WebSocket, timeout: 2000 });
}

const tick = (ms = 20) => new Promise((r) => setTimeout(r, ms));
const other = () => Identity.generate().publicKey;

test('sync() without refusals resolves to an empty SyncResult', async () => {
  const router = new FakeRouter();
  const c = await connect(router);
  c.send(other(), 'fine');
  const res = await c.sync();
  assert.ok(res instanceof SyncResult);
  assert.ok(res.ok);
  assert.deepEqual(res.refused, []);
  assert.ok((await c.sync({ rejectOnRefused: true })).ok);
  c.close();
});

test('sync() names exactly the refused messages and why', async () => {
  const router = new FakeRouter();
  router.refuse.set('too many', [Reason.QUOTA, 0]);
  router.refuse.set('partly', [Reason.STORE_FULL, 2]);
  const c = await connect(router);
  const group = Identity.generate();
  const dst = other();
  const ok1 = c.send(dst, 'fine');
  const whole = c.send(dst, 'too many');
  const part = c.publish(group, 'partly');
  const res = await c.sync();
  assert.equal(res.ok, false);
  assert.deepEqual(res.refused.map((r) => [r.idHex, r.reason, r.count]),
    [[toHex(whole), Reason.QUOTA, 0], [toHex(part), Reason.STORE_FULL, 2]]);
  assert.equal(res.refusal(ok1), null);
  const r = res.refusal(whole);
  assert.ok(r instanceof Refusal && r.whole && r.label === 'quota');
  assert.equal(r.describe(), "refused: quota (the recipient's queue is full)");
  assert.equal(res.refusal(toHex(part)).describe(),
    "refused for 2 recipients: store_full (the router's store is full)");
  assert.ok((await c.sync()).ok); // the next span starts empty
  assert.deepEqual(c.lateRefusals, []);
  c.close();
});

test('sync({rejectOnRefused: true}) rejects with MessagesRefused carrying the refusals', async () => {
  const router = new FakeRouter();
  router.refuse.set('nope', [Reason.NO_ROUTE, 0]);
  const c = await connect(router);
  const id = c.send(other(), 'nope');
  await assert.rejects(c.sync({ rejectOnRefused: true }), (e) => {
    assert.ok(e instanceof MessagesRefused && e instanceof RouterError);
    assert.equal(e.refusals.length, 1);
    assert.equal(e.refusals[0].idHex, toHex(id));
    assert.ok(e.result instanceof SyncResult);
    assert.match(e.message, /no_route/);
    return true;
  });
  c.close();
});

test('a REFUSED overtaking a SYNC_ACK belongs to the next sync()', async () => {
  const router = new FakeRouter();
  router.refuse.set('before', [Reason.QUOTA, 0]);
  router.refuse.set('after', [Reason.EXPIRED, 0]);
  router.holdAcks = true;
  const c = await connect(router);
  const before = c.send(other(), 'before');
  const first = c.sync();
  const after = c.send(other(), 'after'); // refused before the held SYNC_ACK is written
  const res1 = await first;
  assert.deepEqual(res1.refused.map((r) => r.idHex), [toHex(before)]);
  router.holdAcks = false;
  const second = c.sync();
  c.send(other(), 'nudge');
  const res2 = await second;
  assert.deepEqual(res2.refused.map((r) => [r.idHex, r.reason]), [[toHex(after), Reason.EXPIRED]]);
  assert.deepEqual(c.lateRefusals, []);
  c.close();
});

test('a SYNC_ACK counting more refusals than arrived rejects as a protocol error', async () => {
  const router = new FakeRouter();
  router.ackExtra = 1;
  const c = await connect(router);
  c.send(other(), 'x');
  await assert.rejects(c.sync(), /protocol error: SYNC_ACK \d+ counts 1 refused messages, but only 0/);
  router.ackExtra = 0;
  assert.ok((await c.sync()).ok);
  c.close();
});

test('a wire v1.0 SYNC_ACK without refused is success', async () => {
  const router = new FakeRouter();
  router.v10 = true;
  const c = await connect(router);
  c.send(other(), 'old router');
  assert.ok((await c.sync()).ok);
  c.close();
});

test('late refusals go to onrefused and lateRefusals, never to next()', async () => {
  const router = new FakeRouter();
  const c = await connect(router);
  const seen = [];
  c.onrefused = (r) => seen.push(r);
  const id = c.send(other(), 'forwarded');
  assert.ok((await c.sync()).ok);
  router.push(router.refused(id, Reason.QUOTA, 1));
  const next = Identity.generate(); // the next router's own REFUSED, passed on as our router received it
  router.push(unicast(next, router.identity.publicKey, refusedBody(id, Reason.STORE_FULL, 0), { ttl: 60 }));
  const stranger = Identity.generate(); // an app may send any body: this one is an ordinary message
  const fromApp = unicast(stranger, c.identity.publicKey, refusedBody(id, Reason.QUOTA, 0), { ttl: 60 });
  router.push(fromApp);
  const got = await c.next();
  assert.equal(toHex(got.id), toHex(fromApp.id));
  assert.deepEqual(seen.map((r) => [r.idHex, r.reason, r.count]),
    [[toHex(id), Reason.QUOTA, 1], [toHex(id), Reason.STORE_FULL, 0]]);
  assert.deepEqual(c.lateRefusals, seen);
  assert.ok((await c.sync()).ok);
  c.close();
});

test('a refused request is answered at once: join() false, sync() rejects', async () => {
  const router = new FakeRouter();
  router.refuseControl.set(Control.JOIN, [Reason.NOT_AUTHORIZED, 0]);
  const c = await connect(router);
  const t0 = Date.now();
  assert.equal(await c.join(other(), { timeout: 2000 }), false);
  assert.ok(Date.now() - t0 < 1000);
  const res = await c.sync(); // the JOIN was a message of this span: its reason is reported here
  assert.equal(res.refused.length, 1);
  assert.equal(res.refused[0].label, 'not_authorized');
  router.refuseControl.clear();
  assert.equal(await c.join(other()), true);
  router.refuseControl.set(Control.SYNC, [Reason.OVERLOADED, 0]);
  await assert.rejects(c.sync({ timeout: 2000 }), (e) => e instanceof MessagesRefused
    && /SYNC refused: overloaded/.test(e.message));
  c.close();
});

test('past trackLimit unknown ids are filed by the SYNC_ACK count', async () => {
  const router = new FakeRouter();
  router.refuse.set('r3', [Reason.QUOTA, 0]);
  router.refuse.set('r5', [Reason.QUOTA, 0]);
  const c = await connect(router);
  c.trackLimit = 2;
  const dst = other();
  const ids = [0, 1, 2, 3, 4, 5].map((i) => c.send(dst, `r${i}`));
  const res = await c.sync();
  assert.deepEqual(res.refused.map((r) => r.idHex).sort(), [toHex(ids[3]), toHex(ids[5])].sort());
  await tick();
  assert.deepEqual(c.lateRefusals, []);
  c.close();
});

test('a REFUSED of the wrong shape from the router is a protocol error, never a message for the app', async () => {
  const router = new FakeRouter();
  const c = await connect(router);
  const seen = [];
  c.onmessage = (m) => seen.push(m);
  router.push(router.signed(controlBody(Control.REFUSED, { id: new Uint8Array(31), reason: 5, count: 0 })));
  await tick(50);
  assert.deepEqual(seen, []);
  assert.equal(c.closedReason, 'protocol error: malformed REFUSED from the router');
  assert.deepEqual(router.errors, [['error', 1, 'malformed REFUSED from the router']]);
  c.close();
});

test('a sync() that timed out hands its refusals to the next one, and refusal() answers for them', async () => {
  const router = new FakeRouter();
  router.refuse.set('slow', [Reason.QUOTA, 0]);
  router.holdAcks = true;
  const c = await connect(router);
  const id = c.send(other(), 'slow');
  await assert.rejects(c.sync({ timeout: 100 }), (e) => e instanceof RouterError && /no answer/.test(e.message));
  router.holdAcks = false;
  c.send(other(), 'nudge'); // releases the held SYNC_ACK
  await tick();
  const res = await c.sync();
  assert.deepEqual(res.refused.map((r) => r.idHex), [toHex(id)]);
  assert.deepEqual(c.lateRefusals, []);
  assert.equal(c.refusal(id).reason, Reason.QUOTA);
  c.close();
});

test('with several callers on one client, refusal() answers whichever sync() reported it', async () => {
  const router = new FakeRouter();
  router.refuse.set('mine', [Reason.NO_ROUTE, 0]);
  const c = await connect(router);
  const mine = c.send(other(), 'mine');
  assert.equal((await c.sync()).refusal(mine).reason, Reason.NO_ROUTE); // another caller's sync()
  const own = await c.sync();
  assert.ok(own.ok && own.refusal(mine) === null);
  assert.equal(c.refusal(mine).reason, Reason.NO_ROUTE);
  c.close();
});

test('the same request from several callers at once is answered for each', async () => {
  const router = new FakeRouter();
  const c = await connect(router);
  const g = other();
  assert.deepEqual(await Promise.all([c.join(g, { timeout: 1000 }), c.join(g, { timeout: 1000 })]), [true, true]);
  c.close();
});

test('messages that came before onmessage was set are handed to it first, in order', async () => {
  const router = new FakeRouter();
  const c = await connect(router);
  const me = c.identity.publicKey;
  const sender = Identity.generate();
  const text = (t) => new TextEncoder().encode(t);
  for (const k of [0, 1, 2]) router.push(unicast(sender, me, text(`queued ${k}`), { ttl: 60 }));
  await tick();
  const got = [];
  c.onmessage = (m) => got.push(utf8.decode(m.body));
  router.push(unicast(sender, me, text('live'), { ttl: 60 }));
  await tick();
  assert.deepEqual(got, ['queued 0', 'queued 1', 'queued 2', 'live']);
  c.close();
});

test('nothing is sent once close() was called: send() throws', async () => {
  const router = new FakeRouter();
  const c = await connect(router);
  c.close();
  assert.throws(() => c.send(other(), 'after close'), (e) => e instanceof RouterError);
});

test('a handshake that does not complete in time says so', async () => {
  const router = new FakeRouter();
  router.silent = true;
  await assert.rejects(
    RouterClient.connect('ws://fake/', Identity.generate(), { WebSocket: router.WebSocket, timeout: 100 }),
    (e) => e instanceof RouterError && /handshake not complete after 100 ms/.test(e.message),
  );
});

test('a plain body that begins like a sealed one is refused', async () => {
  const router = new FakeRouter();
  const c = await connect(router);
  const looksSealed = new Uint8Array([0x83, 0x66, ...new TextEncoder().encode('sealed'), 0x01, 0x40]);
  assert.throws(() => c.send(other(), looksSealed), TypeError);
  c.send(other(), new Uint8Array([0x83, 0x66, ...new TextEncoder().encode('sealeD'), 0x01, 0x40])); // (plain)
  c.close();
});

test("the router's ERROR after the handshake: its code on what was pending", async () => {
  const router = new FakeRouter();
  router.holdAcks = true; // (a SYNC left waiting)
  const c = await connect(router);
  const pending = c.sync({ timeout: 2000 }).catch((e) => e);
  router.push({ encode: () => errorItem(6, 'overloaded') });
  await tick();
  router.ws.close(1000);
  const e = await pending;
  assert.ok(e instanceof RouterError && e.code === 6, String(e));
  assert.equal(c.closedCode, 6);
  assert.throws(() => c.send(other(), 'x'), (x) => x instanceof RouterError && x.code === 6);
});

test('status() resolves to the router\'s counters; a refused or malformed one rejects', async () => {
  const router = new FakeRouter();
  router.stats = { connections: 3, refused_quota_total: 0, queued: 12 };
  const c = await connect(router);
  assert.deepEqual(await c.status(), { connections: 3, refused_quota_total: 0, queued: 12 });
  // two at once cannot be told apart: they go in turn, each answered
  const both = await Promise.all([c.status({ timeout: 1000 }), c.status({ timeout: 1000 })]);
  assert.equal(both[0].connections, 3);
  assert.equal(both[1].queued, 12);
  router.stats = { connections: -1 };
  await assert.rejects(c.status({ timeout: 1000 }), (e) => e instanceof RouterError && /malformed STATUS_REPLY/.test(e.message));
  router.refuseControl.set(Control.STATUS, [Reason.NOT_AUTHORIZED, 0]);
  const t0 = Date.now();
  await assert.rejects(c.status({ timeout: 2000 }), (e) => e instanceof MessagesRefused
    && /STATUS refused: not_authorized/.test(e.message));
  assert.ok(Date.now() - t0 < 1000);
  c.close();
});

test('close() right after sending syncs first: every refusal is known once it resolves', async () => {
  const router = new FakeRouter();
  router.refuse.set('too many', [Reason.QUOTA, 0]);
  const c = await connect(router);
  const ok = c.send(other(), 'fine');
  const refused = c.send(other(), 'too many');
  const closing = c.close();
  assert.equal(c.close(), closing); // a second close() waits for the first
  await closing;
  assert.equal(c.refusal(refused).reason, Reason.QUOTA);
  assert.equal(c.refusal(ok), null);
  assert.equal(router.ws.readyState, 3);
  assert.throws(() => c.send(other(), 'after the close'), RouterError);
  const quiet = await connect(new FakeRouter());
  await quiet.close(); // nothing sent since the last sync: no SYNC, the close frame at once
  assert.equal(quiet._ws.readyState, 3);
});

test('close() resolves true when every answer is known, false when its sync is not answered in time', async () => {
  // (An audit: close() resolved as usual when its sync failed, and refusal(id) then said "not refused"; after an
  // awaited sync() it synced again, counting that sync's own SYNC as something sent.)
  let router = new FakeRouter();
  let c = await connect(router);
  c.send(other(), 'answered');
  await c.sync();
  const before = router.syncs;
  assert.equal(await c.close(), true);
  assert.equal(router.syncs, before, 'a close after sync() synced again');
  router = new FakeRouter();
  c = await connect(router);
  c.send(other(), 'synced by the close');
  assert.equal(await c.close(), true);
  assert.equal(router.syncs, 1);
  router = new FakeRouter();
  c = await connect(router);
  router.mute = true;
  c.send(other(), 'never answered');
  assert.equal(await c.close({ timeout: 100 }), false);
});

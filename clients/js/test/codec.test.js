// The JS codec against the golden vectors the Python codec is checked against (tests/vectors/wire-v1.json).
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { readFileSync } from 'node:fs';
import { Encoder } from 'cbor-x';
import {
  Identity, decodeMessage, enc, dec, toHex, fromHex, hello, auth, unicast, multicast, expIn, EPOCH_2020,
} from '../src/codec.js';

const vectors = JSON.parse(readFileSync(new URL('../../../tests/vectors/wire-v1.json', import.meta.url)));
const keys = Object.fromEntries(vectors.keys.map((k) => [k.name, Identity.fromHex(k.seed)]));

test('keys derive the published public keys', () => {
  for (const k of vectors.keys) assert.equal(keys[k.name].hex, k.public);
});

test('every message decodes, re-encodes byte for byte, and has the published id and signature validity', () => {
  for (const m of vectors.messages) {
    const msg = decodeMessage(fromHex(m.message_hex));
    assert.equal(toHex(msg.encode()), m.message_hex, m.name);
    assert.equal(toHex(msg.signedBytes), m.signed_bytes_hex, m.name);
    assert.equal(toHex(msg.id), m.id_hex, m.name);
    assert.equal(msg.signatureValid, m.signature_valid, m.name);
  }
});

test('signing the decoded headers again gives the published signatures (Ed25519 is deterministic)', () => {
  const byKey = Object.fromEntries(Object.values(keys).map((k) => [k.hex, k]));
  for (const m of vectors.messages.filter((x) => x.signature_valid)) {
    const msg = decodeMessage(fromHex(m.message_hex));
    const signer = byKey[toHex(msg.signer)];
    assert.ok(signer, m.name);
    const again = msg.type === 0
      ? unicast(signer, msg.header.dst, msg.body, { ttl: msg.header.ttl, exp: msg.header.exp })
      : multicast(signer, msg.body, { ttl: msg.header.ttl, exp: msg.header.exp, sn: msg.header.sn });
    assert.equal(toHex(again.sig), m.sig_hex, m.name);
  }
});

test('session HELLO and AUTH items match the vectors', () => {
  const s = vectors.session;
  const unframe = (h) => h.slice(8);
  const helloAlice = dec(fromHex(unframe(s.hello_alice_frame_hex)));
  const helloRouter = dec(fromHex(unframe(s.hello_router_frame_hex)));
  const alice = Object.values(keys).find((k) => toHex(k.publicKey) === toHex(helloAlice[2]));
  const router = Object.values(keys).find((k) => toHex(k.publicKey) === toHex(helloRouter[2]));
  assert.equal(toHex(hello(alice, helloAlice[3])), unframe(s.hello_alice_frame_hex));
  assert.equal(toHex(auth(alice, router.publicKey, helloRouter[3])), unframe(s.auth_alice_frame_hex));
  assert.equal(toHex(auth(router, alice.publicKey, helloAlice[3])), unframe(s.auth_router_frame_hex));
});

test('deterministic encoding: sorted keys, shortest heads', () => {
  assert.equal(toHex(enc({ ttl: 1, sn: [], exp: 24, grp: new Uint8Array(0) })), 'a462736e8063657870181863677270406374746c01');
  assert.equal(toHex(enc(1000000)), '1a000f4240');
  assert.equal(toHex(enc('a'.repeat(30))), '781e' + '61'.repeat(30));
  assert.equal(toHex(enc(new Uint8Array(300))).slice(0, 6), '59012c');
});

test('exp counts whole minutes since 2020, rounded up', () => {
  assert.equal(expIn(60, EPOCH_2020), 1);
  assert.equal(expIn(61, EPOCH_2020), 2);
});

test('decoding rejects wrong shapes', () => {
  assert.throws(() => decodeMessage(enc([0, { src: new Uint8Array(32) }, new Uint8Array(0), new Uint8Array(64)])));
  assert.throws(() => decodeMessage(enc(['auth', new Uint8Array(64)])));
});

test('decoding refuses what the router would: field types and sizes, and any non-deterministic form', () => {
  const a = Identity.fromHex('11'.repeat(32));
  const g = Identity.fromHex('22'.repeat(32));
  const good = unicast(a, g.publicKey, new Uint8Array([1, 2, 3]), { ttl: 3600 });
  const bytes = good.encode();
  assert.equal(toHex(decodeMessage(bytes).id), toHex(good.id)); // the good one still decodes
  const h = { ...good.header };
  // (with cbor-x as it is, sorted keys: the codec's own enc refuses a float, and writes 2^32 in 8 bytes)
  const raw = new Encoder({ useRecords: false, mapsAsObjects: true, variableMapSize: true, tagUint8Array: false });
  const sorted = (o) => Object.fromEntries(Object.keys(o).sort().map((k) => [k, o[k]]));
  const withHeader = (header) => new Uint8Array(raw.encode([0, sorted(header), good.body, good.sig]));
  for (const [what, header] of [
    ['ttl as text', { ...h, ttl: '3600' }],
    ['ttl as a float', { ...h, ttl: 1.5 }],
    ['ttl of 2^32', { ...h, ttl: 2 ** 32 }],
    ['a negative exp', { ...h, exp: -1 }],
  ]) {
    assert.throws(() => decodeMessage(withHeader(header)), /ttl\/exp/, what);
  }
  const m = multicast(g, new Uint8Array([9]), { sn: [] });
  const mh = { ...m.header };
  const withSn = (sn) => enc([1, { ...mh, sn }, m.body, m.sig]);
  assert.throws(() => decodeMessage(withSn(Array.from({ length: 17 }, () => new Uint8Array(32)))), /sn/);
  assert.throws(() => decodeMessage(withSn([new Uint8Array(31)])), /sn/);
  assert.throws(() => decodeMessage(withSn(['text'])), /sn/);
  decodeMessage(withSn(Array.from({ length: 16 }, () => new Uint8Array(32)))); // 16 ids are fine
  // the same values in another byte form: keys out of order, a longer integer head, a duplicate key, a tag
  const hex = toHex(bytes);
  const ttlKey = toHex(enc('ttl'));
  const forms = {
    'keys out of order': hex.replace(toHex(enc('dst')), toHex(enc('dsu'))).replace(toHex(enc('src')), toHex(enc('dst')))
      .replace(toHex(enc('dsu')), toHex(enc('src'))),
    'a longer integer head': hex.replace(`${ttlKey}190e10`, `${ttlKey}1a00000e10`),
    'a tagged signature': hex.replace(`5840${toHex(good.sig)}`, `d8405840${toHex(good.sig)}`),
  };
  for (const [what, form] of Object.entries(forms)) {
    assert.notEqual(form, hex, `${what}: the test's edit did not apply`);
    assert.throws(() => decodeMessage(fromHex(form)), /deterministic|src\/dst|header/, what);
  }
  // a duplicate key: the header map says 5 entries, the last repeating ttl
  const dup = hex.replace(/a4/, 'a5').replace(`${ttlKey}190e10`, `${ttlKey}190e10${ttlKey}190e10`);
  assert.throws(() => decodeMessage(fromHex(dup)), /deterministic|header/, 'a duplicate key');
});

test('enc writes integers in their shortest head and refuses what has no deterministic form', () => {
  // (An audit: 2^32 went out as a float64, 10n in 8 bytes, 0.5 as a float - bytes the router refuses.)
  const cases = [[2 ** 32, '1b0000000100000000'], [2n ** 32n, '1b0000000100000000'], [10n, '0a'], [-1, '20'],
    [-(2 ** 32), '3affffffff'], [-(2 ** 32) - 1, '3b0000000100000000'], [2n ** 64n - 1n, '1bffffffffffffffff'],
    [Number.MAX_SAFE_INTEGER, '1b001fffffffffffff'], [{ n: 2 ** 40 }, 'a1616e1b0000010000000000']];
  for (const [v, want] of cases) assert.equal(toHex(enc(v)), want, String(v));
  for (const bad of [0.5, 1.5, 2 ** 60, 2n ** 64n, -(2n ** 64n), NaN, Infinity]) {
    assert.throws(() => enc(bad), /not deterministic CBOR/, String(bad));
  }
  assert.equal(toHex(enc(-(2n ** 64n) + 1n)), '3bfffffffffffffffe');
});

test('a message the router would refuse is refused before it is sent', () => {
  // (An audit: a fractional or too large ttl, a negative exp, a short dst or 17 sn ids went out, and the router
  // closed the connection with ERROR 1 - every pending call failed with it.) As the Python client does.
  const a = Identity.fromHex('11'.repeat(32));
  const g = Identity.fromHex('22'.repeat(32));
  const body = new Uint8Array([1]);
  for (const opts of [{ ttl: 1.5 }, { ttl: 2 ** 32 }, { ttl: -1 }, { exp: -1 }, { exp: 2 ** 32 }, { exp: 0.5 }]) {
    assert.throws(() => unicast(a, g.publicKey, body, opts), /ttl|exp/, JSON.stringify(opts));
    assert.throws(() => multicast(g, body, opts), /ttl|exp/, JSON.stringify(opts));
  }
  assert.throws(() => unicast(a, new Uint8Array(31), body), /dst/);
  assert.throws(() => unicast(a, g.publicKey, 'text'), /body/);
  assert.throws(() => multicast(g, body, { sn: Array.from({ length: 17 }, () => new Uint8Array(32)) }), /sn/);
  assert.throws(() => multicast(g, body, { sn: [new Uint8Array(31)] }), /sn/);
  unicast(a, g.publicKey, body, { ttl: 0, exp: 2 ** 32 - 1 }); // the bounds themselves are fine
  multicast(g, body, { sn: Array.from({ length: 16 }, () => new Uint8Array(32)) });
});

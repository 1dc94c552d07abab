// The JS codec against the golden vectors the Python codec is checked against (tests/vectors/wire-v1.json).
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { readFileSync } from 'node:fs';
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

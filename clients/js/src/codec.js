// Wire codec of the upsycle router (docs/protocol.md, docs/websocket.md): deterministic CBOR, Ed25519
// signatures, BLAKE3 message ids, router control bodies (wire v1.1: REFUSED 9, STATUS 11/12). Pure functions
// over Uint8Array; no I/O.
import { Encoder, decode as cborDecode } from 'cbor-x';
import * as ed from '@noble/ed25519';
import { sha512 } from '@noble/hashes/sha2.js';
import { blake3 } from '@noble/hashes/blake3.js';

ed.hashes.sha512 = sha512;

export const PROTOCOL_NAME = 'upsycle';
export const PROTOCOL_VERSION = 1;
export const AUTH_CONTEXT = new TextEncoder().encode('upsycle/1 session');
export const UNICAST = 0;
export const MULTICAST = 1;
export const EPOCH_2020 = 1577836800; // exp counts minutes since 2020-01-01T00:00:00Z
// Router control types; REFUSED and STATUS 11/12 since wire v1.1 (STATUS was 9/10 before).
export const Control = Object.freeze({
  JOIN: 1, JOIN_ACK: 2, LEAVE: 3, LEAVE_ACK: 4, PULL: 5, PULL_NACK: 6, SYNC: 7, SYNC_ACK: 8, REFUSED: 9,
  STATUS: 11, STATUS_REPLY: 12,
});
// Why a router did not take a message in full (REFUSED `reason`, wire v1.1).
export const Reason = Object.freeze({
  BAD_SIGNATURE: 1, EXPIRED: 2, NOT_AUTHORIZED: 3, NO_ROUTE: 4, QUOTA: 5, STORE_FULL: 6, OVERLOADED: 7,
  TOO_LARGE: 8, MALFORMED: 9,
});
const REASON_TEXT = Object.freeze({
  1: 'its signature does not verify',
  2: 'its exp had passed',
  3: 'this key may not send it there',
  4: 'the router knows no way to the recipient',
  5: "the recipient's queue is full",
  6: "the router's store is full",
  7: 'the router is overloaded',
  8: 'it is too large',
  9: 'the router cannot interpret it',
});
export const ErrorCode = Object.freeze({
  PROTOCOL: 1, AUTH_FAILED: 2, NOT_AUTHORIZED: 3, FRAME_TOO_LARGE: 4, HANDSHAKE_TIMEOUT: 5, OVERLOADED: 6,
  SHUTTING_DOWN: 7,
});

const encoder = new Encoder({
  useRecords: false, // plain CBOR maps, never cbor-x's record extension
  mapsAsObjects: true,
  variableMapSize: true, // shortest map heads (RFC 8949 §4.2.1)
  tagUint8Array: false, // a Uint8Array is a plain byte string
  useFloat32: 0,
});

const utf8 = new TextEncoder();

function compareKeys(a, b) {
  // RFC 8949 §4.2.1: map keys sorted by their encoded bytes; for text keys that is length first, then bytes
  const ea = utf8.encode(a);
  const eb = utf8.encode(b);
  if (ea.length !== eb.length) return ea.length - eb.length;
  for (let i = 0; i < ea.length; i++) if (ea[i] !== eb[i]) return ea[i] - eb[i];
  return 0;
}

const U32 = 2 ** 32;

function integer(v) {
  // RFC 8949 §4.2.1: an integer in its shortest head. cbor-x writes a Number of 2^32 or more as a float64 and
  // any BigInt in 8 bytes: those outside -2^32..2^32-1 go as BigInt (8 bytes is their shortest head), those
  // inside as Number. A fraction, or an integer past 64 bits or past what a Number holds exactly, is refused:
  // the wire has no floats (a router refuses them), and a silently rounded number is another message.
  if (typeof v === 'number') {
    if (!Number.isInteger(v)) throw new TypeError(`not deterministic CBOR: ${v} is no integer (no floats)`);
    if (v >= -U32 && v < U32) return v;
    if (!Number.isSafeInteger(v)) throw new TypeError(`not deterministic CBOR: ${v} is past 2^53 (use a BigInt)`);
    return BigInt(v);
  }
  // (-2^64 itself fits CBOR's head too, but cbor-x writes it as a bignum: refused with what is past 64 bits)
  if (v > -(2n ** 64n) && v < 2n ** 64n) return v >= -BigInt(U32) && v < BigInt(U32) ? Number(v) : v;
  throw new TypeError(`not deterministic CBOR: ${v} does not fit in 64 bits`);
}

function canonical(v) {
  if (typeof v === 'number' || typeof v === 'bigint') return integer(v);
  if (v instanceof Uint8Array || v === null || typeof v !== 'object') return v;
  if (Array.isArray(v)) return v.map(canonical);
  const out = {};
  for (const k of Object.keys(v).sort(compareKeys)) out[k] = canonical(v[k]);
  return out;
}

/** Deterministic CBOR of one item (JS objects are maps with text keys, Uint8Array is a byte string). */
export function enc(value) {
  return new Uint8Array(encoder.encode(canonical(value)));
}

/** Decode exactly one CBOR item; byte strings come back as Uint8Array. */
export function dec(bytes) {
  return cborDecode(bytes);
}

export function concat(...parts) {
  const out = new Uint8Array(parts.reduce((n, p) => n + p.length, 0));
  let i = 0;
  for (const p of parts) {
    out.set(p, i);
    i += p.length;
  }
  return out;
}

export function toHex(b) {
  return Array.from(b, (x) => x.toString(16).padStart(2, '0')).join('');
}

export function fromHex(s) {
  if (typeof s !== 'string' || s.length % 2 || /[^0-9a-fA-F]/.test(s)) throw new Error(`not hex: ${s}`);
  const out = new Uint8Array(s.length / 2);
  for (let i = 0; i < out.length; i++) out[i] = parseInt(s.slice(2 * i, 2 * i + 2), 16);
  return out;
}

export function equalBytes(a, b) {
  if (!(a instanceof Uint8Array) || !(b instanceof Uint8Array) || a.length !== b.length) return false;
  for (let i = 0; i < a.length; i++) if (a[i] !== b[i]) return false;
  return true;
}

function isBytes(v, n) {
  return v instanceof Uint8Array && (n === undefined || v.length === n);
}

/** An Ed25519 key pair; the 32-byte public key is the address. */
export class Identity {
  constructor(seed) {
    if (!isBytes(seed, 32)) throw new Error('an identity seed is 32 bytes');
    this.seed = new Uint8Array(seed);
    this.publicKey = ed.getPublicKey(this.seed);
  }

  static generate() {
    return new Identity(ed.utils.randomSecretKey());
  }

  static fromHex(seedHex) {
    return new Identity(fromHex(seedHex));
  }

  get hex() {
    return toHex(this.publicKey);
  }

  sign(bytes) {
    return ed.sign(bytes, this.seed);
  }
}

export function verify(publicKey, bytes, sig) {
  try {
    return isBytes(sig, 64) && isBytes(publicKey, 32) && ed.verify(sig, bytes, publicKey);
  } catch {
    return false;
  }
}

/** An exp value at least `seconds` from now (rounded up to a whole minute). */
export function expIn(seconds, now = Date.now() / 1000) {
  return Math.max(0, Math.min(2 ** 32 - 1, Math.ceil((now + seconds - EPOCH_2020) / 60)));
}

/** One routed message: [type, header, body, sig, ?via]. */
export class Message {
  constructor(type, header, body, sig, via = null) {
    Object.assign(this, { type, header, body, sig, via });
    Object.freeze(this);
  }

  get signedBytes() {
    return concat(enc(this.type), enc(this.header), enc(this.body));
  }

  /** BLAKE3-256 over the signed bytes and the encoded signature (VIA never enters). */
  get id() {
    return blake3(concat(this.signedBytes, enc(this.sig)));
  }

  /** The key that must have signed: src for unicast, the group for multicast. */
  get signer() {
    return this.type === UNICAST ? this.header.src : this.header.grp;
  }

  get signatureValid() {
    return verify(this.signer, this.signedBytes, this.sig);
  }

  encode() {
    const items = [this.type, this.header, this.body, this.sig];
    if (this.via) items.push(this.via);
    return enc(items);
  }
}

function signed(type, header, body, key) {
  const h = canonical(header);
  return new Message(type, h, body, key.sign(concat(enc(type), enc(h), enc(body))));
}

function checkHeader(ttl, exp, body) {
  // what decodeMessage (and the router) require: refused here, before anything is sent, as the Python client does
  // (sent, the router would close the connection with ERROR 1 and every pending call would fail with it)
  if (!isUint32(ttl)) throw new RangeError(`ttl: ${ttl} is no integer in 0..4294967295 (seconds)`);
  if (!isUint32(exp)) throw new RangeError(`exp: ${exp} is no integer in 0..4294967295 (minutes since 2020)`);
  if (!isBytes(body)) throw new TypeError('body: a Uint8Array');
}

/** A unicast message from `key` to `dst`, signed by `key`. */
export function unicast(key, dst, body, { ttl = 3600, exp = expIn(Math.max(ttl, 7 * 86400)) } = {}) {
  if (!isBytes(dst, 32)) throw new TypeError('dst: a public key of 32 bytes');
  checkHeader(ttl, exp, body);
  return signed(UNICAST, { src: key.publicKey, dst, ttl, exp }, body, key);
}

/** A multicast message to `group` (an Identity holding the group's private key). */
export function multicast(group, body, { ttl = 3600, exp = expIn(Math.max(ttl, 7 * 86400)), sn = [] } = {}) {
  if (!Array.isArray(sn) || sn.length > MAX_SN || !sn.every((i) => isBytes(i, 32))) {
    throw new TypeError(`sn: at most ${MAX_SN} ids of 32 bytes`);
  }
  checkHeader(ttl, exp, body);
  return signed(MULTICAST, { grp: group.publicKey, ttl, exp, sn }, body, group);
}

const HEADER_KEYS = {
  [UNICAST]: ['dst', 'exp', 'src', 'ttl'],
  [MULTICAST]: ['exp', 'grp', 'sn', 'ttl'],
};

const isUint32 = (v) => Number.isInteger(v) && v >= 0 && v <= 0xffffffff;
export const MAX_SN = 16;

/** Decode a routed message, checking its shape, its field types and sizes, and that it is in deterministic
 * form (the bytes are exactly what encoding the decoded message gives: sorted keys, shortest heads, no
 * duplicate key, no tag); throws on anything else (docs/protocol.md: a message in any other form is refused). */
export function decodeMessage(bytes) {
  const m = dec(bytes);
  if (!Array.isArray(m) || m.length < 4 || m.length > 5) throw new Error('not a routed message');
  const [type, header, body, sig, via = null] = m;
  if (!(type in HEADER_KEYS) || header === null || typeof header !== 'object') throw new Error('bad message type');
  const keys = Object.keys(header).sort();
  if (keys.join() !== HEADER_KEYS[type].join()) throw new Error(`bad header keys: ${keys}`);
  if (type === UNICAST && !(isBytes(header.src, 32) && isBytes(header.dst, 32))) throw new Error('bad src/dst');
  if (type === MULTICAST && !(isBytes(header.grp, 32) && Array.isArray(header.sn))) throw new Error('bad grp/sn');
  if (type === MULTICAST && (header.sn.length > MAX_SN || !header.sn.every((i) => isBytes(i, 32)))) {
    throw new Error(`bad sn: at most ${MAX_SN} ids of 32 bytes`);
  }
  if (!isUint32(header.ttl) || !isUint32(header.exp)) throw new Error('bad ttl/exp: unsigned 32-bit integers');
  if (!isBytes(body) || !isBytes(sig, 64) || (via !== null && !isBytes(via, 32))) throw new Error('bad body/sig/via');
  const msg = new Message(type, header, body, sig, via);
  if (!equalBytes(msg.encode(), bytes instanceof Uint8Array ? bytes : new Uint8Array(bytes))) {
    throw new Error('not in deterministic form');
  }
  return msg;
}

// ------------------------------------------------------------------------------------------ session items

export function hello(identity, nonce) {
  return enc([PROTOCOL_NAME, PROTOCOL_VERSION, identity.publicKey, nonce]);
}

export function authSignature(identity, peerId, peerNonce) {
  return identity.sign(concat(AUTH_CONTEXT, identity.publicKey, peerId, peerNonce));
}

export function auth(identity, peerId, peerNonce) {
  return enc(['auth', authSignature(identity, peerId, peerNonce)]);
}

export function errorItem(code, reason) {
  return enc(['error', code, String(reason).slice(0, 500)]);
}

/** ['error', code, reason] as {code, reason}, or null for anything else. */
export function asError(item) {
  if (Array.isArray(item) && item.length === 3 && item[0] === 'error' && Number.isInteger(item[1])) {
    return { code: item[1], reason: String(item[2]) };
  }
  return null;
}

// ------------------------------------------------------------------------------------------ router control

export function controlBody(type, fields) {
  return enc([type, fields]);
}

/** [type, map] of a router control body, or null. */
export function decodeControl(body) {
  try {
    const c = dec(body);
    if (Array.isArray(c) && c.length === 2 && Number.isInteger(c[0]) && c[1] && typeof c[1] === 'object') {
      return { type: c[0], fields: c[1] };
    }
  } catch {
    // not control
  }
  return null;
}

/** A reason's name as the router's traces and counters spell it (`quota`); an unknown code as `reason_<code>`. */
export function reasonLabel(code) {
  const name = Object.keys(Reason).find((k) => Reason[k] === code);
  return name ? name.toLowerCase() : `reason_${code}`;
}

/** A reason for people: `quota (the recipient's queue is full)`. */
export function describeReason(code) {
  const text = REASON_TEXT[code];
  return text ? `${reasonLabel(code)} (${text})` : reasonLabel(code);
}

const isUint = (v) => Number.isSafeInteger(v) && v >= 0;

/** The fields of a REFUSED body ([9, {id, reason, count}]) as {id, reason, count}, or null if it is not one. */
export function decodeRefused(control) {
  if (!control || control.type !== Control.REFUSED) return null;
  const f = control.fields;
  const keys = Object.keys(f).sort().join();
  if (keys !== 'count,id,reason' || !isBytes(f.id, 32) || !isUint(f.reason) || !isUint(f.count)) return null;
  return { id: f.id, reason: f.reason, count: f.count };
}

/** enc([9, {id, reason, count}]): a REFUSED body. */
export function refusedBody(id, reason, count = 0) {
  return controlBody(Control.REFUSED, { id, reason, count });
}

export function randomBytes(n) {
  return globalThis.crypto.getRandomValues(new Uint8Array(n));
}

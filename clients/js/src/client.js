// A web app's connection to an upsycle router over WebSocket (docs/websocket.md).
//
// Each binary WebSocket message carries one CBOR item. On open both sides send HELLO; each answers the
// other's HELLO with AUTH (an Ed25519 signature over the context, both ids and the peer's nonce); the
// session is open once the router's AUTH verified. After that every message is a routed message or ERROR.
// Router replies (JOIN_ACK, LEAVE_ACK, SYNC_ACK, PULL_NACK: unicast messages from the router's id, signed
// by it) resolve the request that asked for them; every other message goes to `onmessage` / `next()`.
//
// Refusals (wire v1.1, docs/protocol.md "Refusals"): the router answers REFUSED {id, reason, count} for every
// message it did not take in full, writes each before the SYNC_ACK of the next SYNC, and that SYNC_ACK counts
// them. The client files the ids it sends in epochs (one per SYNC) and files each REFUSED under the oldest
// unanswered epoch that sent its id, so `sync()` resolves to a SyncResult naming exactly the refused messages
// since the previous sync, and why (or rejects with MessagesRefused when asked to). A SYNC_ACK counting more
// refusals than arrived is a protocol error (sync() rejects). A REFUSED for an id of no unanswered epoch (the
// next router's, passed on after our SYNC_ACK) is late: it goes to `onrefused` and `lateRefusals`. A REFUSED
// for a pending request answers it at once (join/leave: false, pull: null, sync: rejects). REFUSED answers
// never reach `onmessage` / `next()`. This mirrors the Python client (upsycle_router.client).
import {
  Control, ErrorCode, Identity, asError, auth, controlBody, dec, decodeControl, decodeMessage, decodeRefused,
  describeReason, equalBytes, errorItem, hello, multicast, randomBytes, reasonLabel, toHex, unicast, verify,
  concat, AUTH_CONTEXT, PROTOCOL_NAME, PROTOCOL_VERSION,
} from './codec.js';

export class RouterError extends Error {
  constructor(message, code = null) {
    super(message);
    this.name = 'RouterError';
    this.code = code;
  }
}

/** The router did not take message `id` in full: `reason` (see Reason), `count` recipients it was not taken
 * for (0: refused as a whole, nothing stored or sent anywhere). */
export class Refusal {
  constructor(id, reason, count = 0) {
    Object.assign(this, { id, reason, count });
    Object.freeze(this);
  }

  get idHex() { return toHex(this.id); }

  get label() { return reasonLabel(this.reason); }

  get whole() { return this.count === 0; }

  /** `refused: quota (the recipient's queue is full)`, or `refused for 2 recipients: ...`. */
  describe() {
    const n = this.whole ? '' : ` for ${this.count} recipient${this.count === 1 ? '' : 's'}`;
    return `refused${n}: ${describeReason(this.reason)}`;
  }

  toString() { return `${this.idHex.slice(0, 16)} ${this.describe()}`; }
}

/** What SYNC `n` reported: the messages sent since the previous sync() that were not taken in full. Every
 * other message sent in that span was stored, queued or delivered for every recipient it was routed to. */
export class SyncResult {
  constructor(n, refused = []) {
    this.n = n;
    this.refused = Object.freeze([...refused]);
    Object.freeze(this);
  }

  get ok() { return this.refused.length === 0; }

  /** The Refusal of message `id` (Uint8Array or hex), or null when it was taken. */
  refusal(id) {
    const hex = typeof id === 'string' ? id.toLowerCase() : toHex(id);
    return this.refused.find((r) => r.idHex === hex) || null;
  }
}

export class MessagesRefused extends RouterError {
  /** `refusals`: the Refusal list; `result`: the SyncResult they came with (null for a refused request). */
  constructor(refusals, result = null, what = '') {
    const text = refusals.length === 1
      ? (what ? `${what} ${refusals[0].describe()}` : String(refusals[0]))
      : `${refusals.length} messages not taken in full: ${refusals.map(String).join('; ')}`;
    super(text);
    this.name = 'MessagesRefused';
    this.refusals = refusals;
    this.result = result;
  }
}

const LATE_REFUSALS_KEPT = 1024;
// A sealed body (docs/protocol.md "Sealed unicast"): a CBOR array of 2..23 elements whose first is "sealed".
const SEALED_TAG = [0x66, 0x73, 0x65, 0x61, 0x6c, 0x65, 0x64];
const looksSealed = (b) => b.length >= 8 && b[0] >= 0x82 && b[0] <= 0x97 && SEALED_TAG.every((x, i) => b[i + 1] === x);
const REFUSALS_KEPT = 16384; // refusal() answers for the newest ones
// (syncs: how many of `ids` are the SYNCs themselves - sync() sends its SYNC in the epoch it opens; not
// something close() must sync for)
const newEpoch = () => ({ ids: new Set(), refused: [], refusedIds: new Set(), overflow: false, syncs: 0 });
const unsynced = (ep) => ep.overflow || ep.ids.size > ep.syncs;

const textEncoder = new TextEncoder();
const asBytes = (body) => (typeof body === 'string' ? textEncoder.encode(body) : new Uint8Array(body));

export class RouterClient {
  /**
   * Connect to `url` (ws:// or wss://) as `identity` and complete the session handshake.
   * Options: routerId (Uint8Array: refuse any other router), timeout (ms), WebSocket (constructor).
   */
  static connect(url, identity, { routerId = null, timeout = 10000, WebSocket = globalThis.WebSocket } = {}) {
    const client = new RouterClient(identity);
    return client._open(url, routerId, timeout, WebSocket);
  }

  constructor(identity) {
    this.identity = identity;
    this.routerId = null;
    this.closedReason = null;
    this._onmessage = null; // (Message) => void: see the onmessage setter
    this.onclose = null; // (reason) => void
    this.onrefused = null; // (Refusal) => void: a late refusal (after the SYNC_ACK that covered the message)
    this.lateRefusals = []; // the newest late refusals (at most 1024)
    this.trackLimit = 1 << 16; // ids a sync span records; past that, unknown REFUSED ids are filed by count
    this._isClosed = false;
    this._closing = false; // close() was called: nothing more is sent
    this._closePromise = null; // close(): once its SYNC (if any) was answered, the close frame goes out
    this._closingSync = false; // close() is writing its SYNC
    this.closedCode = null; // the code of the router's ERROR that ended the connection, if one did
    this._ws = null;
    this._nonce = randomBytes(32);
    this._waiters = new Map(); // "join:<hex>" | "leave:<hex>" | "sync:<n>" | "pull:<hex>" -> {resolve, reject}
    this._queue = [];
    this._readers = [];
    this._syncN = Math.floor(Math.random() * 2 ** 31);
    this._requestIds = new Map(); // hex id of a pending request's message -> its waiter key
    this._epoch = newEpoch(); // ids sent since the last sync()
    this._unanswered = new Map(); // SYNC n -> the epoch it closed, in the order sent
    this._unfiled = []; // REFUSED of unknown ids while an epoch overflowed (at most trackLimit)
    this._spilled = false; // _unfiled overflowed too: some of them went to lateRefusals
    this._refusals = new Map(); // hex id -> the newest REFUSALS_KEPT refusals: refusal()
    this._carried = []; // reported by a SYNC_ACK nobody waited for: in the next sync()'s result
    this._asking = new Map(); // waiter key -> the last request with it (requests with one key go in turn)
  }

  /** The handler of incoming messages (Message) => void. Messages that arrived before it was set - a queue the
   * router held for this app comes right after the handshake - are handed to it first, in order. */
  get onmessage() { return this._onmessage; }

  set onmessage(handler) {
    this._onmessage = handler;
    if (handler) {
      queueMicrotask(() => {
        while (this._onmessage === handler && this._queue.length) this._deliver(handler, this._queue.shift());
      });
    }
  }

  _deliver(handler, msg) {
    try {
      handler(msg);
    } catch (e) {
      console.error('onmessage failed', e); // eslint-disable-line no-console
    }
  }

  /** The Refusal of message `id` (Uint8Array or hex) sent on this connection, whichever sync() reported it (or
   * a late one), or null when it was not refused as far as the router has answered. With several callers
   * sharing one client, one caller's sync() reports every refusal since the previous sync() of any: each asks
   * here about its own messages. The newest REFUSALS_KEPT are kept. */
  refusal(id) {
    return this._refusals.get(typeof id === 'string' ? id.toLowerCase() : toHex(id)) || null;
  }

  _open(url, routerId, timeout, WebSocketImpl) {
    return new Promise((resolve, reject) => {
      let state = 'hello';
      let routerNonce = null;
      const timer = setTimeout(() => fail(new RouterError(`handshake not complete after ${timeout} ms`)), timeout);
      const fail = (err) => {
        clearTimeout(timer);
        if (state === 'closed') return; // (the first reason stands: closing fires error and close events)
        state = 'closed';
        reject(err);
        this._closed(err.message);
        try { ws.close(); } catch { /* already closing */ }
      };
      const ws = new WebSocketImpl(url);
      this._ws = ws;
      ws.binaryType = 'arraybuffer';
      ws.onopen = () => ws.send(hello(this.identity, this._nonce));
      ws.onerror = () => { if (state !== 'open') fail(new RouterError(`cannot connect to ${url}`)); };
      ws.onclose = (ev) => {
        if (state !== 'open') fail(new RouterError(this.closedReason || `connection closed (${ev.code})`));
        else this._closed(this.closedReason || `connection closed (${[ev.code, ev.reason].filter((x) => x).join(' ')})`);
      };
      ws.onmessage = (ev) => {
        if (!(ev.data instanceof ArrayBuffer)) {
          this._protocolError('text WebSocket message from the router');
          return;
        }
        const bytes = new Uint8Array(ev.data);
        if (state === 'open') {
          this._onFrame(bytes);
          return;
        }
        let item;
        try {
          item = dec(bytes);
        } catch (e) {
          fail(new RouterError(`undecodable handshake item: ${e.message}`));
          return;
        }
        const err = asError(item);
        if (err) {
          fail(new RouterError(`router sent ERROR ${err.code}: ${err.reason}`, err.code));
        } else if (state === 'hello') {
          if (!Array.isArray(item) || item.length !== 4 || item[0] !== PROTOCOL_NAME || item[1] !== PROTOCOL_VERSION
              || !(item[2] instanceof Uint8Array) || item[2].length !== 32 || !(item[3] instanceof Uint8Array)
              || item[3].length !== 32) {
            this._send(errorItem(ErrorCode.PROTOCOL, 'expected HELLO'));
            fail(new RouterError('expected HELLO from the router'));
            return;
          }
          if (routerId && !equalBytes(routerId, item[2])) {
            this._send(errorItem(ErrorCode.AUTH_FAILED, 'unexpected router id'));
            fail(new RouterError(`expected router ${toHex(routerId)}, got ${toHex(item[2])}`, ErrorCode.AUTH_FAILED));
            return;
          }
          this.routerId = new Uint8Array(item[2]);
          routerNonce = item[3];
          ws.send(auth(this.identity, this.routerId, routerNonce));
          state = 'auth';
        } else if (state === 'auth') {
          const ok = Array.isArray(item) && item.length === 2 && item[0] === 'auth'
            && verify(this.routerId, concat(AUTH_CONTEXT, this.routerId, this.identity.publicKey, this._nonce), item[1]);
          if (!ok) {
            this._send(errorItem(ErrorCode.AUTH_FAILED, 'AUTH signature invalid'));
            fail(new RouterError('router AUTH signature invalid', ErrorCode.AUTH_FAILED));
            return;
          }
          state = 'open';
          clearTimeout(timer);
          resolve(this);
        }
      };
    });
  }

  _send(bytes) {
    if (this._ws && this._ws.readyState === 1) this._ws.send(bytes);
  }

  _protocolError(reason) {
    this._send(errorItem(ErrorCode.PROTOCOL, reason));
    this.closedReason = `protocol error: ${reason}`;
    this._ws.close(1002);
  }

  _closed(reason) {
    if (this._isClosed) return;
    this._isClosed = true;
    this.closedReason = this.closedReason || reason;
    const code = this.closedCode;
    for (const w of this._waiters.values()) w.reject(new RouterError(this.closedReason, code));
    this._waiters.clear();
    for (const r of this._readers.splice(0)) r.reject(new RouterError(this.closedReason, code));
    if (this.onclose) this.onclose(this.closedReason);
  }

  _onFrame(bytes) {
    let item;
    try {
      item = dec(bytes);
    } catch (e) {
      this._protocolError(`undecodable item: ${e.message}`);
      return;
    }
    const err = asError(item);
    if (err) {
      this.closedReason = `router sent ERROR ${err.code}: ${err.reason}`;
      this.closedCode = err.code; // (the RouterErrors of what was pending carry it)
      return; // the router closes next
    }
    let msg;
    try {
      msg = decodeMessage(bytes);
    } catch (e) {
      this._protocolError(e.message);
      return;
    }
    const fromRouter = msg.type === 0 && equalBytes(msg.header.src, this.routerId);
    // dst = our router: only our router hands us such a message (the next router's REFUSED, passed on)
    if (msg.type === 0 && (fromRouter || equalBytes(msg.header.dst, this.routerId)) && msg.signatureValid) {
      const c = decodeControl(msg.body);
      const refused = decodeRefused(c);
      if (refused) {
        this._onRefused(new Refusal(refused.id, refused.reason, refused.count));
        return;
      }
      if (c && c.type === Control.REFUSED) {  // a REFUSED of the wrong shape is the router's error, no message
        this._protocolError('malformed REFUSED from the router');
        return;
      }
      if (fromRouter && c && c.type === Control.SYNC_ACK) {
        this._onSyncAck(c.fields);
        return;
      }
      const key = fromRouter && c && {
        [Control.JOIN_ACK]: () => `join:${toHex(c.fields.addr)}`,
        [Control.LEAVE_ACK]: () => `leave:${toHex(c.fields.addr)}`,
        [Control.PULL_NACK]: () => `pull:${toHex(c.fields.id)}`,
        [Control.STATUS_REPLY]: () => 'status',
      }[c.type]?.();
      if (key) {
        const w = this._waiters.get(key);
        this._waiters.delete(key);
        if (w) w.resolve(c);
        return;
      }
    }
    const pulled = this._waiters.get(`pull:${toHex(msg.id)}`);
    if (pulled) {
      this._waiters.delete(`pull:${toHex(msg.id)}`);
      pulled.resolve(msg);
      return;
    }
    if (this._onmessage && !this._queue.length) this._deliver(this._onmessage, msg);
    else if (this._onmessage) this._queue.push(msg); // (behind those the setter is handing over)
    else if (this._readers.length) this._readers.shift().resolve(msg);
    else this._queue.push(msg);
  }

  _onRefused(r) {
    this._refusals.delete(r.idHex);
    this._refusals.set(r.idHex, r);
    if (this._refusals.size > REFUSALS_KEPT) this._refusals.delete(this._refusals.keys().next().value);
    const key = this._requestIds.get(r.idHex);
    if (key !== undefined) { // a request of ours: answer it now rather than let it time out
      this._requestIds.delete(r.idHex);
      const w = this._waiters.get(key);
      this._waiters.delete(key);
      if (w) w.resolve(r);
    }
    let home = null;
    for (const ep of [...this._unanswered.values(), this._epoch]) { // oldest first
      if (ep.ids.has(r.idHex)) {
        home = ep;
        if (!ep.refusedIds.has(r.idHex)) break; // (the same message sent again later: the first unrefused copy)
      }
    }
    if (home) {
      home.refused.push(r);
      home.refusedIds.add(r.idHex);
    } else if (this._anyOverflow()) {
      this._unfiled.push(r);
      if (this._unfiled.length > this.trackLimit) { // bounded: the oldest is reported as late instead
        this._spilled = true;
        this._late(this._unfiled.shift());
      }
    } else {
      this._late(r);
    }
  }

  _anyOverflow() {
    return this._epoch.overflow || [...this._unanswered.values()].some((ep) => ep.overflow);
  }

  _late(r) {
    this.lateRefusals.push(r);
    if (this.lateRefusals.length > LATE_REFUSALS_KEPT) this.lateRefusals.shift();
    if (this.onrefused) {
      try {
        this.onrefused(r);
      } catch (e) {
        console.error('onrefused failed', e); // eslint-disable-line no-console
      }
    }
  }

  _onSyncAck(f) {
    const n = f.n;
    const k = f.refused === undefined ? 0 : f.refused; // a wire v1.0 router sends no `refused`
    if (!this._unanswered.has(n)) return; // not ours (or answered already)
    let refused = [];
    let overflow = false;
    for (const [m, ep] of this._unanswered) { // this epoch, and any before it whose SYNC went unanswered
      this._unanswered.delete(m);
      refused = refused.concat(ep.refused);
      overflow = overflow || ep.overflow;
      if (m === n) break;
    }
    let spilled = false;
    if (overflow) {
      refused = refused.concat(this._unfiled.splice(0, Math.max(0, k - refused.length)));
      spilled = this._spilled;
      this._spilled = false;
    }
    if (this._unfiled.length && !this._anyOverflow()) for (const r of this._unfiled.splice(0)) this._late(r);
    let outcome;
    if (refused.length < k && !spilled) {
      outcome = new RouterError(`protocol error: SYNC_ACK ${n} counts ${k} refused messages, but only `
        + `${refused.length} REFUSED arrived for the messages before it`);
    } else if (k === 0 && f.result !== 0) {
      outcome = new RouterError(`SYNC failed (SYNC_ACK ${n}: result ${f.result}, no refusals counted)`);
    } else {
      outcome = new SyncResult(n, refused);
    }
    const w = this._waiters.get(`sync:${n}`);
    this._waiters.delete(`sync:${n}`);
    if (w) {
      if (outcome instanceof SyncResult) {
        // a SYNC before this one that nobody waited for: its span is this one's too
        if (this._carried.length) outcome = new SyncResult(n, [...this._carried.splice(0), ...refused]);
        w.resolve(outcome);
      } else {
        w.reject(outcome);
      }
      return;
    }
    // Nobody waits for this SYNC any more (it timed out): its refusals go into the next sync()'s result - "on
    // an error, sync again" must not call them taken - and stay in refusal().
    this._carried.push(...refused);
  }

  _check() {
    if (this._isClosed) throw new RouterError(this.closedReason, this.closedCode);
    if (this._closing && !this._closingSync) throw new RouterError('connection closing');
  }

  /** Send a routed Message as it is; the next sync() reports whether the router took it. */
  sendMessage(msg) {
    this._check();
    this._ws.send(msg.encode());
    const id = msg.id;
    const ep = this._epoch;
    if (this._refusals.size) this._refusals.delete(toHex(id)); // (sent again: this time's answer counts)
    if (ep.ids.size < this.trackLimit) ep.ids.add(toHex(id));
    else ep.overflow = true;
    return id;
  }

  /** A signed unicast to `dst`; returns its id. A plain body that begins like a sealed one (an array whose
   * first element is "sealed") is refused (TypeError): its recipient could not tell them apart. */
  send(dst, body, opts = {}) {
    const bytes = asBytes(body);
    if (looksSealed(bytes)) throw new TypeError('a plain body may not begin like a sealed body (an array starting with "sealed")');
    return this.sendMessage(unicast(this.identity, dst, bytes, opts));
  }

  /** Publish `body` to a group; `group` is an Identity holding the group's private key. Returns the id. */
  publish(group, body, opts = {}) {
    return this.sendMessage(multicast(group, asBytes(body), opts));
  }

  /** One request and its reply; requests with the same key (two STATUS, two JOINs of one group) go one after
   * the other: their replies cannot be told apart. */
  _request(key, type, fields, timeout) {
    const before = this._asking.get(key); // (none: sent at once - a SYNC goes out when sync() is called)
    const run = before ? before.then(() => this._requestNow(key, type, fields, timeout))
      : this._requestNow(key, type, fields, timeout);
    const done = run.then(() => {}, () => {});
    this._asking.set(key, done);
    done.then(() => { if (this._asking.get(key) === done) this._asking.delete(key); });
    return run;
  }

  _requestNow(key, type, fields, timeout) {
    return new Promise((resolve, reject) => {
      let idHex = null;
      let timer = null;
      const finish = () => {
        clearTimeout(timer);
        if (this._waiters.get(key) === waiter) this._waiters.delete(key);
        if (idHex !== null && this._requestIds.get(idHex) === key) this._requestIds.delete(idHex);
      };
      const waiter = {
        resolve: (v) => { finish(); resolve(v); },
        reject: (e) => { finish(); reject(e); },
      };
      const late = () => waiter.reject(new RouterError(`no answer from the router within ${timeout} ms`));
      timer = setTimeout(late, timeout);
      this._waiters.set(key, waiter);
      try {
        const msg = unicast(this.identity, this.routerId, controlBody(type, fields), { ttl: 60 });
        idHex = toHex(msg.id);
        this._requestIds.set(idHex, key); // a REFUSED for it rejects the request at once
        this.sendMessage(msg);
      } catch (e) {
        waiter.reject(e);
      }
    });
  }

  /** JOIN a group (its 32-byte public key); true on success, false when the router refused (JOIN_ACK result 1,
   * or REFUSED: the next sync() names the reason). `local: false` also subscribes via pub/sub. */
  async join(group, { local = true, timeout = 10000 } = {}) {
    const r = await this._request(`join:${toHex(group)}`, Control.JOIN, { addr: group, local }, timeout);
    return !(r instanceof Refusal) && r.fields.result === 0;
  }

  /** LEAVE a group; true on success, false when the router refused. */
  async leave(group, { timeout = 10000 } = {}) {
    const r = await this._request(`leave:${toHex(group)}`, Control.LEAVE, { addr: group }, timeout);
    return !(r instanceof Refusal) && r.fields.result === 0;
  }

  /** PULL a stored group message by id: the Message, or null when the router does not have it or refused. */
  async pull(group, id, { timeout = 10000 } = {}) {
    const r = await this._request(`pull:${toHex(id)}`, Control.PULL, { addr: group, id }, timeout);
    return r instanceof Refusal || r.type === Control.PULL_NACK ? null : r;
  }

  /** The router's current sizes and counters, as an object of name -> non-negative integer (STATUS; local
   * services only). Rejects with MessagesRefused when the router refused it, RouterError on a timeout, a
   * closed connection or a reply that is not a map of counters. */
  async status({ timeout = 10000 } = {}) {
    const r = await this._request('status', Control.STATUS, {}, timeout);
    if (r instanceof Refusal) throw new MessagesRefused([r], null, 'STATUS');
    const stats = r.fields.stats;
    const counter = (v) => (Number.isSafeInteger(v) && v >= 0) || (typeof v === 'bigint' && v >= 0n);
    if (!stats || typeof stats !== 'object' || Array.isArray(stats) || stats instanceof Uint8Array
      || !Object.values(stats).every(counter)) {
      throw new RouterError('malformed STATUS_REPLY from the router');
    }
    return { ...stats };
  }

  /**
   * Resolve once the router processed and committed everything this connection sent before, to a SyncResult
   * naming the messages sent since the previous sync() that it did not take in full (`result.refused`,
   * `result.refusal(id)`, `result.ok`). With `rejectOnRefused: true` a refusal rejects with MessagesRefused
   * (carrying `refusals` and `result`) instead. Rejects with RouterError on a timeout, a closed connection,
   * or a SYNC_ACK that counts more refusals than arrived.
   */
  async sync({ timeout = 30000, rejectOnRefused = false } = {}) {
    const n = this._syncN++;
    this._unanswered.set(n, this._epoch);
    this._epoch = newEpoch();
    const ep = this._epoch;
    const asked = this._request(`sync:${n}`, Control.SYNC, { n }, timeout); // (its SYNC is sent by now)
    if (ep.ids.size) ep.syncs += 1;
    const result = await asked;
    if (result instanceof Refusal) throw new MessagesRefused([result], null, 'SYNC'); // the SYNC itself
    if (rejectOnRefused && !result.ok) throw new MessagesRefused(result.refused, result);
    return result;
  }

  /** The next incoming message (when no `onmessage` handler is set). */
  next() {
    if (this._queue.length) return Promise.resolve(this._queue.shift());
    if (this._isClosed) return Promise.reject(new RouterError(this.closedReason));
    return new Promise((resolve, reject) => this._readers.push({ resolve, reject }));
  }

  /** Close the connection; the promise resolves once the close began. Nothing may be sent from then on (send()
   * throws): the WebSocket drops what is sent while it closes. The router answers nothing after the close frame,
   * so if messages were sent since the last sync(), a SYNC goes first (within `timeout` ms): their refusals are
   * then known (refusal()). It resolves to true when every message sent was answered, false when that sync
   * failed (the router did not answer in time, or the connection was gone): what was sent since the last
   * sync() is then not known to be safe. A second close() meanwhile waits for the first. */
  close({ timeout = 2000 } = {}) {
    if (this._closePromise) return this._closePromise;
    const open = this._ws && !this._isClosed;
    const pending = [...this._unanswered.values(), this._epoch].some(unsynced);
    this._closing = true;
    let first = Promise.resolve(!pending);
    if (pending && open) {
      this._closingSync = true; // (sync() writes its SYNC before its first await: the one message let through)
      try {
        first = this.sync({ timeout }).then(() => true, () => false);
      } finally {
        this._closingSync = false;
      }
    }
    this._closePromise = first.then((known) => {
      if (this._ws) this._ws.close(1000);
      return known;
    });
    return this._closePromise;
  }
}

export { Identity };

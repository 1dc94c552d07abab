// A web app's connection to an upsycle router over WebSocket (docs/websocket.md).
//
// Each binary WebSocket message carries one CBOR item. On open both sides send HELLO; each answers the
// other's HELLO with AUTH (an Ed25519 signature over the context, both ids and the peer's nonce); the
// session is open once the router's AUTH verified. After that every message is a routed message or ERROR.
// Router replies (JOIN_ACK, LEAVE_ACK, SYNC_ACK, PULL_NACK: unicast messages from the router's id, signed
// by it) resolve the request that asked for them; every other message goes to `onmessage` / `next()`.
import {
  Control, ErrorCode, Identity, asError, auth, controlBody, dec, decodeControl, decodeMessage, equalBytes,
  errorItem, hello, multicast, randomBytes, toHex, unicast, verify, concat, AUTH_CONTEXT, PROTOCOL_NAME,
  PROTOCOL_VERSION,
} from './codec.js';

export class RouterError extends Error {
  constructor(message, code = null) {
    super(message);
    this.name = 'RouterError';
    this.code = code;
  }
}

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
    this.onmessage = null; // (Message) => void
    this.onclose = null; // (reason) => void
    this._isClosed = false;
    this._ws = null;
    this._nonce = randomBytes(32);
    this._waiters = new Map(); // "join:<hex>" | "leave:<hex>" | "sync:<n>" | "pull:<hex>" -> {resolve, reject}
    this._queue = [];
    this._readers = [];
    this._syncN = Math.floor(Math.random() * 2 ** 31);
  }

  _open(url, routerId, timeout, WebSocketImpl) {
    return new Promise((resolve, reject) => {
      let state = 'hello';
      let routerNonce = null;
      const timer = setTimeout(() => fail(new RouterError(`handshake not complete after ${timeout} ms`)), timeout);
      const fail = (err) => {
        clearTimeout(timer);
        if (state !== 'closed') {
          state = 'closed';
          this._closed(err.message);
          try { ws.close(); } catch { /* already closing */ }
        }
        reject(err);
      };
      const ws = new WebSocketImpl(url);
      this._ws = ws;
      ws.binaryType = 'arraybuffer';
      ws.onopen = () => ws.send(hello(this.identity, this._nonce));
      ws.onerror = () => { if (state !== 'open') fail(new RouterError(`cannot connect to ${url}`)); };
      ws.onclose = (ev) => {
        if (state !== 'open') fail(new RouterError(this.closedReason || `connection closed (${ev.code})`));
        else this._closed(this.closedReason || `connection closed (${ev.code} ${ev.reason || ''})`.trim());
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
    for (const w of this._waiters.values()) w.reject(new RouterError(this.closedReason));
    this._waiters.clear();
    for (const r of this._readers.splice(0)) r.reject(new RouterError(this.closedReason));
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
      return; // the router closes next
    }
    let msg;
    try {
      msg = decodeMessage(bytes);
    } catch (e) {
      this._protocolError(e.message);
      return;
    }
    if (msg.type === 0 && equalBytes(msg.header.src, this.routerId) && msg.signatureValid) {
      const c = decodeControl(msg.body);
      const key = c && {
        [Control.JOIN_ACK]: () => `join:${toHex(c.fields.addr)}`,
        [Control.LEAVE_ACK]: () => `leave:${toHex(c.fields.addr)}`,
        [Control.SYNC_ACK]: () => `sync:${c.fields.n}`,
        [Control.PULL_NACK]: () => `pull:${toHex(c.fields.id)}`,
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
    if (this.onmessage) this.onmessage(msg);
    else if (this._readers.length) this._readers.shift().resolve(msg);
    else this._queue.push(msg);
  }

  _check() {
    if (this._isClosed) throw new RouterError(this.closedReason);
  }

  /** Send a routed Message as it is. */
  sendMessage(msg) {
    this._check();
    this._ws.send(msg.encode());
    return msg.id;
  }

  /** A signed unicast to `dst`; returns its id. */
  send(dst, body, opts = {}) {
    return this.sendMessage(unicast(this.identity, dst, asBytes(body), opts));
  }

  /** Publish `body` to a group; `group` is an Identity holding the group's private key. Returns the id. */
  publish(group, body, opts = {}) {
    return this.sendMessage(multicast(group, asBytes(body), opts));
  }

  _request(key, type, fields, timeout) {
    return new Promise((resolve, reject) => {
      const timer = setTimeout(() => {
        this._waiters.delete(key);
        reject(new RouterError(`no answer from the router within ${timeout} ms`));
      }, timeout);
      this._waiters.set(key, {
        resolve: (v) => { clearTimeout(timer); resolve(v); },
        reject: (e) => { clearTimeout(timer); reject(e); },
      });
      try {
        this.send(this.routerId, controlBody(type, fields), { ttl: 60 });
      } catch (e) {
        this._waiters.delete(key);
        clearTimeout(timer);
        reject(e);
      }
    });
  }

  /** JOIN a group (its 32-byte public key); true on success. `local: false` also subscribes via pub/sub. */
  async join(group, { local = true, timeout = 10000 } = {}) {
    const r = await this._request(`join:${toHex(group)}`, Control.JOIN, { addr: group, local }, timeout);
    return r.fields.result === 0;
  }

  async leave(group, { timeout = 10000 } = {}) {
    const r = await this._request(`leave:${toHex(group)}`, Control.LEAVE, { addr: group }, timeout);
    return r.fields.result === 0;
  }

  /** PULL a stored group message by id: the Message, or null when the router does not have it. */
  async pull(group, id, { timeout = 10000 } = {}) {
    const r = await this._request(`pull:${toHex(id)}`, Control.PULL, { addr: group, id }, timeout);
    return r.type === Control.PULL_NACK ? null : r;
  }

  /** Resolve once the router processed and committed everything this connection sent before. */
  async sync({ timeout = 30000 } = {}) {
    const n = this._syncN++;
    const r = await this._request(`sync:${n}`, Control.SYNC, { n }, timeout);
    if (r.fields.result !== 0) throw new RouterError('SYNC failed');
  }

  /** The next incoming message (when no `onmessage` handler is set). */
  next() {
    if (this._queue.length) return Promise.resolve(this._queue.shift());
    if (this._isClosed) return Promise.reject(new RouterError(this.closedReason));
    return new Promise((resolve, reject) => this._readers.push({ resolve, reject }));
  }

  close() {
    if (this._ws) this._ws.close(1000);
  }
}

export { Identity };

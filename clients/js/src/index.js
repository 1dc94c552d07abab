// upsycle router client for web apps: `RouterClient.connect(url, identity)`; see docs/websocket.md.
// `sync()` resolves to a SyncResult naming the refused messages (wire v1.1, docs/protocol.md "Refusals").
export * from './codec.js';
export { MessagesRefused, Refusal, RouterClient, RouterError, SyncResult } from './client.js';

// upsycle router client for web apps: `RouterClient.connect(url, identity)`; see docs/websocket.md.
export * from './codec.js';
export { RouterClient, RouterError } from './client.js';

// The demo page: connect to a router, join one group, publish, show what arrives.
// Query parameters prefill the form: ?router=ws://HOST:PORT/upsycle&group=SEEDHEX&autoconnect=1
import { Identity, RouterClient, fromHex, toHex } from '../../clients/js/src/index.js';

const $ = (id) => document.getElementById(id);
const params = new URLSearchParams(location.search);
const me = Identity.generate();
const decoder = new TextDecoder();
let client = null;
let group = null;

$('me').textContent = me.hex;
if (params.get('router')) $('router').value = params.get('router');
$('group').value = params.get('group') || toHex(Identity.generate().seed);

function status(text) {
  $('status').textContent = text;
}

function show(msg, mine = false) {
  const li = document.createElement('li');
  li.dataset.id = toHex(msg.id);
  if (mine) li.className = 'mine';
  const body = document.createElement('div');
  body.className = 'body';
  body.textContent = decoder.decode(msg.body);
  const meta = document.createElement('div');
  meta.className = 'meta';
  meta.textContent = `${mine ? 'sent' : 'received'} ${new Date().toLocaleTimeString()} id ${toHex(msg.id).slice(0, 16)}`;
  li.append(body, meta);
  $('messages').prepend(li);
}

async function connect() {
  if (client) client.close();
  $('publish').disabled = true;
  try {
    group = new Identity(fromHex($('group').value.trim()));
  } catch (e) {
    status(`error: ${e.message}`);
    return;
  }
  status('connecting');
  try {
    client = await RouterClient.connect($('router').value.trim(), me);
    client.onmessage = (msg) => {
      if (msg.type === 1 && toHex(msg.header.grp) === group.hex && msg.signatureValid) show(msg);
    };
    client.onclose = (reason) => {
      status(`closed: ${reason}`);
      $('publish').disabled = true;
    };
    if (!(await client.join(group.publicKey))) {
      status('error: the router refused the JOIN');
      return;
    }
    status(`joined ${group.hex}`);
    $('publish').disabled = false;
  } catch (e) {
    status(`error: ${e.message}`);
  }
}

async function publish() {
  const text = $('text').value;
  if (!client || !text) return;
  const id = client.publish(group, text);
  show({ id, body: new TextEncoder().encode(text) }, true);
  $('text').value = '';
  try {
    await client.sync(); // the router has it committed
    status(`joined ${group.hex}; published ${toHex(id).slice(0, 16)}`);
  } catch (e) {
    status(`error: ${e.message}`);
  }
}

$('new-group').onclick = () => { $('group').value = toHex(Identity.generate().seed); };
$('connect').onclick = connect;
$('publish').onclick = publish;
$('text').onkeydown = (e) => { if (e.key === 'Enter') publish(); };
if (params.get('autoconnect')) connect();

// Drives headless Debian Chromium through playwright-core for tests/test_browser.py.
//
// Usage: node drive.mjs PAGE_URL USER_DATA_DIR
// Talks to the test over stdin/stdout, one line each:
//   -> "JOINED <status>"          the page is connected and joined the group
//   <- "EXPECT <text>"            the test published <text>; wait until the page shows it
//   -> "SHOWN <text>"
//   <- "PUBLISH <text>"           type <text> into the page and click Publish
//   -> "PUBLISHED <status>"       the page's SYNC was acknowledged
//   -> "RESULT <json>"            everything the page listed, then the browser is closed
// Every wait is bounded; on any failure it prints "FAIL <reason>" and exits 1.
import { createRequire } from 'node:module';
import { createInterface } from 'node:readline';

// playwright-core is a dev dependency of the JS client (clients/js/package.json, installed by setup.sh)
const { chromium } = createRequire(new URL('../../clients/js/package.json', import.meta.url))('playwright-core');

const [pageUrl, userDataDir] = process.argv.slice(2);
const STEP = 20000;
const lines = createInterface({ input: process.stdin })[Symbol.asyncIterator]();
const say = (s) => process.stdout.write(`${s}\n`);

async function command(verb) {
  const timeout = new Promise((_, rej) => setTimeout(() => rej(new Error(`no ${verb} from the test`)), STEP));
  const { value, done } = await Promise.race([lines.next(), timeout]);
  if (done || !value.startsWith(`${verb} `)) throw new Error(`expected ${verb}, got ${value}`);
  return value.slice(verb.length + 1);
}

let context;
const consoleLines = [];
try {
  context = await chromium.launchPersistentContext(userDataDir, {
    executablePath: process.env.CHROMIUM || '/usr/bin/chromium',
    headless: true,
    ignoreHTTPSErrors: true, // wss:// with the test's self-signed certificate
    timeout: STEP,
    args: ['--headless', '--no-sandbox', '--disable-gpu', '--disable-quic', '--no-first-run',
      '--disable-background-networking', '--disable-component-update', '--disable-sync'],
  });
  const page = context.pages()[0] || (await context.newPage());
  page.on('console', (m) => consoleLines.push(`${m.type()}: ${m.text()}`));
  page.on('pageerror', (e) => consoleLines.push(`pageerror: ${e.message}`));
  await page.goto(pageUrl, { timeout: STEP });
  const status = page.locator('#status');
  await page.waitForFunction(() => /^(joined|error|closed)/.test(document.getElementById('status').textContent),
    null, { timeout: STEP });
  const st = await status.textContent();
  if (!st.startsWith('joined')) throw new Error(`page status: ${st}`);
  say(`JOINED ${st}`);

  const expected = await command('EXPECT');
  await page.locator('#messages li:not(.mine) .body', { hasText: expected }).first().waitFor({ timeout: STEP });
  say(`SHOWN ${expected}`);

  const text = await command('PUBLISH');
  await page.fill('#text', text);
  await page.click('#publish');
  await page.waitForFunction(() => /published|error/.test(document.getElementById('status').textContent),
    null, { timeout: STEP });
  const after = await status.textContent();
  if (!after.includes('published')) throw new Error(`page status after publishing: ${after}`);
  say(`PUBLISHED ${after}`);

  const items = await page.$$eval('#messages li', (lis) => lis.map((li) => ({
    mine: li.classList.contains('mine'), body: li.querySelector('.body').textContent, id: li.dataset.id,
  })));
  say(`RESULT ${JSON.stringify({ items, console: consoleLines })}`);
  await context.close();
  process.exit(0);
} catch (e) {
  say(`FAIL ${e.message.split('\n')[0]} | console: ${consoleLines.join(' / ')}`);
  if (context) await context.close().catch(() => {});
  process.exit(1);
}

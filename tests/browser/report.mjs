// Renders an analytics report.html in headless Debian Chromium (playwright-core) for
// tests/analytics/test_analytics_report_browser.py: takes a full-page screenshot and prints what the test checks.
//
// Usage: node report.mjs REPORT_URL SCREENSHOT.png WIDTH HEIGHT USER_DATA_DIR
// Prints one line, "RESULT <json>": the viewport and page widths, every table's width against its container,
// the lost-deliveries table's rows, the sentences shown for empty tables, whether each image loaded, the
// headings, and the console messages. Every wait is bounded; on failure it prints "FAIL <reason>", exits 1.
import { createRequire } from 'node:module';

// playwright-core is a dev dependency of the JS client (clients/js/package.json, installed by setup.sh)
const { chromium } = createRequire(new URL('../../clients/js/package.json', import.meta.url))('playwright-core');

const [url, shot, width, height, userDataDir] = process.argv.slice(2);
const STEP = 20000;
let context;
const consoleLines = [];
try {
  context = await chromium.launchPersistentContext(userDataDir, {
    executablePath: process.env.CHROMIUM || '/usr/bin/chromium',
    headless: true,
    viewport: { width: Number(width), height: Number(height) },
    timeout: STEP,
    args: ['--headless', '--no-sandbox', '--disable-gpu', '--no-first-run', '--disable-background-networking',
      '--disable-component-update', '--disable-sync'],
  });
  const page = context.pages()[0] || (await context.newPage());
  page.on('console', (m) => consoleLines.push(`${m.type()}: ${m.text()}`));
  page.on('pageerror', (e) => consoleLines.push(`pageerror: ${e.message}`));
  page.on('request', (r) => { if (!/^(file|data):/.test(r.url())) consoleLines.push(`request: ${r.url()}`); });
  await page.goto(url, { timeout: STEP, waitUntil: 'load' });
  const result = await page.evaluate(() => {
    const doc = document.documentElement;
    const text = (el) => el.textContent.replace(/\s+/g, ' ').trim();
    return {
      viewport: window.innerWidth,
      scrollWidth: doc.scrollWidth,
      bodyScrollWidth: document.body.scrollWidth,
      tables: [...document.querySelectorAll('table')].map((t) => ({
        id: t.id,
        width: Math.ceil(t.getBoundingClientRect().width),
        container: Math.floor(t.parentElement.getBoundingClientRect().width),
        right: Math.ceil(t.parentElement.getBoundingClientRect().right),
        scrolls: getComputedStyle(t.parentElement).overflowX,
        headers: [...t.querySelectorAll('th')].map(text),
      })),
      lost: [...document.querySelectorAll('table#lost tbody tr')].map((tr) => ({
        id: tr.dataset.id,
        cause: tr.dataset.cause,
        cells: [...tr.querySelectorAll('td')].map(text),
      })),
      empty: [...document.querySelectorAll('p.empty')].map(text),
      loss: [...document.querySelectorAll('p.loss')].map(text),
      images: [...document.querySelectorAll('img')].map((i) => ({
        alt: i.alt, loaded: i.complete && i.naturalWidth > 0, width: Math.ceil(i.getBoundingClientRect().width),
      })),
      headings: [...document.querySelectorAll('h2')].map(text),
    };
  });
  await page.screenshot({ path: shot, fullPage: true, timeout: STEP });
  console.log(`RESULT ${JSON.stringify({ ...result, console: consoleLines })}`);
  await context.close();
  process.exit(0);
} catch (e) {
  console.log(`FAIL ${e.message.split('\n')[0]} | console: ${consoleLines.join(' / ')}`);
  if (context) await context.close().catch(() => {});
  process.exit(1);
}

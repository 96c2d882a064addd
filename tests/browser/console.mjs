// Drives the operator console in headless Debian chromium (playwright-core, no downloaded
// browser): sign in, retry a dead operation from the DLQ inbox with a patched input and see it
// succeed, see an agent's pending tool call with its arguments (a secret redacted) and approve
// it, pause a batch, pause a running operation from its page (its Why section names the pause),
// preview a pause of its kind and resume the operation from the Pauses page; a screenshot of
// every page goes to OUTDIR.
//
// Usage: node tests/browser/console.mjs BASE TOKEN OUTDIR DEAD_OP WAITING_OP BATCH RUNNING_OP
// (NODE_PATH must hold playwright-core: see .ci/browser-deps). Exits non-zero on any failure.
import { createRequire } from 'node:module';
import { mkdirSync } from 'node:fs';
import { join } from 'node:path';

const require = createRequire(import.meta.url);
const { chromium } = require('playwright-core');

const [base, token, outdir, deadOp, waitingOp, batch, runningOp] = process.argv.slice(2);
if (!runningOp) {
  console.error('usage: console.mjs BASE TOKEN OUTDIR DEAD_OP WAITING_OP BATCH RUNNING_OP');
  process.exit(2);
}
mkdirSync(outdir, { recursive: true });

const browser = await chromium.launch({
  executablePath: process.env.CHROMIUM || '/usr/bin/chromium',
  headless: true,
  args: ['--no-sandbox', '--disable-gpu', '--disable-quic', '--no-first-run',
    '--disable-background-networking', '--disable-component-update', '--disable-sync'],
});
const page = await browser.newPage({ viewport: { width: 1366, height: 900 } });
page.setDefaultTimeout(15000);
const shot = (name) => page.screenshot({ path: join(outdir, `${name}.png`), fullPage: true });
const flash = async () => (await page.locator('#flash').textContent()).trim();
const step = (what) => console.log(`console.mjs: ${what}`);

try {
  step('sign in');
  await page.goto(`${base}/ui/login`);
  await shot('login');
  await page.fill('input[name=token]', token);
  await page.click('button[type=submit]');
  await page.waitForURL(`${base}/ui`);
  await page.locator('h1', { hasText: 'Overview' }).waitFor();
  await shot('overview');

  step('the dead operation, before the retry');
  await page.goto(`${base}/ui/operations/${deadOp}`);
  await page.locator('.badge', { hasText: 'dead' }).first().waitFor();
  await shot('operation-dead');

  step('patch and retry it from the DLQ inbox');
  await page.goto(`${base}/ui/dlq`);
  const row = page.locator(`tr[data-op="${deadOp}"]`);
  await row.waitFor();
  await shot('dlq');
  await row.locator('summary', { hasText: 'Patch' }).click();
  await row.locator('textarea[name=patch_input]').fill('{"steps": [{"work_ms": 1}, {"work_ms": 1}]}');
  await row.locator('input[name=reason]').first().fill('fixed the input in the console');
  await row.locator('button[data-action=patch-retry]').click();
  await page.waitForURL(`${base}/ui/dlq`);
  const retried = await flash();
  if (!retried.startsWith('retried')) throw new Error(`retry: ${retried}`);

  step('see it succeed');
  let succeeded = false;
  for (let i = 0; i < 100 && !succeeded; i++) {
    await page.goto(`${base}/ui/operations/${deadOp}`);
    succeeded = (await page.locator('h1 .badge').textContent()).trim() === 'succeeded';
    if (!succeeded) await page.waitForTimeout(200);
  }
  if (!succeeded) throw new Error(`operation ${deadOp} did not succeed after the retry`);
  await shot('operation-retried');

  step('see the pending tool call and its arguments, then approve it');
  await page.goto(`${base}/ui/approvals`);
  const waiting = page.locator(`tr[data-op="${waitingOp}"]`);
  await waiting.locator('[data-tool="kv_put"]').waitFor();
  const call = await waiting.locator('.pending').textContent();
  for (const needle of ['kv_put', '"key": "stripe"', '"note": "rotate monthly"', '"api_key": "[redacted]"',
    'I will keep the Stripe key']) {
    if (!call.includes(needle)) throw new Error(`the approval lacks ${needle}: ${call}`);
  }
  if (call.includes('sk-live')) throw new Error(`the approval shows the secret: ${call}`);
  await shot('approvals');
  await page.goto(`${base}/ui/operations/${waitingOp}`);
  await waiting.page().locator('.pending [data-tool="kv_put"]').waitFor();
  const why = await page.locator('#why').textContent();
  if (!why.includes('approval')) throw new Error(`the Why section does not name the approval: ${why}`);
  await shot('operation-waiting');
  await page.goto(`${base}/ui/approvals`);
  await waiting.locator('form[action$="/approve"] input[name=reason]').fill('looks right');
  await waiting.locator('button[data-action=approve]').click();
  await page.waitForURL(`${base}/ui/approvals`);
  const approved = await flash();
  if (!approved.startsWith('approved')) throw new Error(`approve: ${approved}`);

  step('pause the batch');
  await page.goto(`${base}/ui/batches`);
  const b = page.locator(`tr[data-batch="${batch}"]`);
  await b.locator('form[action$="/pause"] input[name=reason]').fill('checking the output');
  await b.locator('button[data-action=pause]').click();
  await page.waitForURL(`${base}/ui/batches`);
  const paused = await flash();
  if (!paused.startsWith('paused')) throw new Error(`pause: ${paused}`);
  await shot('batches');

  step('pause a running operation from its page');
  const opPage = `${base}/ui/operations/${runningOp}`;
  await page.goto(opPage);
  await page.locator('form[action$="/pause"] input[name=reason]').fill('provider degraded');
  await page.locator('button[data-action=pause]').click();
  await page.waitForURL(opPage);
  const opPaused = await flash();
  if (!opPaused.startsWith('paused operation')) throw new Error(`pause: ${opPaused}`);
  // It stops at its next step boundary; then its Why section names the pause.
  let held = '';
  for (let i = 0; i < 150 && !held.includes('paused: operation'); i++) {
    if (i > 0) await page.waitForTimeout(200);
    await page.goto(opPage);
    held = await page.locator('#why').textContent();
  }
  if (!held.includes('paused: operation') || !held.includes('provider degraded')) {
    throw new Error(`the Why section does not name the pause: ${held}`);
  }
  await page.locator('button[data-action=resume]').waitFor();
  await shot('operation-paused');

  step('preview a pause of its kind, then resume the operation from the Pauses page');
  await page.goto(`${base}/ui/pauses`);
  await page.locator('form[action="/ui/pauses"] input[name=kind]').fill('script');
  await page.locator('form[action="/ui/pauses"] input[name=reason]').fill('how much would this hold?');
  await page.locator('button[data-action=preview]').click();
  await page.waitForURL(`${base}/ui/pauses`);
  const preview = await flash();
  if (!preview.startsWith('dry run: would hold')) throw new Error(`preview: ${preview}`);
  const pauseRow = page.locator('tr[data-pause]', { hasText: runningOp });
  if ((await page.locator('tr[data-pause]').count()) !== 1) throw new Error('the preview made a pause');
  await shot('pauses');
  await pauseRow.locator('input[name=reason]').fill('provider recovered');
  await pauseRow.locator('button[data-action=resume]').click();
  await page.waitForURL(`${base}/ui/pauses`);
  const resumed = await flash();
  if (!resumed.startsWith('resumed operation')) throw new Error(`resume: ${resumed}`);

  step('the operations list');
  await page.goto(`${base}/ui/operations`);
  await shot('operations');
  await page.goto(`${base}/ui`);
  await shot('overview-after');
  console.log(JSON.stringify({ ok: true, retried, approved, paused, opPaused, preview, resumed }));
} catch (e) {
  await shot('failure').catch(() => {});
  console.error(`console.mjs: FAILED: ${e.message}`);
  process.exitCode = 1;
} finally {
  await browser.close();
}

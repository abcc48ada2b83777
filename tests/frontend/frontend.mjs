// Drives ComfyUI's own front end (comfyui-frontend-package) served by
// `sdkit serve --front-end` in headless Chromium: the app loads its node
// list from /object_info with no page errors, a workflow is loaded and
// queued through the UI
// with the Run button, and the SaveImage preview is fetched from /view;
// the template browser lists sdkit's examples and opens one.
//
//   node tests/frontend/frontend.mjs URL WORKFLOW.json
// Exits non-zero with a message on any failure.
import { chromium } from 'playwright-core';
import { readFileSync } from 'node:fs';

const [url, workflowFile] = process.argv.slice(2);
const workflow = JSON.parse(readFileSync(workflowFile, 'utf8'));
const fail = (msg) => { console.error('FAIL: ' + msg); process.exit(1); };

const browser = await chromium.launch({
  executablePath: process.env.CHROMIUM || '/usr/bin/chromium',
  args: ['--no-sandbox', '--disable-gpu', '--disable-quic', '--no-first-run',
         '--disable-background-networking', '--disable-component-update', '--disable-sync'],
});
try {
  const page = await browser.newPage();
  const pageErrors = [];
  const consoleErrors = [];
  const badResponses = [];
  // Files ComfyUI itself answers 404 for on a fresh profile.
  const optional = ['/api/userdata/user.css', '/user.css', '/api/userdata/comfy.templates.json'];
  page.on('pageerror', (e) => pageErrors.push(String(e.stack || e)));
  page.on('console', (m) => {
    const t = m.text();
    // Resource failures are judged by their responses below; requests to
    // hosts outside the sandbox fail by design.
    if (m.type() === 'error' && !t.startsWith('Failed to load resource')) consoleErrors.push(t);
  });
  page.on('response', (r) => {
    const u = new URL(r.url());
    if (u.origin === new URL(url).origin && r.status() >= 400 && !optional.includes(u.pathname)) {
      badResponses.push(`${r.status()} ${r.request().method()} ${u.pathname}${u.search}`);
    }
  });

  await page.goto(url);
  await page.waitForFunction(
    () => window.app?.graph && window.LiteGraph &&
      Object.keys(window.LiteGraph.registered_node_types).includes('KSampler'),
    null, { timeout: 90000 },
  ).catch(() => fail('the app did not register the node list from /object_info'));
  const count = await page.evaluate(() => Object.keys(window.LiteGraph.registered_node_types).length);
  console.log(`front end loaded ${count} node types`);

  // The first screen's template browser lists sdkit's examples, and one
  // opens as a workflow (a fresh profile opens the browser by itself).
  await page.evaluate(() => window.app.extensionManager.command.execute('Comfy.BrowseTemplates'));
  const cards = page.locator('[data-testid^="template-workflow-"]');
  await cards.first().waitFor({ timeout: 30000 })
    .catch(() => fail('the template browser lists no templates'));
  console.log('templates listed:', await cards.count());
  await cards.first().click();
  await page.waitForFunction(
    () => window.app.graph.nodes.some((n) => n.type === 'SaveImage'),
    null, { timeout: 30000 },
  ).catch(() => fail('the first template did not open as a workflow'));

  await page.evaluate(async (wf) => { await window.app.loadGraphData(wf); }, workflow);
  const loaded = await page.evaluate(() => window.app.graph.nodes.map((n) => n.type).sort());
  console.log('workflow nodes:', loaded.join(', '));
  if (!loaded.includes('SaveImage')) fail('the workflow did not load');

  // Both waits start before the click; a failure is reported, not thrown.
  const viewed = page.waitForResponse(
    (r) => r.url().includes('/view?') && r.url().includes('type=output') && r.status() === 200,
    { timeout: 120000 },
  ).catch(() => null);
  const queued = page.waitForResponse(
    (r) => new URL(r.url()).pathname.endsWith('/prompt') && r.request().method() === 'POST',
    { timeout: 30000 },
  ).catch(() => null);
  await page.getByRole('button', { name: 'Run', exact: true }).first().click({ timeout: 30000 })
    .catch(async (e) => {
      await page.screenshot({ path: process.env.SCREENSHOT || '/tmp/sdkit-frontend.png' });
      fail('cannot click Run: ' + e.message.split('\n')[0]);
    });
  const q = (await queued) ?? fail('the Run button did not queue the prompt');
  if (q.status() !== 200) fail(`POST /prompt answered ${q.status()}: ${await q.text()}`);
  const v = (await viewed) ?? fail('the output image was never fetched from /view');
  const type = v.headers()['content-type'];
  if (!type?.startsWith('image/')) fail(`/view answered ${type}`);
  console.log('output image shown:', new URL(v.url()).search);

  if (pageErrors.length) fail('page errors:\n' + pageErrors.join('\n'));
  if (consoleErrors.length) fail('console errors:\n' + consoleErrors.join('\n'));
  if (badResponses.length) fail('failed requests:\n' + badResponses.join('\n'));
  console.log('ok');
} finally {
  await browser.close();
}

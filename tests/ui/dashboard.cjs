// The dashboard as a person uses it, in Debian's chromium driven by playwright-core
// (installed by `deploy/local/stack test`), against a whole running system started
// by tests/tests/dashboard.rs. It signs in, watches tasks move without reloading,
// decides an outcome_unknown case, approves a refund, reads a timeline, keeps a
// screenshot, and checks that another tenant's token sees none of it.
'use strict';

const fs = require('node:fs');
const os = require('node:os');
const path = require('node:path');
const assert = require('node:assert/strict');

const need = (name) => {
  const value = process.env[name];
  if (!value) throw new Error(name + ' is not set: run through tests/tests/dashboard.rs');
  return value;
};
const { chromium } = require(need('FENCELINE_UI_PLAYWRIGHT'));
const BASE = need('FENCELINE_UI_URL');
const TOKEN_A = need('FENCELINE_UI_TOKEN_A');
const TOKEN_B = need('FENCELINE_UI_TOKEN_B');
const TENANT_A = need('FENCELINE_UI_TENANT_A');
const TENANT_B = need('FENCELINE_UI_TENANT_B');
const SCREENSHOT = need('FENCELINE_UI_SCREENSHOT');
const DECISION_SCREENSHOT = SCREENSHOT.replace(/\.png$/, '') + '-decision.png';
const APPROVAL_SCREENSHOT = SCREENSHOT.replace(/\.png$/, '') + '-approval.png';
const CHROMIUM = process.env.FENCELINE_UI_CHROMIUM || '/usr/bin/chromium';
const LONG = 40_000;

const started = Date.now();
const say = (text) => console.log(`[ui ${((Date.now() - started) / 1000).toFixed(1)} s] ${text}`);

async function submit(token, key, body) {
  const response = await fetch(BASE + '/v1/tasks', {
    method: 'POST',
    headers: { Authorization: 'Bearer ' + token, 'Content-Type': 'application/json', 'Idempotency-Key': key },
    body: JSON.stringify(body),
  });
  const answer = await response.json();
  assert.equal(response.status, 202, JSON.stringify(answer));
  return answer.task_id;
}

/** Everything the event stream of `token` carries for `ms` milliseconds. */
async function listen(token, ms) {
  const controller = new AbortController();
  const response = await fetch(BASE + '/v1/events', {
    headers: { Authorization: 'Bearer ' + token, Accept: 'text/event-stream' },
    signal: controller.signal,
  });
  assert.equal(response.status, 200);
  assert.match(response.headers.get('content-type'), /^text\/event-stream/);
  let text = '';
  const reading = (async () => {
    try {
      for await (const chunk of response.body) text += Buffer.from(chunk).toString('utf8');
    } catch (_) { /* aborted */ }
  })();
  await new Promise((resolve) => setTimeout(resolve, ms));
  controller.abort();
  await reading;
  return text;
}

const row = (id) => `#task-rows tr[data-task-id="${id}"]`;

async function waitState(page, id, state) {
  await page.waitForSelector(`${row(id)}[data-state="${state}"]`, { timeout: LONG });
}

async function main() {
  const profile = fs.mkdtempSync(path.join(os.tmpdir(), 'fenceline-ui-profile-'));
  const context = await chromium.launchPersistentContext(profile, {
    executablePath: CHROMIUM,
    headless: true,
    args: ['--headless', '--no-sandbox', '--disable-gpu', '--disable-quic', '--no-first-run',
      '--disable-background-networking', '--disable-component-update', '--disable-sync'],
    viewport: { width: 1360, height: 1000 },
  });
  try {
    const page = context.pages()[0] || await context.newPage();
    const problems = [];
    page.on('console', (message) => {
      // The one expected error: the 401 of the wrong token tried first.
      const expected = /status of 401/.test(message.text());
      if ((message.type() === 'error' && !expected) || /Content.Security.Policy|Refused to/i.test(message.text())) {
        problems.push('console: ' + message.text());
      }
    });
    page.on('pageerror', (error) => problems.push('page error: ' + error.message));
    let loads = 0;
    page.on('load', () => { loads += 1; });

    // The page and its headers.
    const response = await page.goto(BASE + '/ui');
    const headers = response.headers();
    const csp = headers['content-security-policy'] || '';
    for (const directive of ["default-src 'none'", "script-src 'self'", "style-src 'self'", "connect-src 'self'",
      "base-uri 'none'", "frame-ancestors 'none'", "form-action 'self'"]) {
      assert.ok(csp.includes(directive), `CSP has ${directive}: ${csp}`);
    }
    assert.ok(!csp.includes('unsafe'), 'no unsafe-* in the CSP: ' + csp);
    assert.equal(headers['x-content-type-options'], 'nosniff');
    assert.equal(headers['x-frame-options'], 'DENY');
    say('CSP: ' + csp);
    const unauthenticated = await fetch(BASE + '/v1/events');
    assert.equal(unauthenticated.status, 401, 'the event stream needs a token');

    // A wrong token is refused on the page.
    await page.fill('#token', 'fl_not_a_token');
    await page.click('#sign-in-form button[type=submit]');
    await page.waitForFunction(() => document.getElementById('sign-in-error').textContent.includes('refused'));

    // Sign in as tenant A; the stream goes live.
    await page.fill('#token', TOKEN_A);
    await page.click('#sign-in-form button[type=submit]');
    await page.waitForFunction((t) => document.getElementById('tenant').textContent.includes(t), TENANT_A);
    await page.waitForSelector('#live.on', { timeout: LONG });
    say('signed in as ' + TENANT_A + ', event stream live');
    assert.equal(await page.evaluate(() => sessionStorage.getItem('fenceline.dashboard.token')), TOKEN_A);

    // Record every state the page shows for any task, without reloading.
    await page.evaluate(() => {
      window.seenStates = {};
      const note = () => {
        for (const tr of document.querySelectorAll('#task-rows tr')) {
          const seen = (window.seenStates[tr.dataset.taskId] ||= []);
          if (seen[seen.length - 1] !== tr.dataset.state) seen.push(tr.dataset.state);
        }
      };
      new MutationObserver(note).observe(document.getElementById('task-rows'), { childList: true, subtree: true, attributes: true });
    });

    // A paid call whose answer is lost after the work, at a provider that can
    // neither dedupe nor be asked: a genuine outcome_unknown. Its label is markup.
    const markup = '<img src=x onerror="window.pwned=1">';
    const unknown = await submit(TOKEN_A, 'ui-unknown', {
      kind: 'image.generate', input: { prompt: 'a red shoe' }, labels: { probe: markup, team: 'catalogue' },
    });
    say('submitted ' + unknown);
    await page.waitForSelector(row(unknown), { timeout: LONG });
    await waitState(page, unknown, 'outcome_unknown');
    const moves = await page.evaluate((id) => window.seenStates[id], unknown);
    say('the page showed it ' + moves.join(' → '));
    assert.ok(moves.length >= 2, 'the row moved through states live: ' + moves.join(', '));

    // Escaping: the label shows as text and nothing ran.
    assert.ok((await page.textContent(row(unknown))).includes(markup), 'the markup is shown as text');
    assert.equal(await page.evaluate(() => window.pwned), undefined, 'no injected script ran');
    assert.equal(await page.$('img[src="x"]'), null, 'no injected element');

    // The case, with its evidence, in the people's queue.
    const card = `#cases article[data-task-id="${unknown}"]`;
    await page.waitForSelector(card, { timeout: LONG });
    const evidence = await page.$$eval(card + ' .evidence li', (items) => items.map((li) => li.textContent));
    say('evidence: ' + evidence.join(' | '));
    assert.ok(evidence.length >= 1, 'the case shows its evidence');
    // The page as a person finds it: the case waiting, its task's timeline open.
    await page.click(row(unknown));
    await page.waitForSelector(`#detail[data-task-id="${unknown}"][data-state="outcome_unknown"]`);
    await page.screenshot({ path: DECISION_SCREENSHOT });
    say('screenshot of the decision: ' + DECISION_SCREENSHOT);
    // Retry only after the explicit acknowledgement that it may be charged again.
    assert.ok(await page.isDisabled(card + ' button.retry'), 'retry is disabled before the acknowledgement');
    await page.check(card + ' input.acknowledge');
    assert.ok(await page.isEnabled(card + ' button.retry'), 'and enabled after it');
    await page.click(card + ' button.retry');
    await page.waitForFunction((sel) => document.querySelector(sel + ' .outcome')?.textContent.includes('Name the person'), card);
    await page.fill(card + ' input.decided-by', 'Rui Costa');
    await page.fill(card + ' textarea.note', 'the provider shows no image for this key');
    await page.click(card + ' button.retry');
    await page.waitForFunction((sel) => document.querySelector(sel + ' .outcome')?.textContent.includes('Recorded'), card);
    await waitState(page, unknown, 'succeeded');
    say('retried as new after the acknowledgement: succeeded');
    await page.waitForSelector(card, { state: 'detached', timeout: LONG });

    // A refund that waits for an approval.
    const refund = await submit(TOKEN_A, 'ui-refund', {
      kind: 'ticket.triage', input: { ticket: 'T-81', amount_cents: 2500, note: markup }, labels: { team: 'support' },
    });
    const approval = `#approval-list article[data-task-id="${refund}"]`;
    await page.waitForSelector(approval + ' button.approve:not([disabled])', { timeout: LONG });
    // The card says what the approval lets run and what it rests on, and the input.
    const shown = await page.textContent(approval);
    assert.ok(shown.includes('refund') && shown.includes('It rests on') && shown.includes('T-81'), shown);
    await page.click(approval + ' details summary');
    assert.ok((await page.textContent(approval)).includes('<img src=x onerror='), 'the input\'s markup is shown as text');
    assert.equal(await page.evaluate(() => window.pwned), undefined, 'no injected script ran');
    assert.equal(await page.$('img[src="x"]'), null, 'no injected element');
    await page.locator(approval).screenshot({ path: APPROVAL_SCREENSHOT });
    say('screenshot of the approval: ' + APPROVAL_SCREENSHOT);
    // The name last used is offered again; without one, nothing is sent.
    assert.equal(await page.inputValue(approval + ' input.decided-by'), 'Rui Costa');
    await page.fill(approval + ' input.decided-by', '');
    await page.click(approval + ' button.approve');
    await page.waitForFunction((sel) => document.querySelector(sel + ' .outcome')?.textContent.includes('Name the person'), approval);
    await page.fill(approval + ' input.decided-by', 'Ana Lima');
    await page.fill(approval + ' textarea.note', 'checked the ticket');
    await page.click(approval + ' button.approve');
    await page.waitForFunction((sel) => document.querySelector(sel + ' .outcome')?.textContent.includes('Approved'), approval);
    await waitState(page, refund, 'succeeded');
    say('refund approved: succeeded');

    // Filters: by kind, and by label.
    await page.fill('#filter-kind', 'ticket.triage');
    await page.click('#filters button[type=submit]');
    await page.waitForSelector(row(unknown), { state: 'detached' });
    assert.ok(await page.$(row(refund)), 'the refund is a ticket.triage');
    await page.fill('#filter-kind', '');
    await page.fill('#filter-label', 'team:catalogue');
    await page.click('#filters button[type=submit]');
    await page.waitForSelector(row(refund), { state: 'detached' });
    assert.ok(await page.$(row(unknown)), 'the image carries team:catalogue');
    await page.click('#filter-clear');
    await page.waitForSelector(row(refund));

    // One task's timeline: attempts, phases, checkpoints, the signal, the trace.
    await page.click(row(refund));
    await page.waitForSelector(`#detail[data-task-id="${refund}"][data-state="succeeded"]`);
    for (const event of ['TaskAccepted', 'AttemptClaimed', 'CallIntentRecorded', 'StepCheckpointed', 'AwaitingSignal',
      'ApprovalDecided', 'AttemptSucceeded', 'TaskStatus']) {
      await page.waitForSelector(`#timeline li[data-event="${event}"]`, { timeout: LONG });
    }
    assert.match(await page.textContent('#detail-facts dd[data-fact="trace id"]'), /^[0-9a-f]{32}$/);
    // After it moved on: its input, its steps' outputs and the decision on record.
    const decided = await page.textContent('#detail-decided');
    assert.ok(decided.includes('T-81') && decided.includes('draft') && decided.includes('refund'), decided);
    const record = await page.textContent('#detail-decided .decisions li[data-decision="approve"]');
    assert.ok(record.includes('Ana Lima') && record.includes('checked the ticket'), record);
    // And the decided one: its resolution and a second attempt.
    await page.click(row(unknown));
    await page.waitForSelector(`#detail[data-task-id="${unknown}"] #timeline li[data-event="ResolutionDecided"]`);
    const resolution = await page.textContent('#timeline li[data-event="ResolutionDecided"]');
    assert.ok(resolution.includes('retry_as_new') && resolution.includes('second charge acknowledged'), resolution);
    // The case stays on record after it closed: who, the note, the evidence decided on.
    await page.waitForSelector('#detail-decided .resolved li');
    const resolved = await page.textContent('#detail-decided .resolved li');
    assert.ok(resolved.includes('Rui Costa') && resolved.includes('the provider shows no image'), resolved);
    assert.ok(await page.$('#detail-decided .resolved li .evidence li'), 'with the evidence it was made on');
    await page.screenshot({ path: SCREENSHOT, fullPage: true });
    say('screenshot: ' + SCREENSHOT);
    assert.equal(loads, 1, 'the page never reloaded');

    // Tenant B sees none of A's tasks, on the page or on its event stream.
    await page.click('#sign-out');
    assert.equal(await page.evaluate(() => sessionStorage.getItem('fenceline.dashboard.token')), null);
    await page.fill('#token', TOKEN_B);
    await page.click('#sign-in-form button[type=submit]');
    await page.waitForFunction((t) => document.getElementById('tenant').textContent.includes(t), TENANT_B);
    await page.waitForSelector('#live.on', { timeout: LONG });
    const streamB = listen(TOKEN_B, 3000);
    const streamA = listen(TOKEN_A, 3000);
    await new Promise((resolve) => setTimeout(resolve, 300));
    const another = await submit(TOKEN_A, 'ui-another', { kind: 'image.generate', input: { prompt: 'a blue shoe' } });
    const [seenB, seenA] = await Promise.all([streamB, streamA]);
    assert.ok(seenA.includes(another), 'A\'s stream carries A\'s new task');
    for (const id of [unknown, refund, another]) {
      assert.ok(!seenB.includes(id), 'B\'s stream carries none of A\'s tasks');
    }
    await page.waitForTimeout(800);
    assert.equal(await page.$$eval('#task-rows tr', (rows) => rows.length), 0, 'B\'s table is empty');
    const body = await page.textContent('body');
    for (const id of [unknown, refund, another]) assert.ok(!body.includes(id.slice(-12)), 'B\'s page names no task of A');
    const counts = await page.$$eval('#states .n', (ns) => ns.map((n) => n.textContent));
    assert.ok(counts.every((n) => n === '0'), 'B counts no task: ' + counts.join(','));
    say('tenant ' + TENANT_B + ' sees none of ' + TENANT_A + '\'s tasks');

    assert.deepEqual(problems, [], 'no console errors or CSP violations');
    say('dashboard checks passed');
  } finally {
    await context.close();
    fs.rmSync(profile, { recursive: true, force: true });
  }
}

main().catch((error) => {
  console.error(error && error.stack ? error.stack : error);
  process.exit(1);
});

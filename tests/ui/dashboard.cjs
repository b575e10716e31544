// The dashboard as a person working an incident uses it, in Debian's chromium driven
// by playwright-core (installed by `deploy/local/stack test`), against a whole running
// system started by tests/tests/dashboard.rs. It signs in, watches tasks move without
// reloading, opens a task with the keyboard and by its URL, goes back and forward,
// decides outcome_unknown cases one by one and in bulk, approves, rejects and
// cancels refunds one by one and in bulk, pages a queue, reads a timeline, audits
// every view with axe-core at desktop width and at 420 px (keeping a screenshot of
// each), and checks that another tenant's token sees none of it.
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
const ARTIFACTS = need('FENCELINE_UI_ARTIFACTS');
const AXE_SOURCE = fs.readFileSync(need('FENCELINE_UI_AXE'), 'utf8');
const DESKTOP = { width: 1360, height: 1000 };
const NARROW = { width: 420, height: 900 };
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

/** Waits until the task's row in the table says `state`: the page follows it live. */
async function waitRow(page, id, state) {
  await page.waitForSelector(`${row(id)}[data-state="${state}"]`, { timeout: LONG });
}

/** Waits until the API says the task is in `state` (whichever view the page shows). */
async function waitState(id, state) {
  const deadline = Date.now() + LONG;
  for (;;) {
    const response = await fetch(`${BASE}/v1/tasks/${id}`, { headers: { Authorization: 'Bearer ' + TOKEN_A } });
    const task = await response.json();
    if (task.state === state) return;
    if (Date.now() > deadline) throw new Error(`task ${id} is ${task.state}, not ${state}`);
    await new Promise((resolve) => setTimeout(resolve, 200));
  }
}

/** Waits until the page's text at `selector` includes `text`. */
async function waitText(page, selector, text) {
  await page.waitForFunction(([sel, t]) => document.querySelector(sel)?.textContent.includes(t), [selector, text], { timeout: LONG });
}

/** Whether the element is on screen without scrolling, and not cut off on either side. */
const inSight = (page, selector) => page.$eval(selector, (node) => {
  const box = node.getBoundingClientRect();
  return box.width > 0 && box.top >= 0 && box.top < window.innerHeight && box.left >= 0 && box.right <= window.innerWidth;
});

/** The focused element shows that it is: an outline of at least 2 px. */
async function assertFocusShown(page, what) {
  const outline = await page.evaluate(() => {
    const style = getComputedStyle(document.activeElement);
    return { style: style.outlineStyle, width: parseFloat(style.outlineWidth) };
  });
  assert.ok(outline.style !== 'none' && outline.width >= 2, what + ' shows its focus: ' + JSON.stringify(outline));
}

/**
 * Audits the view on screen at desktop width and at 420 px: axe-core finds no
 * serious or critical violation, at 420 px nothing is wider than the window and the
 * view's primary actions are on it, and a screenshot of each is kept.
 *
 * axe-core runs in the page itself: its source goes in through page.evaluate, which
 * Chromium's DevTools protocol runs outside the page's Content-Security-Policy
 * (addScriptTag would add an inline script, which the policy rightly refuses). So
 * the page is audited exactly as served, with its policy on, and no context needs
 * bypassCSP.
 */
async function audit(page, view, primary) {
  for (const [width, size] of [['desktop', DESKTOP], ['420px', NARROW]]) {
    await page.setViewportSize(size);
    await page.evaluate(() => new Promise((resolve) => requestAnimationFrame(() => requestAnimationFrame(resolve))));
    if (size === NARROW) {
      const scrollWidth = await page.evaluate(() => document.documentElement.scrollWidth);
      assert.ok(scrollWidth <= NARROW.width, `${view} at 420 px is not wider than the window: ${scrollWidth} px`);
      for (const selector of primary) {
        const target = page.locator(selector).first();
        await target.scrollIntoViewIfNeeded();
        assert.ok(await target.isVisible(), `${view} at 420 px shows ${selector}`);
        const box = await target.boundingBox();
        assert.ok(box && box.x >= 0 && box.x + box.width <= NARROW.width, `${view} at 420 px has ${selector} within the width: ${JSON.stringify(box)}`);
      }
      await page.evaluate(() => window.scrollTo(0, 0));
    }
    if (!(await page.evaluate(() => typeof window.axe === 'object'))) await page.evaluate(AXE_SOURCE);
    const violations = await page.evaluate(async () => {
      const result = await window.axe.run(document, { resultTypes: ['violations'] });
      return result.violations.map((v) => ({ id: v.id, impact: v.impact, help: v.help, nodes: v.nodes.map((n) => n.target.join(' ')) }));
    });
    const grave = violations.filter((v) => v.impact === 'serious' || v.impact === 'critical');
    for (const v of violations) say(`axe ${view} ${width}: ${v.impact} ${v.id} (${v.help}) at ${v.nodes.slice(0, 5).join(', ')}`);
    assert.deepEqual(grave, [], `${view} at ${width} has no serious or critical accessibility violation`);
    const file = path.join(ARTIFACTS, `${view}-${width}.png`);
    await page.screenshot({ path: file, fullPage: true });
    say(`audited ${view} at ${width}: ${violations.length} violations, none serious or critical; screenshot ${file}`);
  }
  await page.setViewportSize(DESKTOP);
}

/** Opens one of the views from its link in the navigation. */
async function openView(page, name) {
  await page.click(`#views a[data-view="${name}"]`);
  await page.waitForFunction((n) => location.hash === '#/' + n, name);
}

/** Answers the page's bulk action for each task: ok, or the problem's title. */
const bulkOutcome = (page, queue, id) =>
  page.waitForSelector(`#${queue}-results li[data-task-id="${id}"][data-outcome]`, { timeout: LONG })
    .then((line) => line.evaluate((li) => ({ outcome: li.dataset.outcome, text: li.textContent })));

async function main() {
  const profile = fs.mkdtempSync(path.join(os.tmpdir(), 'fenceline-ui-profile-'));
  const context = await chromium.launchPersistentContext(profile, {
    executablePath: CHROMIUM,
    headless: true,
    args: ['--headless', '--no-sandbox', '--disable-gpu', '--disable-quic', '--no-first-run',
      '--disable-background-networking', '--disable-component-update', '--disable-sync'],
    viewport: DESKTOP,
  });
  try {
    const page = context.pages()[0] || await context.newPage();
    const problems = [];
    page.on('console', (message) => {
      // The expected errors: the 401 of the wrong token tried first, and the 409 of
      // the approval another person decided first (the bulk action reports it).
      const expected = /status of (401|409)/.test(message.text());
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
    await audit(page, 'sign-in', ['#sign-in-form button[type=submit]']);

    // Sign in as tenant A, with the keyboard; the stream goes live.
    await page.focus('#token');
    await page.keyboard.type(TOKEN_A);
    await page.keyboard.press('Enter');
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

    // Paid calls whose answers are lost after the work, at a provider that can
    // neither dedupe nor be asked: genuine outcome_unknown cases. One label is markup.
    const markup = '<img src=x onerror="window.pwned=1">';
    const unknown = await submit(TOKEN_A, 'ui-unknown', {
      kind: 'image.generate', input: { prompt: 'a red shoe' }, labels: { probe: markup, team: 'catalogue' },
    });
    const lostGreen = await submit(TOKEN_A, 'ui-lost-green', { kind: 'image.generate', input: { prompt: 'a green shoe' } });
    const lostYellow = await submit(TOKEN_A, 'ui-lost-yellow', { kind: 'image.generate', input: { prompt: 'a yellow shoe' } });
    say('submitted ' + [unknown, lostGreen, lostYellow].join(', '));
    await page.waitForSelector(row(unknown), { timeout: LONG });
    for (const id of [unknown, lostGreen, lostYellow]) await waitRow(page, id, 'outcome_unknown');
    const moves = await page.evaluate((id) => window.seenStates[id], unknown);
    say('the page showed it ' + moves.join(' → '));
    assert.ok(moves.length >= 2, 'the row moved through states live: ' + moves.join(', '));

    // Escaping: the label shows as text and nothing ran.
    assert.ok((await page.textContent(row(unknown))).includes(markup), 'the markup is shown as text');
    assert.equal(await page.evaluate(() => window.pwned), undefined, 'no injected script ran');
    assert.equal(await page.$('img[src="x"]'), null, 'no injected element');

    // Instants: UTC with milliseconds, and how long ago.
    const updated = await page.textContent(row(unknown) + ' time.stamp');
    assert.match(updated, /^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3} UTC \((\d+ s|\d+ min) ago\)$/, updated);
    await audit(page, 'tasks', [row(unknown) + ' a.task-link', '#filters button[type=submit]']);

    // The keyboard: the task's id is a link; Enter opens the task's own view, at its
    // own URL, with its heading focused and in sight.
    await page.focus(row(unknown) + ' a.task-link');
    await page.keyboard.press('Enter');
    await page.waitForSelector(`#detail[data-task-id="${unknown}"][data-state="outcome_unknown"]`);
    assert.equal(await page.evaluate(() => location.hash), '#/tasks/' + unknown);
    assert.equal(await page.evaluate(() => document.activeElement.id), 'detail-title');
    assert.ok(await inSight(page, '#detail-title'), 'the task\'s view is in sight when opened');
    assert.ok(await page.isHidden('#tasks'), 'the task list makes way for the task');
    // Its case can be decided from here too.
    await page.waitForSelector(`#detail-actions article[data-task-id="${unknown}"] button.accept-failed`);
    assert.match(await page.textContent('#detail-facts dd[data-fact="accepted"]'), /\d\d:\d\d:\d\d\.\d{3} UTC \(.* ago\)/);
    await audit(page, 'task', ['#detail-actions button.accept-failed', '#detail-back']);
    // Back to the list, with the focus on the task's link again (and shown); forward
    // to the task again; back again.
    await page.goBack();
    await page.waitForFunction(() => location.hash === '#/tasks' || location.hash === '');
    await page.waitForSelector('#tasks:not([hidden])');
    assert.equal(await page.evaluate(() => document.activeElement.closest('tr')?.dataset.taskId), unknown);
    await assertFocusShown(page, 'the task\'s link in the list');
    await page.goForward();
    await page.waitForFunction((id) => location.hash === '#/tasks/' + id, unknown);
    await page.waitForSelector('#detail:not([hidden])');
    assert.ok(await inSight(page, '#detail-title'));
    await page.goBack();
    await page.waitForSelector('#tasks:not([hidden])');
    say('the task opened with the keyboard at its URL; back and forward work');

    // The queue of cases: true counts, each case with its evidence.
    await openView(page, 'cases');
    const card = `#cases article[data-task-id="${unknown}"]`;
    await page.waitForSelector(card, { timeout: LONG });
    await waitText(page, '#nav-cases-count', '(3)');
    await waitText(page, '#cases-shown', 'Showing 3 of 3.');
    const evidence = await page.$$eval(card + ' .evidence li', (items) => items.map((li) => li.textContent));
    say('evidence: ' + evidence.join(' | '));
    assert.ok(evidence.length >= 1, 'the case shows its evidence');
    await audit(page, 'cases', ['#cases-bulk button.bulk-accept-failed', card + ' button.accept-failed']);
    // Retry only after the explicit acknowledgement that it may be charged again.
    assert.ok(await page.isDisabled(card + ' button.retry'), 'retry is disabled before the acknowledgement');
    await page.check(card + ' input.acknowledge');
    assert.ok(await page.isEnabled(card + ' button.retry'), 'and enabled after it');
    await page.click(card + ' button.retry');
    await waitText(page, card + ' .outcome', 'Name the person');
    await page.fill(card + ' input.decided-by', 'Rui Costa');
    await page.fill(card + ' textarea.note', 'the provider shows no image for this key');
    await page.click(card + ' button.retry');
    await waitText(page, card + ' .outcome', 'Recorded');
    await waitState(unknown, 'succeeded');
    say('retried as new after the acknowledgement: succeeded');
    await page.waitForSelector(card, { state: 'detached', timeout: LONG });

    // The other two accepted as failed in one bulk action, named, each reported.
    // Selected with the keyboard: Space ticks the focused box, which shows its focus.
    const greenBox = `#cases article[data-task-id="${lostGreen}"] input.pick`;
    await page.focus(greenBox);
    await page.keyboard.press('Space');
    assert.ok(await page.isChecked(greenBox), 'Space selects the case');
    await assertFocusShown(page, 'the case\'s select box');
    await page.check(`#cases article[data-task-id="${lostYellow}"] input.pick`);
    await waitText(page, '#cases-picked', '2 selected');
    await page.fill('#cases-bulk-name', '');
    await page.click('#cases-bulk button.bulk-accept-failed');
    await waitText(page, '#cases-bulk-status', 'Name the person');
    await page.fill('#cases-bulk-name', 'Rui Costa');
    await page.fill('#cases-bulk-note', 'the shoes were withdrawn');
    await page.click('#cases-bulk button.bulk-accept-failed');
    for (const id of [lostGreen, lostYellow]) {
      const line = await bulkOutcome(page, 'cases', id);
      assert.equal(line.outcome, 'ok', line.text);
      await waitState(id, 'failed');
    }
    await waitText(page, '#cases-bulk-status', '2 of 2 done');
    say('two cases accepted as failed in bulk');

    // Refunds that wait for an approval: one with markup in its input.
    const refund = await submit(TOKEN_A, 'ui-refund', {
      kind: 'ticket.triage', input: { ticket: 'T-81', amount_cents: 2500, note: markup }, labels: { team: 'support' },
    });
    const more = [];
    for (let i = 2; i <= 8; i += 1) {
      more.push(await submit(TOKEN_A, 'ui-refund-' + i, { kind: 'ticket.triage', input: { ticket: 'T-9' + i, amount_cents: 100 * i } }));
    }
    const [approvedInBulk, decidedElsewhere, rejectedAlone, rejectedA, rejectedB, cancelledA, cancelledB] = more;
    await openView(page, 'approvals');
    await waitText(page, '#nav-approvals-count', '(8)');
    // Paging: five a page, the true count above, More for the rest.
    await page.selectOption('#per-page', '5');
    await waitText(page, '#approvals-shown', 'Showing 5 of 8.');
    await page.click('#approvals-more');
    await waitText(page, '#approvals-shown', 'Showing 8 of 8.');
    assert.ok(await page.isHidden('#approvals-more'), 'no More after the last page');
    say('the approvals queue paged: 5 of 8, then 8 of 8');
    const approval = `#approval-list article[data-task-id="${refund}"]`;
    await page.waitForSelector(approval + ' button.approve:not([disabled])', { timeout: LONG });
    for (const id of more) await page.waitForSelector(`#approval-list article[data-task-id="${id}"] button.approve:not([disabled])`, { timeout: LONG });
    await audit(page, 'approvals', ['#approvals-bulk button.bulk-approve', '#approvals-bulk button.bulk-reject', approval + ' button.reject']);
    // The card says what the approval lets run and what it rests on, and the input.
    const shown = await page.textContent(approval);
    assert.ok(shown.includes('refund') && shown.includes('It rests on') && shown.includes('T-81'), shown);
    await page.click(approval + ' details summary');
    assert.ok((await page.textContent(approval)).includes('<img src=x onerror='), 'the input\'s markup is shown as text');
    assert.equal(await page.evaluate(() => window.pwned), undefined, 'no injected script ran');
    assert.equal(await page.$('img[src="x"]'), null, 'no injected element');
    await page.locator(approval).screenshot({ path: path.join(ARTIFACTS, 'approval-card.png') });
    // The name last used is offered again; without one, nothing is sent.
    assert.equal(await page.inputValue(approval + ' input.decided-by'), 'Rui Costa');
    await page.fill(approval + ' input.decided-by', '');
    await page.click(approval + ' button.approve');
    await waitText(page, approval + ' .outcome', 'Name the person');
    await page.fill(approval + ' input.decided-by', 'Ana Lima');
    await page.fill(approval + ' textarea.note', 'checked the ticket');
    await page.click(approval + ' button.approve');
    await waitText(page, approval + ' .outcome', 'Approved');
    await waitState(refund, 'succeeded');
    say('refund approved: succeeded');

    // Approve two in bulk; another person rejects one of them just before the page's
    // call reaches intake, so intake refuses that one and the page says so.
    const pick = (id) => page.check(`#approval-list article[data-task-id="${id}"] input.pick`);
    await page.route(`**/v1/tasks/${decidedElsewhere}/approve`, async (route) => {
      const first = await fetch(`${BASE}/v1/tasks/${decidedElsewhere}/reject`, {
        method: 'POST',
        headers: { Authorization: 'Bearer ' + TOKEN_A, 'Content-Type': 'application/json' },
        body: JSON.stringify({ decided_by: 'Eva Souto', note: 'the customer withdrew it' }),
      });
      assert.equal(first.status, 202, 'the other person\'s rejection is recorded');
      await route.continue();
    });
    await pick(approvedInBulk);
    await pick(decidedElsewhere);
    await page.fill('#approvals-bulk-name', 'Ana Lima');
    await page.click('#approvals-bulk button.bulk-approve');
    const approvedLine = await bulkOutcome(page, 'approvals', approvedInBulk);
    const refusedLine = await bulkOutcome(page, 'approvals', decidedElsewhere);
    assert.equal(approvedLine.outcome, 'ok', approvedLine.text);
    assert.equal(refusedLine.outcome, 'refused', refusedLine.text);
    assert.ok(refusedLine.text.includes('The wait was already decided'), 'the problem\'s title: ' + refusedLine.text);
    await waitText(page, '#approvals-bulk-status', '1 of 2 done, 1 refused');
    await page.unroute(`**/v1/tasks/${decidedElsewhere}/approve`);
    say('bulk approval: ' + approvedLine.text + ' | ' + refusedLine.text);

    // Reject two in bulk, cancel two in bulk.
    await pick(rejectedA);
    await pick(rejectedB);
    await page.click('#approvals-bulk button.bulk-reject');
    for (const id of [rejectedA, rejectedB]) assert.equal((await bulkOutcome(page, 'approvals', id)).outcome, 'ok');
    await pick(cancelledA);
    await pick(cancelledB);
    await page.click('#approvals-bulk button.bulk-cancel');
    for (const id of [cancelledA, cancelledB]) assert.equal((await bulkOutcome(page, 'approvals', id)).outcome, 'ok');
    for (const id of [approvedInBulk]) await waitState(id, 'succeeded');
    for (const id of [decidedElsewhere, rejectedA, rejectedB]) await waitState(id, 'failed');
    for (const id of [cancelledA, cancelledB]) await waitState(id, 'cancelled');
    say('bulk: approved one, refused one decided elsewhere, rejected two, cancelled two');

    // A URL pasted into a new tab opens the task's view once signed in there (a tab
    // keeps its own token); reloading keeps it; its Reject button rejects it.
    const pasted = await context.newPage();
    pasted.on('pageerror', (error) => problems.push('page error (pasted): ' + error.message));
    await pasted.goto(BASE + '/ui#/tasks/' + rejectedAlone);
    await pasted.fill('#token', TOKEN_A);
    await pasted.press('#token', 'Enter');
    await pasted.waitForSelector(`#detail[data-task-id="${rejectedAlone}"][data-state="awaiting_approval"]`, { timeout: LONG });
    await pasted.reload();
    await pasted.waitForSelector(`#detail[data-task-id="${rejectedAlone}"][data-state="awaiting_approval"]`, { timeout: LONG });
    assert.ok(await inSight(pasted, '#detail-title'), 'the pasted task\'s view is in sight');
    const alone = `#detail-actions article[data-task-id="${rejectedAlone}"]`;
    await pasted.waitForSelector(alone + ' button.reject:not([disabled])', { timeout: LONG });
    assert.equal(await pasted.inputValue(alone + ' input.decided-by'), 'Ana Lima');
    await pasted.fill(alone + ' textarea.note', 'a duplicate of T-92');
    await pasted.click(alone + ' button.reject');
    await waitText(pasted, alone + ' .outcome', 'Rejected by Ana Lima');
    await pasted.waitForSelector(`#detail[data-task-id="${rejectedAlone}"][data-state="failed"]`, { timeout: LONG });
    await pasted.waitForSelector('#detail-decided .decisions li[data-decision="reject"]', { timeout: LONG });
    await pasted.close();
    say('opened by its URL in a new tab and rejected with its Reject button');

    // Filters: by kind, and by label.
    await openView(page, 'tasks');
    await page.selectOption('#per-page', '50');
    await page.waitForSelector(row(unknown));
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
    // Paging the list with its cursor: five a page, More for the next five.
    await page.selectOption('#per-page', '5');
    await page.waitForFunction(() => document.querySelectorAll('#task-rows tr').length === 5);
    await waitText(page, '#tasks-shown', 'Showing 5 of ');
    const total = Number(/of (\d+)/.exec(await page.textContent('#tasks-shown'))[1]);
    assert.ok(total > 10, 'more than two pages of tasks: ' + total);
    await page.click('#more');
    await page.waitForFunction(() => document.querySelectorAll('#task-rows tr').length === 10);
    for (let rows = 10; await page.isVisible('#more'); rows = Math.min(total, rows + 5)) {
      await page.click('#more');
      await page.waitForFunction((n) => document.querySelectorAll('#task-rows tr').length >= n, Math.min(total, rows + 5));
    }
    await page.waitForFunction((n) => document.querySelectorAll('#task-rows tr').length === n, total);
    await waitText(page, '#tasks-shown', `Showing ${total} of ${total}.`);
    say(`the task list paged: 5, 10, … ${total} of ${total}`);

    // One task's timeline: attempts, phases, checkpoints, the signal, the trace.
    await page.click(row(refund) + ' a.task-link');
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
    await page.goBack();
    await page.waitForSelector('#tasks:not([hidden])');
    await page.click(row(unknown) + ' a.task-link');
    await page.waitForSelector(`#detail[data-task-id="${unknown}"] #timeline li[data-event="ResolutionDecided"]`);
    const resolution = await page.textContent('#timeline li[data-event="ResolutionDecided"]');
    assert.ok(resolution.includes('retry_as_new') && resolution.includes('second charge acknowledged'), resolution);
    // The case stays on record after it closed: who, the note, the evidence decided on.
    await page.waitForSelector('#detail-decided .resolved li');
    const resolved = await page.textContent('#detail-decided .resolved li');
    assert.ok(resolved.includes('Rui Costa') && resolved.includes('the provider shows no image'), resolved);
    assert.ok(await page.$('#detail-decided .resolved li .evidence li'), 'with the evidence it was made on');
    await page.screenshot({ path: path.join(ARTIFACTS, 'task-decided.png'), fullPage: true });
    assert.equal(loads, 1, 'the page never reloaded');

    // Tenant B sees none of A's tasks, on the page or on its event stream.
    // Signed out while the page's reads are in flight: their answers, and the reads they
    // would start, belong to the session that ended; they are dropped without an error.
    await openView(page, 'tasks');
    await page.evaluate(() => {
      document.getElementById('filters').requestSubmit();
      document.getElementById('sign-out').click();
    });
    await page.waitForTimeout(600);
    assert.deepEqual(problems, [], 'answers arriving after sign-out raise nothing');
    assert.equal(await page.$$eval('#task-rows tr', (rows) => rows.length), 0, 'and show nothing once signed out');
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
    const everyTask = [unknown, lostGreen, lostYellow, refund, ...more, another];
    for (const id of everyTask) {
      assert.ok(!seenB.includes(id), 'B\'s stream carries none of A\'s tasks');
    }
    await page.waitForTimeout(800);
    assert.equal(await page.$$eval('#task-rows tr', (rows) => rows.length), 0, 'B\'s table is empty');
    const body = await page.textContent('body');
    for (const id of everyTask) assert.ok(!body.includes(id.slice(-12)), 'B\'s page names no task of A');
    const counts = await page.$$eval('#states .n', (ns) => ns.map((n) => n.textContent));
    assert.ok(counts.every((n) => n === '0'), 'B counts no task: ' + counts.join(','));
    assert.equal(await page.textContent('#nav-approvals-count'), '(0)', 'B has no approval waiting');
    say('tenant ' + TENANT_B + ' sees none of ' + TENANT_A + '\'s tasks');

    assert.deepEqual(problems, [], 'no console errors or CSP violations');
    say('dashboard checks passed');
  } catch (error) {
    // What the page showed when a check failed, kept beside the other screenshots.
    const page = context.pages()[0];
    if (page) {
      const where = await page.evaluate(() => location.hash + ' · shown: ' +
        [...document.querySelectorAll('#board .view')].filter((v) => !v.hidden).map((v) => v.id).join(', ')).catch(() => '?');
      console.error('the page at ' + where);
      await page.screenshot({ path: path.join(ARTIFACTS, 'failure.png'), fullPage: true }).catch(() => {});
    }
    throw error;
  } finally {
    await context.close();
    fs.rmSync(profile, { recursive: true, force: true });
  }
}

main().catch((error) => {
  console.error(error && error.stack ? error.stack : error);
  process.exit(1);
});

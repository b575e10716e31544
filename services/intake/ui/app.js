// Fenceline dashboard (docs/dashboard.md): plain JavaScript, no build step. Every
// value from the API reaches the page as text (textContent, text nodes, attribute
// values set one by one); nothing is ever parsed as HTML.
'use strict';

(() => {
  const TOKEN_KEY = 'fenceline.dashboard.token';
  const NAME_KEY = 'fenceline.dashboard.name';
  const PER_PAGE_KEY = 'fenceline.dashboard.per-page';
  const STATES = ['queued', 'waiting', 'running', 'awaiting_approval', 'outcome_unknown', 'needs_human',
    'succeeded', 'failed', 'cancelled'];
  const FINAL = ['succeeded', 'failed', 'cancelled'];
  const MOST_PER_CALL = 200;

  const $ = (id) => document.getElementById(id);

  /** An element with properties and children; strings become text nodes. */
  function el(tag, props, ...children) {
    const node = document.createElement(tag);
    for (const [key, value] of Object.entries(props || {})) {
      if (value === undefined || value === null || value === false) continue;
      if (key === 'class') node.className = value;
      else if (key === 'text') node.textContent = value;
      else if (key.startsWith('on')) node.addEventListener(key.slice(2), value);
      else if (key === 'disabled' || key === 'hidden' || key === 'checked' || key === 'required') node[key] = true;
      else node.setAttribute(key, String(value));
    }
    for (const child of children.flat()) {
      if (child === undefined || child === null) continue;
      node.append(child instanceof Node ? child : document.createTextNode(String(child)));
    }
    return node;
  }

  // --- instants: absolute in UTC with milliseconds, and how long ago --------------------

  const utc = (date) => date.toISOString().replace('T', ' ').replace('Z', ' UTC');

  function ago(date) {
    const seconds = Math.round((Date.now() - date.getTime()) / 1000);
    const size = Math.abs(seconds);
    const span = size < 60 ? size + ' s'
      : size < 3600 ? Math.floor(size / 60) + ' min'
        : size < 86400 ? Math.floor(size / 3600) + ' h ' + Math.floor((size % 3600) / 60) + ' min'
          : Math.floor(size / 86400) + ' d ' + Math.floor((size % 86400) / 3600) + ' h';
    return seconds < 0 ? 'in ' + span : span + ' ago';
  }

  /** An instant as a <time>: "2025-05-01 12:00:03.042 UTC (12 s ago)"; the second
   *  part is brought up to date every few seconds. */
  function when(iso) {
    if (!iso) return null;
    const date = new Date(iso);
    if (Number.isNaN(date.getTime())) return document.createTextNode(String(iso));
    return el('time', { class: 'stamp', datetime: date.toISOString() },
      el('span', { class: 'utc', text: utc(date) }), ' ', el('span', { class: 'ago', text: '(' + ago(date) + ')' }));
  }

  function refreshAgo() {
    for (const stamp of document.querySelectorAll('time.stamp')) {
      stamp.querySelector('.ago').textContent = '(' + ago(new Date(stamp.dateTime)) + ')';
    }
  }

  const short = (id) => String(id || '').slice(-12);
  const stateBadge = (state) => el('span', { class: 'state state-' + String(state).replace(/[^a-z_]/g, ''), text: state });
  const taskHref = (taskId) => '#/tasks/' + encodeURIComponent(taskId);
  /** A link to a task's own view; the only links the page makes from data are these fragments. */
  const taskLink = (taskId) => el('a', { class: 'task-link mono', href: taskHref(taskId), title: taskId, text: short(taskId) });

  // --- session ----------------------------------------------------------------------

  let token = null;
  let tenant = null;
  let stream = null;          // AbortController of the event stream
  let lastEventId = null;
  let view = null;            // 'tasks', 'cases', 'approvals' or 'task'
  let selected = null;        // the task whose view is open
  let lastOpened = null;      // the task to give focus back to in the list
  let nextCursor = null;
  let shown = 0;              // rows loaded in the task table
  let wanted = 0;             // rows the table should hold: a page, and one more for each More
  let filteredSummary = null;
  let tasksRead = 0;          // the latest read of the table: an answer to an earlier one is dropped

  class ApiError extends Error {}

  /** One call to the API for the signed-in session. An answer that arrives after that
   *  session ended (signed out, or another tenant signed in) is dropped: it rejects
   *  with ApiError, like a refused token, and shows nothing. */
  async function api(method, path, body) {
    const session = token;
    if (!session) throw new ApiError('signed out');
    const headers = { Authorization: 'Bearer ' + session, Accept: 'application/json' };
    const init = { method, headers, cache: 'no-store', credentials: 'omit' };
    if (body !== undefined) {
      headers['Content-Type'] = 'application/json';
      init.body = JSON.stringify(body);
    }
    const response = await fetch(path, init);
    let data = null;
    try { data = await response.json(); } catch (_) { data = null; }
    if (token !== session) throw new ApiError('signed out');
    if (response.status === 401) {
      signOut('The token was refused: it is unknown or revoked.');
      throw new ApiError('unauthorized');
    }
    return { status: response.status, data };
  }

  /** Shows a read's failure: a dropped or refused answer was already handled by api(). */
  function readFailed(e) {
    if (!(e instanceof ApiError) && token) $('tasks-error').textContent = 'Reading the API failed: ' + e.message;
  }

  /** Runs a read started by the page itself (a click): its failure is shown, not thrown. */
  const quietly = (read) => { read.catch(readFailed); };

  const problemText = (status, data) =>
    (data && (data.detail || data.title)) ? String(data.detail || data.title) : 'answered ' + status;
  const problemTitle = (status, data) => (data && data.title ? String(data.title) : 'answered ' + status);

  const perPage = () => Number($('per-page').value) || 20;

  async function signIn(candidate) {
    token = candidate;
    const { status, data } = await api('GET', '/v1/summary');
    if (status !== 200) throw new ApiError(problemText(status, data));
    tenant = data.tenant;
    sessionStorage.setItem(TOKEN_KEY, token);
    $('tenant').textContent = 'tenant ' + tenant;
    $('sign-in').hidden = true;
    $('board').hidden = false;
    $('views').hidden = false;
    $('sign-out').hidden = false;
    renderCounts(data);
    route();
    openStream();
  }

  function signOut(message) {
    if (stream) stream.abort();
    stream = null;
    token = null;
    tenant = null;
    lastEventId = null;
    selected = null;
    view = null;
    sessionStorage.removeItem(TOKEN_KEY);
    $('tenant').textContent = '';
    setLive(false);
    $('board').hidden = true;
    $('views').hidden = true;
    $('sign-out').hidden = true;
    $('sign-in').hidden = false;
    for (const id of ['task-rows', 'cases', 'approval-list', 'states', 'timeline', 'detail-facts', 'detail-attempts',
      'detail-case', 'detail-decided', 'detail-actions', 'cases-results', 'approvals-results']) {
      if ($(id)) $(id).replaceChildren();
    }
    for (const id of ['detail-id', 'decisions-count', 'approvals-count', 'tasks-error', 'detail-error', 'nav-tasks-count',
      'nav-cases-count', 'nav-approvals-count', 'cases-shown', 'approvals-shown', 'tasks-shown']) $(id).textContent = '';
    knownCards.clear();
    delete $('detail').dataset.taskId;
    $('sign-in-error').textContent = message || '';
    $('token').focus();
  }

  // --- views: one URL each (#/tasks, #/tasks/<id>, #/cases, #/approvals) ----------------

  /** Shows the view the address names; back, forward and a pasted address come here. */
  function route() {
    if (!token) return;
    const hash = location.hash || '#/tasks';
    const one = /^#\/tasks\/([^/?#]+)$/.exec(hash);
    const previous = view;
    if (one) {
      show('task');
      openTask(decodeURIComponent(one[1]));
    } else {
      const name = hash === '#/cases' ? 'cases' : hash === '#/approvals' ? 'approvals' : 'tasks';
      selected = null;
      show(name);
      const bulkName = $(name + '-bulk-name');
      if (bulkName && !bulkName.value) bulkName.value = rememberedName();
      // As many rows as it had: back from a task finds the list as it was left.
      (name === 'tasks' ? loadTasks(false) : loadQueue(queues[name], false)).catch(() => {});
      loadSummary().catch(() => {});
      if (previous === 'task' && name === 'tasks' && lastOpened && focusRow(lastOpened, true)) return;
      if (previous) focusHeading(name);
    }
  }

  function show(name) {
    view = name;
    for (const section of document.querySelectorAll('#board .view')) section.hidden = section.dataset.view !== name;
    for (const link of document.querySelectorAll('#views a')) {
      if (link.dataset.view === name || (name === 'task' && link.dataset.view === 'tasks')) link.setAttribute('aria-current', 'page');
      else link.removeAttribute('aria-current');
    }
  }

  const HEADINGS = { tasks: 'tasks-title', cases: 'cases-title', approvals: 'approvals-title', task: 'detail-title' };
  function focusHeading(name) {
    const heading = $(HEADINGS[name]);
    window.scrollTo(0, 0);
    heading.focus({ preventScroll: true });
  }

  /** Gives the focus to the task's link in the list; `reveal` scrolls it into sight
   *  (back from the task), a row redrawn in place keeps the page where it was. */
  function focusRow(taskId, reveal) {
    const link = document.querySelector('tr[data-task-id="' + CSS.escape(taskId) + '"] a.task-link');
    if (!link) return false;
    link.focus({ preventScroll: true });
    if (reveal) link.scrollIntoView({ block: 'center' });
    return true;
  }

  function openTask(taskId) {
    selected = taskId;
    lastOpened = taskId;
    if ($('detail').dataset.taskId !== taskId) {
      $('detail').dataset.taskId = taskId;
      delete $('detail').dataset.state;
      $('detail-id').textContent = taskId;
      for (const id of ['detail-facts', 'detail-case', 'detail-decided', 'detail-actions', 'detail-attempts', 'timeline']) {
        $(id).replaceChildren();
      }
    }
    $('detail-error').textContent = '';
    focusHeading('task');
    loadDetail(taskId).catch(() => {});
  }

  // --- live updates: server-sent events read with fetch() (the token is a header) ------

  function setLive(on) {
    $('live').textContent = on ? 'live' : (token ? 'reconnecting…' : 'not connected');
    $('live').className = 'live ' + (on ? 'on' : 'off');
  }

  async function openStream() {
    const controller = new AbortController();
    stream = controller;
    const headers = { Authorization: 'Bearer ' + token, Accept: 'text/event-stream' };
    if (lastEventId) headers['Last-Event-ID'] = lastEventId;
    try {
      const response = await fetch('/v1/events', { headers, signal: controller.signal, cache: 'no-store', credentials: 'omit' });
      if (response.status === 401) { signOut('The token was refused: it is unknown or revoked.'); return; }
      if (!response.ok || !response.body) throw new Error('the event stream answered ' + response.status);
      setLive(true);
      const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
      let buffer = '';
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buffer += value.replace(/\r\n?/g, '\n');
        let end;
        while ((end = buffer.indexOf('\n\n')) >= 0) {
          const block = buffer.slice(0, end);
          buffer = buffer.slice(end + 2);
          onBlock(block);
        }
      }
    } catch (_) {
      // Aborted on sign-out, or the connection broke: reconnect below.
    }
    if (stream !== controller) return;
    setLive(false);
    setTimeout(() => { if (stream === controller && token) openStream(); }, 1500);
  }

  function onBlock(block) {
    let event = 'message';
    let data = '';
    for (const line of block.split('\n')) {
      if (line === '' || line.startsWith(':')) continue;
      const colon = line.indexOf(':');
      const field = colon < 0 ? line : line.slice(0, colon);
      let value = colon < 0 ? '' : line.slice(colon + 1);
      if (value.startsWith(' ')) value = value.slice(1);
      if (field === 'event') event = value;
      else if (field === 'data') data = data ? data + '\n' + value : value;
      else if (field === 'id') lastEventId = value;
    }
    if (event === 'task') {
      let task = null;
      try { task = JSON.parse(data); } catch (_) { return; }
      onTask(task);
    } else if (event === 'ready' || event === 'reset') {
      refreshAll();
    }
  }

  /** One task changed: update its row at once, then refresh counts and the view. */
  function onTask(task) {
    const row = document.querySelector('tr[data-task-id="' + CSS.escape(String(task.task_id)) + '"]');
    if (row && Number(row.dataset.version) <= Number(task.version)) {
      const focused = row.contains(document.activeElement);
      row.replaceWith(taskRow(task));
      if (focused) focusRow(String(task.task_id));
    }
    if (selected === task.task_id) scheduleDetail();
    scheduleRefresh();
  }

  let refreshTimer = null;
  let refreshing = false;
  let refreshAgain = false;
  function scheduleRefresh() {
    if (refreshTimer) return;
    refreshTimer = setTimeout(() => { refreshTimer = null; refreshAll(); }, 400);
  }

  /** The counts, and what the open view shows; the others load when opened. */
  async function refreshAll() {
    if (!token) return;
    if (refreshing) { refreshAgain = true; return; }
    refreshing = true;
    try {
      await Promise.all([loadSummary(),
        view === 'tasks' ? loadTasks(false) : null,
        view === 'cases' || view === 'approvals' ? loadQueue(queues[view], false) : null,
        view === 'task' && selected ? loadDetail(selected) : null]);
    } catch (e) {
      readFailed(e);
    } finally {
      refreshing = false;
    }
    if (refreshAgain) { refreshAgain = false; scheduleRefresh(); }
  }

  let detailTimer = null;
  function scheduleDetail() {
    if (detailTimer) return;
    detailTimer = setTimeout(() => { detailTimer = null; if (selected) loadDetail(selected).catch(() => {}); }, 300);
  }

  // --- filters, counts and the task table -------------------------------------------

  function filterQuery(withState) {
    const query = new URLSearchParams();
    const state = $('filter-state').value;
    const kind = $('filter-kind').value.trim();
    const label = $('filter-label').value.trim();
    const since = $('filter-since').value;
    const until = $('filter-until').value;
    if (withState && state) query.set('state', state);
    if (kind) query.set('kind', kind);
    if (label) query.set('label', label);
    if (since) query.set('since', new Date(since).toISOString());
    if (until) query.set('until', new Date(until).toISOString());
    return query;
  }

  /** The counts by state within the filters, and the true counts of the tenant's
   *  queues (without filters) for the views' links. */
  async function loadSummary() {
    const filters = filterQuery(false);
    const [filtered, whole] = await Promise.all([
      api('GET', '/v1/summary?' + filters),
      [...filters.keys()].length ? api('GET', '/v1/summary') : null,
    ]);
    if (filtered.status === 200) {
      filteredSummary = filtered.data;
      renderSummary(filtered.data);
      renderCounts(whole && whole.status === 200 ? whole.data : filtered.data);
    }
    await loadSpend();
  }

  const count = (summary, states) => states.reduce((sum, state) => sum + Number(summary.states[state] || 0), 0);

  function renderCounts(summary) {
    const total = count(summary, STATES);
    const cases = count(summary, queues.cases.states);
    const approvals = count(summary, queues.approvals.states);
    $('nav-tasks-count').textContent = '(' + total + ')';
    $('nav-cases-count').textContent = '(' + cases + ')';
    $('nav-approvals-count').textContent = '(' + approvals + ')';
    $('decisions-count').textContent = '(' + cases + ')';
    $('approvals-count').textContent = '(' + approvals + ')';
    queues.cases.total = cases;
    queues.approvals.total = approvals;
    for (const queue of Object.values(queues)) showQueueTally(queue);
    showTaskTally();
  }

  /** Today's spend and the tenant's budget, from GET /v1/spend (minor units). */
  async function loadSpend() {
    const since = new Date();
    since.setUTCHours(0, 0, 0, 0);
    const { status, data } = await api('GET', '/v1/spend?since=' + encodeURIComponent(since.toISOString()));
    if (status !== 200) return;
    const parts = ['Spent today (UTC): ' + data.cost_minor + ' in the currency\'s minor unit, ' + data.calls + ' paid calls'];
    if (data.unpriced_calls) parts.push(data.unpriced_calls + ' unpriced');
    if (data.budget) {
      parts.push('budget ' + data.budget.per_day_minor + ' a day' +
        (data.budget.spent ? ': spent, new paid calls wait' : ''));
    }
    $('spend').textContent = parts.join(' · ');
    $('spend').classList.toggle('error', Boolean(data.budget && data.budget.spent));
  }

  function renderSummary(summary) {
    const active = $('filter-state').value;
    const chips = STATES.map((state) => el('button', {
      type: 'button',
      class: 'chip state-' + state + (active === state ? ' active' : ''),
      'data-state': state,
      'aria-pressed': active === state ? 'true' : 'false',
      onclick: () => { $('filter-state').value = active === state ? '' : state; quietly(loadTasks(true)); quietly(loadSummary()); },
    }, state.replace(/_/g, ' '), el('span', { class: 'n', text: String(summary.states[state] || 0) })));
    $('states').replaceChildren(...chips);
  }

  function showTaskTally() {
    if (!filteredSummary) return;
    const state = $('filter-state').value;
    const total = state ? Number(filteredSummary.states[state] || 0) : count(filteredSummary, STATES);
    $('tasks-shown').textContent = 'Showing ' + shown + ' of ' + total + '.';
  }

  async function loadTasks(reset) {
    const query = filterQuery(true);
    if (reset) wanted = perPage();
    query.set('limit', String(Math.min(MOST_PER_CALL, Math.max(perPage(), wanted))));
    const read = ++tasksRead;
    const { status, data } = await api('GET', '/v1/tasks?' + query);
    if (read !== tasksRead) return;
    if (status !== 200) { $('tasks-error').textContent = problemText(status, data); return; }
    $('tasks-error').textContent = '';
    const focused = document.activeElement && document.activeElement.closest('#task-rows tr');
    const focusedId = focused ? focused.dataset.taskId : null;
    $('task-rows').replaceChildren(...data.tasks.map(taskRow));
    if (focusedId) focusRow(focusedId);
    shown = data.tasks.length;
    nextCursor = data.next_cursor || null;
    $('more').hidden = !nextCursor;
    $('tasks-empty').hidden = shown > 0;
    showTaskTally();
  }

  async function loadMore() {
    if (!nextCursor) return;
    const query = filterQuery(true);
    query.set('limit', String(perPage()));
    query.set('cursor', nextCursor);
    wanted = shown + perPage();
    const read = ++tasksRead;
    const { status, data } = await api('GET', '/v1/tasks?' + query);
    if (read !== tasksRead) return;
    if (status !== 200) { $('tasks-error').textContent = problemText(status, data); return; }
    $('task-rows').append(...data.tasks.map(taskRow));
    shown += data.tasks.length;
    nextCursor = data.next_cursor || null;
    $('more').hidden = !nextCursor;
    showTaskTally();
  }

  const labels = (map) => Object.entries(map || {}).map(([k, v]) => el('span', { class: 'label', text: k + ':' + v }));

  /** One row: its id is a link to the task's view (Tab, then Enter); a click anywhere
   *  on the row opens it too. */
  function taskRow(task) {
    return el('tr', {
      'data-task-id': task.task_id,
      'data-state': task.state,
      'data-version': task.version,
      onclick: (event) => { if (!event.target.closest('a, button, input')) location.hash = taskHref(task.task_id); },
    },
    el('td', { 'data-label': 'Task' }, taskLink(task.task_id)),
    el('td', { 'data-label': 'Kind', text: task.kind }),
    el('td', { 'data-label': 'State', class: 'state-cell' }, stateBadge(task.state)),
    el('td', { 'data-label': 'Why', text: task.reason || '' }),
    el('td', { 'data-label': 'Attempt', text: String(task.attempt) }),
    el('td', { 'data-label': 'Step · phase', text: [task.step, task.phase].filter(Boolean).join(' · ') }),
    el('td', { 'data-label': 'Labels' }, labels(task.labels)),
    el('td', { 'data-label': 'Updated' }, when(task.updated_at)));
  }

  // --- one task: what can be done, facts, attempts, timeline -------------------------

  async function loadDetail(taskId) {
    const { status, data } = await api('GET', '/v1/tasks/' + encodeURIComponent(taskId));
    if (selected !== taskId) return;
    if (status !== 200) {
      $('detail-error').textContent = status === 404 ? 'No task ' + taskId + ' for this tenant.' : problemText(status, data);
      return;
    }
    $('detail-error').textContent = '';
    renderDetail(data);
  }

  function renderDetail(task) {
    $('detail').dataset.taskId = task.task_id;
    $('detail').dataset.state = task.state;
    $('detail-id').textContent = task.task_id;
    place($('detail-actions'), taskActions(task));
    // A case's or an approval's card above already shows its evidence, input and outputs.
    const caseShown = Boolean(task.case) && queues.cases.states.includes(task.state);
    const approvalShown = task.state === 'awaiting_approval';
    const facts = [
      ['kind', task.kind], ['state', stateBadge(task.state)], ['why', task.reason],
      ['attempt', String(task.attempt)], ['step', task.step], ['phase', task.phase],
      ['labels', labels(task.labels)], ['accepted', when(task.accepted_at)], ['updated', when(task.updated_at)],
      ['version', String(task.version)], ['next attempt', when(task.next_attempt_at)],
      ['result', task.result ? task.result.uri + ' · ' + task.result.size_bytes + ' bytes · sha256 ' + task.result.sha256 : null],
      ['case', task.case_id], ['waiting for signal', task.awaiting_signal], ['trace id', task.trace_id],
    ].filter(([, v]) => v !== null && v !== undefined && v !== '' && !(Array.isArray(v) && v.length === 0));
    $('detail-facts').replaceChildren(...facts.flatMap(([k, v]) => [el('dt', { text: k }), el('dd', { 'data-fact': k }, v)]));
    $('detail-case').replaceChildren(...(task.case && !caseShown ? [el('strong', { text: 'Evidence of case ' + task.case.case_id }), evidenceList(task.case.evidence)] : []));
    $('detail-decided').replaceChildren(caseShown || approvalShown ? '' : decidedOn(task),
      ...(task.approval && !approvalShown ? [el('strong', { text: 'Waiting for approval' }), approvalFacts(task.approval)] : []),
      ...((task.decisions || []).length ? [el('strong', { text: 'Decisions' }), decisionList(task.decisions)] : []),
      ...((task.resolved_cases || []).length ? [el('strong', { text: 'Resolved cases' }), resolvedList(task.resolved_cases)] : []));
    $('detail-attempts').replaceChildren(...(task.attempts || []).map((a) => el('tr', {},
      el('td', { text: String(a.attempt) }), el('td', { text: a.outcome }), el('td', { text: a.error_class || '' }),
      el('td', { text: a.detail || '' }),
      el('td', { text: a.money_may_have_been_spent === null || a.money_may_have_been_spent === undefined ? '' : (a.money_may_have_been_spent ? 'yes' : 'no') }),
      el('td', { text: a.recovery || '' }), el('td', {}, when(a.started_at)), el('td', {}, when(a.ended_at)))));
    $('timeline').replaceChildren(...(task.timeline || []).map((line) => el('li', { 'data-event': line.event },
      el('span', { class: 'when' }, when(line.at)),
      el('span', { class: 'who', text: line.source }),
      el('span', { class: 'mono', text: line.event }),
      el('span', {},
        [line.attempt ? 'attempt ' + line.attempt : null, line.step, line.phase].filter(Boolean).join(' · '),
        line.detail ? el('div', { text: line.detail }) : null,
        line.trace_id ? el('span', { class: 'trace mono', text: 'trace ' + line.trace_id }) : null))));
  }

  /** What a person can do about the task from its own view: its approval or its
   *  case, and cancelling a task that has not finished. Kept across refreshes. */
  function taskActions(task) {
    const cards = [];
    const keep = (key, make) => {
      if (!knownCards.has(key)) knownCards.set(key, make());
      cards.push(knownCards.get(key));
    };
    if (task.state === 'awaiting_approval') keep('view:' + approvalKey(task), () => approvalCard(task, 'view:' + approvalKey(task), false));
    if (task.case && queues.cases.states.includes(task.state)) keep('view:' + caseKey(task), () => caseCard(task, 'view:' + caseKey(task), false));
    if (!FINAL.includes(task.state)) keep('view:cancel:' + task.task_id, () => cancelBox(task, 'view:cancel:' + task.task_id));
    return cards;
  }

  function cancelBox(task, key) {
    const outcome = el('div', { class: 'outcome', role: 'status' });
    const button = el('button', { type: 'button', class: 'danger cancel', onclick: async () => {
      button.disabled = true;
      outcome.textContent = 'Sending…';
      const result = await answered(cancelTask(task));
      outcome.textContent = result.text;
      if (!result.ok) button.disabled = false;
      scheduleRefresh();
    } }, 'Cancel task');
    return el('div', { class: 'action cancel-box', 'data-key': key },
      el('p', { text: 'Cancel: no further attempt starts; a running one is asked to stop. Recorded under this token.' }),
      button, outcome);
  }

  /** The most characters of one value shown before "Show all". */
  const SHOWN_CHARS = 4096;

  /** A JSON value as text, cut at SHOWN_CHARS with a button that shows it whole. */
  function jsonBlock(value) {
    const text = JSON.stringify(value, null, 2) ?? 'null';
    const pre = el('pre', { class: 'json', tabindex: '0' });
    if (text.length <= SHOWN_CHARS) { pre.textContent = text; return pre; }
    pre.textContent = text.slice(0, SHOWN_CHARS) + '…';
    const all = el('button', { type: 'button', class: 'show-all', onclick: () => { pre.textContent = text; all.remove(); } },
      'Show all (' + text.length + ' characters)');
    return el('div', {}, pre, all);
  }

  /** A link to a file result, only for http(s) addresses; anything else is text. */
  function artifactLink(uri) {
    let safe = false;
    try { safe = ['http:', 'https:'].includes(new URL(uri).protocol); } catch (e) { safe = false; }
    return safe ? el('a', { href: uri, target: '_blank', rel: 'noopener noreferrer', text: uri }) : el('code', { text: uri });
  }

  /** One step's output: the artifact's link for a file result, else the value. */
  function stepOutput(o) {
    return el('div', { class: 'step-output', 'data-step': o.step },
      el('div', { class: 'hint' }, el('strong', { text: o.step }), ' · generation ' + o.generation + ' · ', when(o.checkpointed_at),
        o.provider ? ' · ' + o.provider + (o.cost_minor !== undefined && o.cost_minor !== null ? ' · cost ' + o.cost_minor : ' · unpriced') : ''),
      o.artifact_uri ? el('div', {}, 'artifact ', artifactLink(o.artifact_uri), ' · sha256 ', el('code', { text: o.sha256 }))
        : o.output !== undefined && o.output !== null ? jsonBlock(o.output)
          : el('div', { class: 'hint', text: 'Not shown (too large to travel); at ' + o.output_ref }));
  }

  /** What a person decides on: the task's input and what its steps produced. */
  function decidedOn(task) {
    const parts = [];
    if (task.input !== undefined && task.input !== null) parts.push(el('strong', { text: 'Input' }), jsonBlock(task.input));
    if ((task.steps || []).length) parts.push(el('strong', { text: 'Step outputs' }), ...(task.steps || []).map(stepOutput));
    return el('div', { class: 'decided-on' }, parts);
  }

  /** What an approval lets happen next and the outputs it rests on. */
  function approvalFacts(card) {
    const next = (card.then || []).length
      ? card.then.map((n) => el('li', {}, 'runs ', el('strong', { text: n.step }), ' at ' + n.provider + ' (' + n.operation + ')',
        n.request ? el('div', { class: 'request' }, 'sends ', el('code', { text: n.request.method + ' ' + n.request.path }),
          n.request.body !== undefined && n.request.body !== null ? jsonBlock(n.request.body) : null) : null,
        n.request_error ? el('p', { class: 'error', text: 'Its request cannot be built from what is known now: ' + n.request_error }) : null))
      : [el('li', { text: 'lets the task go on; no paid step follows before the next approval' })];
    return el('div', { class: 'approval-facts' },
      el('p', {}, 'Approving step ', el('strong', { text: card.step }), ' (generation ' + card.generation + ', signal ' + card.signal + '):'),
      el('ul', { class: 'then' }, next),
      el('strong', { text: 'It rests on' }),
      (card.rests_on || []).length ? card.rests_on.map(stepOutput) : el('p', { class: 'hint', text: 'no earlier output' }),
      el('div', { class: 'hint' }, 'digest ', el('code', { class: 'digest', text: card.digest })));
  }

  /** Every decision made about the task's waits, with what it was made on. */
  function decisionList(decisions) {
    return el('ol', { class: 'decisions' }, (decisions || []).map((d) => el('li', { 'data-decision': d.decision },
      el('div', {}, el('strong', { text: d.decision === 'reject' ? 'Rejected' : 'Approved' }),
        ' step ' + d.step + ' (generation ' + d.generation + ') by ', el('strong', { text: d.decided_by }),
        ' · ', when(d.decided_at)),
      el('div', { class: 'hint', text: 'token ' + d.token_identity + (d.digest ? ' · digest ' + d.digest : ' · no digest named') }),
      d.note ? el('blockquote', { text: d.note }) : null,
      el('details', {}, el('summary', { text: 'What it rested on' }), jsonBlock(d.rests_on)))));
  }

  /** Every case a person resolved, with who, their note and the evidence shown. */
  function resolvedList(resolved) {
    return el('ol', { class: 'resolved' }, resolved.map((r) => el('li', { 'data-case-id': r.case_id },
      el('div', {}, 'Case ' + r.case_id + ' resolved with ', el('strong', { text: r.action.replace(/_/g, ' ') }), ' by ',
        el('strong', { text: r.decided_by }), ' · ', when(r.decided_at)),
      r.token_identity ? el('div', { class: 'hint', text: 'token ' + r.token_identity }) : null,
      r.note ? el('blockquote', { text: r.note }) : null,
      (r.evidence || []).length ? el('details', {}, el('summary', { text: 'The evidence it was made on' }), evidenceList(r.evidence)) : null)));
  }

  function evidenceList(evidence) {
    return el('ul', { class: 'evidence' }, (evidence || []).map((e) => el('li', {},
      el('span', { class: 'source', text: e.source }), ' (', when(e.observed_at), '): ', e.finding)));
  }

  // --- acting on one task: each answers { ok, text } --------------------------------

  const taskPath = (task, action) => '/v1/tasks/' + encodeURIComponent(task.task_id) + '/' + action;

  /** A resolution of the case the person read (its id is sent, so a changed case is refused). */
  async function resolveCase(task, who, note, body) {
    const record = Object.assign({ case_id: task.case.case_id, decided_by: who }, body);
    if (note) record.note = note;
    const { status, data } = await api('POST', taskPath(task, 'resolution'), record);
    const done = body.action.replace(/_/g, ' ');
    return status === 202
      ? { ok: true, text: (data.repeated ? 'Already recorded: ' : 'Recorded: ') + done + '. The task moves on when the scheduler applies it.' }
      : { ok: false, status, title: problemTitle(status, data), text: 'Refused: ' + problemText(status, data) };
  }

  /** Approve or reject the wait on the card the person read (step, generation, digest). */
  async function decideApproval(task, who, note, decision) {
    const card = task.approval;
    if (!card) return { ok: false, title: 'Not known yet', text: 'What this step waits for is not known yet; nothing was sent.' };
    const body = { decided_by: who, step: card.step, generation: card.generation, digest: card.digest };
    if (note) body.note = note;
    const { status, data } = await api('POST', taskPath(task, decision), body);
    const done = decision === 'reject' ? 'Rejected' : 'Approved';
    return status === 202
      ? { ok: true, text: (data.repeated ? 'Already recorded: ' : '') + done + ' by ' + who + '.' }
      : { ok: false, status, title: problemTitle(status, data), text: 'Refused: ' + problemText(status, data) };
  }

  async function cancelTask(task) {
    const { status, data } = await api('POST', taskPath(task, 'cancel'));
    return status === 202
      ? { ok: true, text: (data.repeated ? 'Already asked: ' : 'Asked: ') + 'cancel. No further attempt starts.' }
      : { ok: false, status, title: problemTitle(status, data), text: 'Refused: ' + problemText(status, data) };
  }

  /** A person's decision as sent: without an answer (the network broke, the session
   *  ended) the page cannot know whether it was recorded, and says so. */
  const answered = (call) => call.catch((e) => ({
    ok: false,
    title: 'No answer',
    text: 'No answer (' + e.message + '): it may or may not have been recorded; the task shows what was.',
  }));

  const rememberedName = () => localStorage.getItem(NAME_KEY) || '';
  const nameInput = () => el('input', { type: 'text', class: 'decided-by', maxlength: '200', autocomplete: 'name', value: rememberedName() });

  // --- the people's queues: cases and approvals, paged, with bulk actions -------------

  /** Cards already on the page, by a key that changes when the question changes:
   *  a refresh keeps a card (and what someone has typed, ticked or selected in it). */
  const knownCards = new Map();
  /** The task each card was made from: what a bulk action sends. */
  const cardTasks = new WeakMap();

  function place(container, cards) {
    const keep = new Set(cards.map((c) => c.dataset.key));
    for (const child of [...container.children]) {
      if (!keep.has(child.dataset.key)) { knownCards.delete(child.dataset.key); child.remove(); }
    }
    for (const card of cards) container.append(card);
  }

  const caseKey = (task) => 'case:' + task.task_id + ':' + task.case.case_id;
  const approvalKey = (task) => 'approval:' + task.task_id + ':' + task.attempt + ':' + (task.awaiting_signal || '') + ':' +
    (task.approval ? task.approval.digest : '');

  const queues = {
    cases: {
      name: 'cases', states: ['outcome_unknown', 'needs_human'], list: 'cases', total: 0, loaded: {}, wanted: {}, cursors: {},
      key: (task) => (task.case ? caseKey(task) : null), card: (task, key) => caseCard(task, key, true),
      empty: 'Nothing waits for a decision.',
      actions: [
        { id: 'accept-failed', label: 'Accept selected as failed', named: true, run: (t, who, note) => t.case
          ? resolveCase(t, who, note, { action: 'accept_failed' })
          : { ok: false, title: 'No case', text: 'The task has no case to resolve; nothing was sent.' } },
        { id: 'cancel', label: 'Cancel selected', class: 'danger', named: false, run: (t) => cancelTask(t) },
      ],
    },
    approvals: {
      name: 'approvals', states: ['awaiting_approval'], list: 'approval-list', total: 0, loaded: {}, wanted: {}, cursors: {},
      key: approvalKey, card: (task, key) => approvalCard(task, key, true),
      empty: 'No approval waits.',
      actions: [
        { id: 'approve', label: 'Approve selected', class: 'primary', named: true, run: (t, who, note) => decideApproval(t, who, note, 'approve') },
        { id: 'reject', label: 'Reject selected', class: 'danger', named: true, run: (t, who, note) => decideApproval(t, who, note, 'reject') },
        { id: 'cancel', label: 'Cancel selected', named: false, run: (t) => cancelTask(t) },
      ],
    },
  };

  /** One page of a state's tasks (newest first) with each task read whole, since a
   *  card shows its case or approval. */
  async function readPage(state, limit, cursor) {
    const query = new URLSearchParams({ state, limit: String(limit) });
    if (cursor) query.set('cursor', cursor);
    const { status, data } = await api('GET', '/v1/tasks?' + query);
    if (status !== 200) return { tasks: [], next: null };
    const read = await Promise.all(data.tasks.map((t) => api('GET', '/v1/tasks/' + encodeURIComponent(t.task_id))));
    return { tasks: read.filter((r) => r.status === 200).map((r) => r.data), next: data.next_cursor || null };
  }

  /** The queue's cards: from the start (`reset`, or as many as were loaded, read
   *  again); `more` adds each state's next page after its cursor. */
  async function loadQueue(queue, reset, more) {
    const read = queue.read = (queue.read || 0) + 1;
    const pages = await Promise.all(queue.states.map((state) => {
      if (more) {
        queue.wanted[state] = (queue.loaded[state] || 0) + perPage();
        return queue.cursors[state] ? readPage(state, perPage(), queue.cursors[state]) : { tasks: [], next: null };
      }
      if (reset) queue.wanted[state] = perPage();
      const limit = Math.min(MOST_PER_CALL, Math.max(perPage(), queue.wanted[state] || 0));
      return readPage(state, limit, null);
    }));
    if (read !== queue.read) return;
    queue.states.forEach((state, i) => {
      queue.cursors[state] = pages[i].next;
      queue.loaded[state] = (more ? queue.loaded[state] || 0 : 0) + pages[i].tasks.length;
    });
    const container = $(queue.list);
    const before = more ? [...container.querySelectorAll(':scope > article')] : [];
    const cards = pages.flatMap((p) => p.tasks).map((task) => {
      const key = queue.key(task);
      if (!key) return null;
      if (!knownCards.has(key)) knownCards.set(key, queue.card(task, key));
      const card = knownCards.get(key);
      cardTasks.set(card, task);
      return card;
    }).filter(Boolean);
    const all = before.concat(cards.filter((c) => !before.includes(c)));
    place(container, all);
    if (all.length === 0) container.replaceChildren(el('p', { class: 'hint', 'data-key': 'none', text: queue.empty }));
    $(queue.name + '-more').hidden = !queue.states.some((s) => queue.cursors[s]);
    showQueueTally(queue);
  }

  function showQueueTally(queue) {
    const loaded = $(queue.list).querySelectorAll(':scope > article').length;
    const picked = selectedCards(queue).length;
    $(queue.name + '-shown').textContent = 'Showing ' + loaded + ' of ' + queue.total + '.';
    const tally = $(queue.name + '-picked');
    if (tally) tally.textContent = picked + ' selected';
    const all = $(queue.name + '-select-all');
    if (all) {
      all.checked = loaded > 0 && picked === loaded;
      all.indeterminate = picked > 0 && picked < loaded;
    }
  }

  const selectedCards = (queue) => [...$(queue.list).querySelectorAll(':scope > article input.pick:checked')]
    .map((box) => box.closest('article'));

  /** Above a queue: select all shown, who decides and why, and one button per action. */
  function bulkBar(queue) {
    const name = nameInput();
    name.id = queue.name + '-bulk-name';
    const note = el('input', { type: 'text', id: queue.name + '-bulk-note', class: 'bulk-note', maxlength: '4000' });
    const selectAll = el('input', { type: 'checkbox', id: queue.name + '-select-all', onchange: () => {
      for (const box of $(queue.list).querySelectorAll(':scope > article input.pick')) box.checked = selectAll.checked;
      showQueueTally(queue);
    } });
    const status = el('p', { id: queue.name + '-bulk-status', class: 'outcome', role: 'status' });
    const results = el('ol', { id: queue.name + '-results', class: 'bulk-results' });
    const buttons = queue.actions.map((action) => el('button', {
      type: 'button', class: 'bulk-' + action.id + (action.class ? ' ' + action.class : ''),
      onclick: () => runBulk(queue, action, name, note, status, results, buttons),
    }, action.label));
    $(queue.list).addEventListener('change', (event) => { if (event.target.matches('input.pick')) showQueueTally(queue); });
    return el('fieldset', { class: 'bulk' },
      el('legend', { text: 'Act on the selected tasks, one call each' }),
      el('div', { class: 'bulk-row' },
        el('label', { class: 'inline' }, selectAll, ' Select all shown'),
        el('span', { id: queue.name + '-picked', class: 'count', text: '0 selected' })),
      el('div', { class: 'bulk-row' },
        el('label', {}, 'Decided by ', name),
        el('label', {}, 'Note ', note)),
      el('div', { class: 'bulk-row' }, buttons),
      status, results);
  }

  /** Sends the action for each selected task, one after another, and shows what
   *  each answered: ok, or the problem's title. */
  async function runBulk(queue, action, name, note, status, results, buttons) {
    const cards = selectedCards(queue);
    if (cards.length === 0) { status.textContent = 'Select at least one task.'; return; }
    const who = name.value.trim();
    if (action.named && !who) { status.textContent = 'Name the person who decides.'; name.focus(); return; }
    if (who) localStorage.setItem(NAME_KEY, who);
    for (const b of buttons) b.disabled = true;
    status.textContent = action.label + ': sending ' + cards.length + '…';
    results.replaceChildren();
    let done = 0;
    for (const card of cards) {
      const task = cardTasks.get(card);
      const line = el('li', { 'data-task-id': task.task_id, class: 'pending' }, taskLink(task.task_id), ' ' + task.kind + ': ',
        el('span', { class: 'result', text: 'sending…' }));
      results.append(line);
      const result = await answered(action.run(task, who, note.value.trim()));
      line.className = result.ok ? 'ok' : 'refused';
      line.dataset.outcome = result.ok ? 'ok' : 'refused';
      line.querySelector('.result').textContent = result.ok ? 'ok — ' + result.text : result.title + ' — ' + result.text;
      const outcome = card.querySelector('.outcome');
      if (outcome) outcome.textContent = result.text;
      if (result.ok) done += 1;
    }
    // Acted on: a later bulk action starts from nothing selected.
    for (const card of cards) card.querySelector('input.pick').checked = false;
    showQueueTally(queue);
    status.textContent = action.label + ': ' + done + ' of ' + cards.length + ' done' +
      (done < cards.length ? ', ' + (cards.length - done) + ' refused (below).' : '.');
    for (const b of buttons) b.disabled = false;
    scheduleRefresh();
  }

  const pickBox = (task) => el('label', { class: 'pick-label inline' },
    el('input', { type: 'checkbox', class: 'pick', 'aria-label': 'Select task ' + task.task_id }), ' Select');

  function cardHeading(task, selectable) {
    return el('div', { class: 'card-head' }, selectable ? pickBox(task) : null,
      el('h3', {}, stateBadge(task.state), ' ', task.kind, ' ', taskLink(task.task_id)));
  }

  function caseCard(task, key, selectable) {
    const outcome = el('div', { class: 'outcome', role: 'status' });
    const buttons = [];
    const name = nameInput();
    const note = el('textarea', { class: 'note', maxlength: '4000', rows: '2' });
    const send = async (body) => {
      const who = name.value.trim();
      if (!who) { outcome.textContent = 'Name the person who decides.'; name.focus(); return; }
      localStorage.setItem(NAME_KEY, who);
      for (const b of buttons) b.disabled = true;
      outcome.textContent = 'Sending…';
      const result = await answered(resolveCase(task, who, note.value.trim(), body));
      outcome.textContent = result.text;
      if (!result.ok) {
        for (const b of buttons) b.disabled = false;
        acknowledge.dispatchEvent(new Event('change'));
      }
      scheduleRefresh();
    };
    const says = (action) => (task.case.resolutions && task.case.resolutions[action]) || '';

    const acknowledge = el('input', { type: 'checkbox', class: 'acknowledge' });
    const retry = el('button', { type: 'button', class: 'danger retry', disabled: true,
      onclick: () => { if (acknowledge.checked) send({ action: 'retry_as_new', acknowledge_possible_charge: true }); } },
    'Retry as new');
    acknowledge.addEventListener('change', () => { retry.disabled = !acknowledge.checked; });
    const fail = el('button', { type: 'button', class: 'accept-failed', onclick: () => send({ action: 'accept_failed' }) },
      'Accept as failed');
    const uri = el('input', { type: 'text', class: 'result-uri', placeholder: 'https://…' });
    const sha = el('input', { type: 'text', class: 'result-sha256', placeholder: '64 hex characters', pattern: '[0-9a-f]{64}' });
    const size = el('input', { type: 'number', class: 'result-size', min: '0', placeholder: 'bytes' });
    const attach = el('button', { type: 'button', class: 'primary attach', onclick: () => send({
      action: 'attach_result',
      result: { uri: uri.value.trim(), sha256: sha.value.trim().toLowerCase(), size_bytes: Number(size.value || 0) },
    }) }, 'Attach result');
    buttons.push(retry, fail, attach);

    const card = el('article', { class: 'card', 'data-key': key, 'data-task-id': task.task_id, 'data-case-id': task.case.case_id },
      cardHeading(task, selectable),
      el('div', { class: 'hint', text: (task.reason || '') + (task.step ? ' — step ' + task.step : '') + ' — case ' + task.case.case_id }),
      el('strong', { text: 'Evidence' }),
      evidenceList(task.case.evidence),
      decidedOn(task),
      el('div', { class: 'actions' },
        el('label', {}, 'Decided by ', name),
        el('label', {}, 'Note ', note)),
      el('div', { class: 'actions' },
        el('div', { class: 'action' }, el('p', { text: says('retry_as_new') }),
          el('label', {}, acknowledge, ' I understand the provider may charge for this work again.'), retry),
        el('div', { class: 'action' }, el('p', { text: says('accept_failed') }), fail),
        el('div', { class: 'action' }, el('p', { text: says('attach_result') }),
          el('label', {}, 'URI', uri), el('label', {}, 'sha256', sha), el('label', {}, 'Size in bytes', size), attach)),
      outcome);
    cardTasks.set(card, task);
    return card;
  }

  /** An approval's card: what it lets happen and rests on, who decides, a note,
   *  and Approve or Reject, bound to this wait and to the digest shown. */
  function approvalCard(task, key, selectable) {
    const outcome = el('div', { class: 'outcome', role: 'status' });
    const name = nameInput();
    const note = el('textarea', { class: 'note', maxlength: '4000', rows: '2' });
    const buttons = [];
    const decide = async (decision) => {
      const who = name.value.trim();
      if (!who) { outcome.textContent = 'Name the person who decides.'; name.focus(); return; }
      localStorage.setItem(NAME_KEY, who);
      for (const b of buttons) b.disabled = true;
      outcome.textContent = 'Sending…';
      const result = await answered(decideApproval(task, who, note.value.trim(), decision));
      outcome.textContent = result.text;
      if (!result.ok) for (const b of buttons) b.disabled = false;
      scheduleRefresh();
    };
    const approve = el('button', { type: 'button', class: 'primary approve', disabled: !task.approval, onclick: () => decide('approve') }, 'Approve');
    const reject = el('button', { type: 'button', class: 'danger reject', disabled: !task.approval, onclick: () => decide('reject') }, 'Reject');
    buttons.push(approve, reject);
    const card = el('article', { class: 'card approval', 'data-key': key, 'data-task-id': task.task_id },
      cardHeading(task, selectable),
      el('div', { class: 'hint', text: (task.reason || '') + (task.step ? ' — step ' + task.step : '') }),
      el('div', {}, labels(task.labels)),
      task.approval ? approvalFacts(task.approval) : el('p', { text: 'What this step waits for is not known yet.' }),
      task.input !== undefined && task.input !== null ? el('details', {}, el('summary', { text: 'Input' }), jsonBlock(task.input)) : null,
      el('div', { class: 'actions' },
        el('label', {}, 'Decided by ', name),
        el('label', {}, 'Note ', note),
        el('div', { class: 'decide' }, approve, reject)),
      outcome);
    cardTasks.set(card, task);
    return card;
  }

  // --- wiring -------------------------------------------------------------------------

  function start() {
    for (const state of STATES) $('filter-state').append(el('option', { value: state, text: state.replace(/_/g, ' ') }));
    $('per-page').value = localStorage.getItem(PER_PAGE_KEY) || '20';
    $('per-page').addEventListener('change', () => {
      localStorage.setItem(PER_PAGE_KEY, $('per-page').value);
      if (view === 'tasks') loadTasks(true).catch(() => {});
      else if (queues[view]) loadQueue(queues[view], true).catch(() => {});
    });
    $('cases-bulk').replaceChildren(bulkBar(queues.cases));
    $('approvals-bulk').replaceChildren(bulkBar(queues.approvals));
    $('cases-more').addEventListener('click', () => loadQueue(queues.cases, false, true).catch(() => {}));
    $('approvals-more').addEventListener('click', () => loadQueue(queues.approvals, false, true).catch(() => {}));
    $('sign-in-form').addEventListener('submit', (event) => {
      event.preventDefault();
      const candidate = $('token').value.trim();
      $('token').value = '';
      $('sign-in-error').textContent = '';
      signIn(candidate).catch((e) => { if (!(e instanceof ApiError) || e.message !== 'unauthorized') signOut('Signing in failed: ' + e.message); });
    });
    $('sign-out').addEventListener('click', () => signOut(''));
    $('filters').addEventListener('submit', (event) => { event.preventDefault(); quietly(loadTasks(true)); quietly(loadSummary()); });
    $('filter-clear').addEventListener('click', () => {
      for (const id of ['filter-state', 'filter-kind', 'filter-label', 'filter-since', 'filter-until']) $(id).value = '';
      quietly(loadTasks(true)); quietly(loadSummary());
    });
    $('more').addEventListener('click', () => quietly(loadMore()));
    window.addEventListener('hashchange', route);
    setInterval(refreshAgo, 5000);
    const saved = sessionStorage.getItem(TOKEN_KEY);
    if (saved) signIn(saved).catch(() => {});
  }

  start();
})();

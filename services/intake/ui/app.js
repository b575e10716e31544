// Fenceline dashboard (docs/dashboard.md): plain JavaScript, no build step. Every
// value from the API reaches the page as text (textContent, text nodes, attribute
// values set one by one); nothing is ever parsed as HTML.
'use strict';

(() => {
  const TOKEN_KEY = 'fenceline.dashboard.token';
  const STATES = ['queued', 'waiting', 'running', 'awaiting_approval', 'outcome_unknown', 'needs_human',
    'succeeded', 'failed', 'cancelled'];
  const PAGE = 50;
  const SHOWN_CASES = 20;

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

  const when = (iso) => {
    if (!iso) return '';
    const d = new Date(iso);
    return Number.isNaN(d.getTime()) ? String(iso) : d.toLocaleString();
  };
  const short = (id) => String(id || '').slice(-12);
  const stateBadge = (state) => el('span', { class: 'state state-' + String(state).replace(/[^a-z_]/g, ''), text: state });

  // --- session ----------------------------------------------------------------------

  let token = null;
  let tenant = null;
  let stream = null;          // AbortController of the event stream
  let lastEventId = null;
  let selected = null;        // the task shown in detail
  let nextCursor = null;
  let shown = 0;              // rows loaded in the task table

  class ApiError extends Error {}

  async function api(method, path, body) {
    const headers = { Authorization: 'Bearer ' + token, Accept: 'application/json' };
    const init = { method, headers, cache: 'no-store', credentials: 'omit' };
    if (body !== undefined) {
      headers['Content-Type'] = 'application/json';
      init.body = JSON.stringify(body);
    }
    const response = await fetch(path, init);
    let data = null;
    try { data = await response.json(); } catch (_) { data = null; }
    if (response.status === 401) {
      signOut('The token was refused: it is unknown or revoked.');
      throw new ApiError('unauthorized');
    }
    return { status: response.status, data };
  }

  const problemText = (status, data) =>
    (data && (data.detail || data.title)) ? String(data.detail || data.title) : 'answered ' + status;

  async function signIn(candidate) {
    token = candidate;
    const { status, data } = await api('GET', '/v1/summary');
    if (status !== 200) throw new ApiError(problemText(status, data));
    tenant = data.tenant;
    sessionStorage.setItem(TOKEN_KEY, token);
    $('tenant').textContent = 'tenant ' + tenant;
    $('sign-in').hidden = true;
    $('board').hidden = false;
    $('sign-out').hidden = false;
    renderSummary(data);
    loadSpend();
    openStream();
  }

  function signOut(message) {
    if (stream) stream.abort();
    stream = null;
    token = null;
    tenant = null;
    lastEventId = null;
    selected = null;
    sessionStorage.removeItem(TOKEN_KEY);
    $('tenant').textContent = '';
    setLive(false);
    $('board').hidden = true;
    $('detail').hidden = true;
    $('sign-out').hidden = true;
    $('sign-in').hidden = false;
    for (const id of ['task-rows', 'cases', 'approval-list', 'states', 'timeline', 'detail-facts', 'detail-attempts', 'detail-case']) {
      $(id).replaceChildren();
    }
    for (const id of ['detail-id', 'decisions-count', 'approvals-count', 'tasks-error']) $(id).textContent = '';
    knownCards.clear();
    $('sign-in-error').textContent = message || '';
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

  /** One task changed: update its row at once, then refresh counts and queues. */
  function onTask(task) {
    const row = document.querySelector('tr[data-task-id="' + CSS.escape(String(task.task_id)) + '"]');
    if (row && Number(row.dataset.version) <= Number(task.version)) row.replaceWith(taskRow(task));
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

  async function refreshAll() {
    if (!token) return;
    if (refreshing) { refreshAgain = true; return; }
    refreshing = true;
    try {
      await Promise.all([loadSummary(), loadTasks(false), loadCases(), loadApprovals(), selected ? loadDetail(selected) : null]);
    } catch (e) {
      if (!(e instanceof ApiError)) $('tasks-error').textContent = 'Reading the API failed: ' + e.message;
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

  async function loadSummary() {
    const { status, data } = await api('GET', '/v1/summary?' + filterQuery(false));
    if (status === 200) renderSummary(data);
    loadSpend();
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
      onclick: () => { $('filter-state').value = active === state ? '' : state; loadTasks(true); loadSummary(); },
    }, state.replace(/_/g, ' '), el('span', { class: 'n', text: String(summary.states[state] || 0) })));
    $('states').replaceChildren(...chips);
  }

  async function loadTasks(reset) {
    const query = filterQuery(true);
    query.set('limit', String(reset ? PAGE : Math.min(200, Math.max(PAGE, shown))));
    const { status, data } = await api('GET', '/v1/tasks?' + query);
    if (status !== 200) { $('tasks-error').textContent = problemText(status, data); return; }
    $('tasks-error').textContent = '';
    $('task-rows').replaceChildren(...data.tasks.map(taskRow));
    shown = data.tasks.length;
    nextCursor = data.next_cursor || null;
    $('more').hidden = !nextCursor;
    $('tasks-empty').hidden = shown > 0;
  }

  async function loadMore() {
    if (!nextCursor) return;
    const query = filterQuery(true);
    query.set('limit', String(PAGE));
    query.set('cursor', nextCursor);
    const { status, data } = await api('GET', '/v1/tasks?' + query);
    if (status !== 200) { $('tasks-error').textContent = problemText(status, data); return; }
    $('task-rows').append(...data.tasks.map(taskRow));
    shown += data.tasks.length;
    nextCursor = data.next_cursor || null;
    $('more').hidden = !nextCursor;
  }

  const labels = (map) => Object.entries(map || {}).map(([k, v]) => el('span', { class: 'label', text: k + ':' + v }));

  function taskRow(task) {
    return el('tr', {
      'data-task-id': task.task_id,
      'data-state': task.state,
      'data-version': task.version,
      class: selected === task.task_id ? 'selected' : '',
      onclick: () => select(task.task_id),
    },
    el('td', { class: 'mono', title: task.task_id, text: short(task.task_id) }),
    el('td', { text: task.kind }),
    el('td', { class: 'state-cell' }, stateBadge(task.state)),
    el('td', { text: task.reason || '' }),
    el('td', { text: String(task.attempt) }),
    el('td', { text: [task.step, task.phase].filter(Boolean).join(' · ') }),
    el('td', {}, labels(task.labels)),
    el('td', { text: when(task.updated_at) }));
  }

  // --- one task: facts, attempts, timeline ------------------------------------------

  function select(taskId) {
    selected = taskId;
    for (const row of document.querySelectorAll('#task-rows tr')) {
      row.classList.toggle('selected', row.dataset.taskId === taskId);
    }
    loadDetail(taskId).catch(() => {});
  }

  async function loadDetail(taskId) {
    const { status, data } = await api('GET', '/v1/tasks/' + encodeURIComponent(taskId));
    if (selected !== taskId) return;
    if (status !== 200) { $('detail').hidden = true; return; }
    renderDetail(data);
  }

  function renderDetail(task) {
    $('detail').hidden = false;
    $('detail').dataset.taskId = task.task_id;
    $('detail').dataset.state = task.state;
    $('detail-id').textContent = task.task_id;
    const facts = [
      ['kind', task.kind], ['state', stateBadge(task.state)], ['why', task.reason],
      ['attempt', String(task.attempt)], ['step', task.step], ['phase', task.phase],
      ['labels', labels(task.labels)], ['accepted', when(task.accepted_at)], ['updated', when(task.updated_at)],
      ['version', String(task.version)], ['next attempt', when(task.next_attempt_at)],
      ['result', task.result ? task.result.uri + ' · ' + task.result.size_bytes + ' bytes · sha256 ' + task.result.sha256 : null],
      ['case', task.case_id], ['waiting for signal', task.awaiting_signal], ['trace id', task.trace_id],
    ].filter(([, v]) => v !== null && v !== undefined && v !== '' && !(Array.isArray(v) && v.length === 0));
    $('detail-facts').replaceChildren(...facts.flatMap(([k, v]) => [el('dt', { text: k }), el('dd', { 'data-fact': k }, v)]));
    $('detail-case').replaceChildren(...(task.case ? [evidenceList(task.case.evidence)] : []));
    $('detail-decided').replaceChildren(decidedOn(task),
      ...(task.approval ? [el('strong', { text: 'Waiting for approval' }), approvalFacts(task.approval)] : []),
      ...((task.decisions || []).length ? [el('strong', { text: 'Decisions' }), decisionList(task.decisions)] : []),
      ...((task.resolved_cases || []).length ? [el('strong', { text: 'Resolved cases' }), resolvedList(task.resolved_cases)] : []));
    $('detail-attempts').replaceChildren(...(task.attempts || []).map((a) => el('tr', {},
      el('td', { text: String(a.attempt) }), el('td', { text: a.outcome }), el('td', { text: a.error_class || '' }),
      el('td', { text: a.detail || '' }),
      el('td', { text: a.money_may_have_been_spent === null || a.money_may_have_been_spent === undefined ? '' : (a.money_may_have_been_spent ? 'yes' : 'no') }),
      el('td', { text: a.recovery || '' }), el('td', { text: when(a.started_at) }), el('td', { text: when(a.ended_at) }))));
    $('timeline').replaceChildren(...(task.timeline || []).map((line) => el('li', { 'data-event': line.event },
      el('span', { class: 'when', text: when(line.at) }),
      el('span', { class: 'who', text: line.source }),
      el('span', { class: 'mono', text: line.event }),
      el('span', {},
        [line.attempt ? 'attempt ' + line.attempt : null, line.step, line.phase].filter(Boolean).join(' · '),
        line.detail ? el('div', { text: line.detail }) : null,
        line.trace_id ? el('span', { class: 'trace mono', text: 'trace ' + line.trace_id }) : null))));
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
      el('div', { class: 'hint' }, el('strong', { text: o.step }), ' · generation ' + o.generation + ' · ' + when(o.checkpointed_at) +
        (o.provider ? ' · ' + o.provider + (o.cost_minor !== undefined && o.cost_minor !== null ? ' · cost ' + o.cost_minor : ' · unpriced') : '')),
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
        ' · ' + when(d.decided_at)),
      el('div', { class: 'hint', text: 'token ' + d.token_identity + (d.digest ? ' · digest ' + d.digest : ' · no digest named') }),
      d.note ? el('blockquote', { text: d.note }) : null,
      el('details', {}, el('summary', { text: 'What it rested on' }), jsonBlock(d.rests_on)))));
  }

  /** Every case a person resolved, with who, their note and the evidence shown. */
  function resolvedList(resolved) {
    return el('ol', { class: 'resolved' }, resolved.map((r) => el('li', { 'data-case-id': r.case_id },
      el('div', {}, 'Case ' + r.case_id + ' resolved with ', el('strong', { text: r.action.replace(/_/g, ' ') }), ' by ',
        el('strong', { text: r.decided_by }), ' · ' + when(r.decided_at)),
      r.token_identity ? el('div', { class: 'hint', text: 'token ' + r.token_identity }) : null,
      r.note ? el('blockquote', { text: r.note }) : null,
      (r.evidence || []).length ? el('details', {}, el('summary', { text: 'The evidence it was made on' }), evidenceList(r.evidence)) : null)));
  }

  function evidenceList(evidence) {
    return el('ul', { class: 'evidence' }, (evidence || []).map((e) => el('li', {},
      el('span', { class: 'source', text: e.source }), ' (' + when(e.observed_at) + '): ', e.finding)));
  }

  // --- the people's queues: cases and approvals ---------------------------------------

  /** Cards already on the page, by a key that changes when the question changes:
   *  a refresh keeps a card (and what someone has typed or ticked in it). */
  const knownCards = new Map();

  function place(container, cards) {
    const keep = new Set(cards.map((c) => c.dataset.key));
    for (const child of [...container.children]) {
      if (!keep.has(child.dataset.key)) { knownCards.delete(child.dataset.key); child.remove(); }
    }
    for (const card of cards) if (card.parentNode !== container) container.append(card);
  }

  async function details(state) {
    const { status, data } = await api('GET', '/v1/tasks?limit=' + SHOWN_CASES + '&state=' + state);
    if (status !== 200) return [];
    const read = await Promise.all(data.tasks.map((t) => api('GET', '/v1/tasks/' + encodeURIComponent(t.task_id))));
    return read.filter((r) => r.status === 200).map((r) => r.data);
  }

  async function loadCases() {
    const tasks = (await details('outcome_unknown')).concat(await details('needs_human'));
    $('decisions-count').textContent = '(' + tasks.length + ')';
    const cards = tasks.filter((t) => t.case).map((task) => {
      const key = 'case:' + task.task_id + ':' + task.case.case_id;
      if (!knownCards.has(key)) knownCards.set(key, caseCard(task, key));
      return knownCards.get(key);
    });
    place($('cases'), cards);
    if (cards.length === 0) $('cases').replaceChildren(el('p', { class: 'hint', 'data-key': 'none', text: 'Nothing waits for a decision.' }));
  }

  function caseCard(task, key) {
    const outcome = el('div', { class: 'outcome', role: 'status' });
    const buttons = [];
    const name = el('input', { type: 'text', class: 'decided-by', maxlength: '200', autocomplete: 'name',
      value: localStorage.getItem(NAME_KEY) || '' });
    const note = el('textarea', { class: 'note', maxlength: '4000', rows: '2' });
    const send = async (body) => {
      const who = name.value.trim();
      if (!who) { outcome.textContent = 'Name the person who decides.'; name.focus(); return; }
      localStorage.setItem(NAME_KEY, who);
      for (const b of buttons) b.disabled = true;
      outcome.textContent = 'Sending…';
      const record = { case_id: task.case.case_id, decided_by: who };
      if (note.value.trim()) record.note = note.value.trim();
      const { status, data } = await api('POST', '/v1/tasks/' + encodeURIComponent(task.task_id) + '/resolution',
        Object.assign(record, body));
      if (status === 202) {
        outcome.textContent = (data.repeated ? 'Already recorded: ' : 'Recorded: ') + body.action.replace(/_/g, ' ') +
          '. The task moves on when the scheduler applies it.';
      } else {
        outcome.textContent = 'Refused: ' + problemText(status, data);
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

    return el('article', { class: 'card', 'data-key': key, 'data-task-id': task.task_id, 'data-case-id': task.case.case_id },
      el('h3', {}, stateBadge(task.state), ' ', task.kind, ' ', el('code', { title: task.task_id, text: short(task.task_id) })),
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
  }

  async function loadApprovals() {
    const tasks = await details('awaiting_approval');
    $('approvals-count').textContent = '(' + tasks.length + ')';
    const cards = tasks.map((task) => {
      const key = 'approval:' + task.task_id + ':' + task.attempt + ':' + (task.awaiting_signal || '') + ':' +
        (task.approval ? task.approval.digest : '');
      if (!knownCards.has(key)) knownCards.set(key, approvalCard(task, key));
      return knownCards.get(key);
    });
    place($('approval-list'), cards);
    if (cards.length === 0) $('approval-list').replaceChildren(el('p', { class: 'hint', 'data-key': 'none', text: 'No approval waits.' }));
  }

  const NAME_KEY = 'fenceline.dashboard.name';

  /** An approval's card: what it lets happen and rests on, who decides, a note,
   *  and Approve or Reject, bound to this wait and to the digest shown. */
  function approvalCard(task, key) {
    const outcome = el('div', { class: 'outcome', role: 'status' });
    const card = task.approval;
    const name = el('input', { type: 'text', class: 'decided-by', maxlength: '200', autocomplete: 'name',
      value: localStorage.getItem(NAME_KEY) || '' });
    const note = el('textarea', { class: 'note', maxlength: '4000', rows: '2' });
    const buttons = [];
    const decide = async (decision) => {
      const who = name.value.trim();
      if (!who) { outcome.textContent = 'Name the person who decides.'; name.focus(); return; }
      localStorage.setItem(NAME_KEY, who);
      for (const b of buttons) b.disabled = true;
      outcome.textContent = 'Sending…';
      const body = { decided_by: who, step: card.step, generation: card.generation, digest: card.digest };
      if (note.value.trim()) body.note = note.value.trim();
      const { status, data } = await api('POST', '/v1/tasks/' + encodeURIComponent(task.task_id) + '/' + decision, body);
      if (status === 202) {
        const done = decision === 'reject' ? 'Rejected' : 'Approved';
        outcome.textContent = (data.repeated ? 'Already recorded: ' : '') + done + ' by ' + who + '.';
      } else {
        outcome.textContent = 'Refused: ' + problemText(status, data);
        for (const b of buttons) b.disabled = false;
      }
      scheduleRefresh();
    };
    const approve = el('button', { type: 'button', class: 'primary approve', disabled: !card, onclick: () => decide('approve') }, 'Approve');
    const reject = el('button', { type: 'button', class: 'danger reject', disabled: !card, onclick: () => decide('reject') }, 'Reject');
    buttons.push(approve, reject);
    return el('article', { class: 'card approval', 'data-key': key, 'data-task-id': task.task_id },
      el('h3', {}, stateBadge(task.state), ' ', task.kind, ' ', el('code', { title: task.task_id, text: short(task.task_id) })),
      el('div', { class: 'hint', text: (task.reason || '') + (task.step ? ' — step ' + task.step : '') }),
      el('div', {}, labels(task.labels)),
      card ? approvalFacts(card) : el('p', { text: 'What this step waits for is not known yet.' }),
      task.input !== undefined && task.input !== null ? el('details', {}, el('summary', { text: 'Input' }), jsonBlock(task.input)) : null,
      el('div', { class: 'actions' },
        el('label', {}, 'Decided by ', name),
        el('label', {}, 'Note ', note),
        approve, reject),
      outcome);
  }

  // --- wiring -------------------------------------------------------------------------

  function start() {
    for (const state of STATES) $('filter-state').append(el('option', { value: state, text: state.replace(/_/g, ' ') }));
    $('sign-in-form').addEventListener('submit', (event) => {
      event.preventDefault();
      const candidate = $('token').value.trim();
      $('token').value = '';
      $('sign-in-error').textContent = '';
      signIn(candidate).catch((e) => { if (!(e instanceof ApiError) || e.message !== 'unauthorized') signOut('Signing in failed: ' + e.message); });
    });
    $('sign-out').addEventListener('click', () => signOut(''));
    $('filters').addEventListener('submit', (event) => { event.preventDefault(); loadTasks(true); loadSummary(); });
    $('filter-clear').addEventListener('click', () => {
      for (const id of ['filter-state', 'filter-kind', 'filter-label', 'filter-since', 'filter-until']) $(id).value = '';
      loadTasks(true); loadSummary();
    });
    $('more').addEventListener('click', () => loadMore());
    $('detail-close').addEventListener('click', () => {
      selected = null;
      $('detail').hidden = true;
      for (const row of document.querySelectorAll('#task-rows tr.selected')) row.classList.remove('selected');
    });
    const saved = sessionStorage.getItem(TOKEN_KEY);
    if (saved) signIn(saved).catch(() => {});
  }

  start();
})();

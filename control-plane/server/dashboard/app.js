// suanli dashboard: a one-page app on the server's read API (/api/<Service>/<Method>).
// Every value from the server is written with textContent or as an attribute: never as HTML.
'use strict';

const TOKEN_KEY = 'suanli.token';
const REFRESH_MS = 5000;
let refreshTimer = null;
let rendering = false;

// ---------- helpers ----------

/** An element: h('td', {class: 'num'}, 'text', childNode, ...). Strings become text nodes. */
function h(tag, attrs, ...children) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === undefined || v === null || v === false) continue;
    if (k === 'class') el.className = v;
    else el.setAttribute(k, String(v));
  }
  for (const c of children.flat()) {
    if (c === undefined || c === null || c === false) continue;
    el.appendChild(typeof c === 'object' ? c : document.createTextNode(String(c)));
  }
  return el;
}

function token() {
  try { return sessionStorage.getItem(TOKEN_KEY) || ''; } catch (_) { return ''; }
}

/** Reads `#<route>&token=<t>` (or `#token=<t>`): the token goes to sessionStorage and leaves the URL. */
function route() {
  const raw = location.hash.replace(/^#/, '');
  let r = '';
  let found = false;
  for (const part of raw.split('&')) {
    if (part.startsWith('token=')) {
      found = true;
      const t = decodeURIComponent(part.slice(6));
      try { sessionStorage.setItem(TOKEN_KEY, t); } catch (_) { /* private mode: kept in memory below */ }
      window.__token = t;
    } else if (part) {
      r = part;
    }
  }
  if (!r) r = '/overview';
  if (found) history.replaceState(null, '', '#' + r);
  return r;
}

class ApiError extends Error {
  constructor(status, code, message) { super(message); this.status = status; this.code = code; }
}

/** GET /api/<path>?params with the bearer token, as JSON. */
async function api(path, params) {
  const qs = new URLSearchParams(params || {}).toString();
  const headers = { 'Accept': 'application/json' };
  const t = token() || window.__token || '';
  if (t) headers['Authorization'] = 'Bearer ' + t;
  const r = await fetch('/api/' + path + (qs ? '?' + qs : ''), { headers, cache: 'no-store', credentials: 'omit' });
  let body = null;
  try { body = await r.json(); } catch (_) { body = null; }
  if (!r.ok) {
    throw new ApiError(r.status, body && body.code || String(r.status), body && body.message || r.statusText);
  }
  return body;
}

/** Every page of a list method: `key` holds the items, `next` the page token (`after`/`after_id`). */
async function all(path, key, tokenParam, nextKey, params) {
  let out = [];
  let after = '';
  for (let i = 0; i < 50; i++) {
    const p = Object.assign({}, params || {});
    if (after) p[tokenParam] = after;
    const r = await api(path, p);
    out = out.concat(r[key] || []);
    const n = r[nextKey];
    if (!n || n === '0' || n === 0) break;
    after = String(n);
  }
  return out;
}

const BIG = 1e15;
function devices(milli) { return milli >= BIG ? '∞' : fmtNum(milli / 1000); }
function cores(milli) { return milli >= BIG ? '∞' : fmtNum(milli / 1000); }
function gib(mib) { return mib >= BIG ? '∞' : fmtNum(mib / 1024); }
function fmtNum(x) { return Number.isInteger(x) ? String(x) : x.toFixed(x < 10 ? 2 : 1); }
function pct(x) { return Math.round(x) + '%'; }
function now() { return Date.now() / 1000; }
function ago(t) { return t ? dur(now() - t) + ' ago' : '–'; }
function dur(s) {
  s = Math.max(0, Math.round(s));
  if (s < 60) return s + 's';
  if (s < 3600) return Math.floor(s / 60) + 'm ' + (s % 60) + 's';
  if (s < 86400) return Math.floor(s / 3600) + 'h ' + Math.floor((s % 3600) / 60) + 'm';
  return Math.floor(s / 86400) + 'd ' + Math.floor((s % 86400) / 3600) + 'h';
}
function time(t) { return t ? new Date(t * 1000).toLocaleString() : '–'; }
function state(s) { return h('span', { class: 'state ' + String(s || '').toLowerCase() }, s || '–'); }
function res(r) { return r || { cpu_milli: 0, memory_mib: 0, gpu_milli: 0, npu_milli: 0 }; }

/** A bar of used (and borrowed) against a total. */
function bar(used, total, borrowed, label) {
  const b = h('div', { class: 'bar' });
  const unlimited = total >= BIG;
  const scale = unlimited || total <= 0 ? Math.max(used + (borrowed || 0), 1) * 4 : total;
  const f = h('div', { class: 'fill' + (!unlimited && total > 0 && used > total ? ' over' : '') });
  f.style.width = Math.min(100, (used / scale) * 100) + '%';
  b.appendChild(f);
  if (borrowed) {
    const g = h('div', { class: 'fill borrow' });
    g.style.left = Math.min(100, (used / scale) * 100) + '%';
    g.style.width = Math.min(100, (borrowed / scale) * 100) + '%';
    b.appendChild(g);
  }
  return h('div', { class: 'barwrap' }, b, h('span', { class: 't' }, label));
}

function table(headers, rows, empty) {
  if (!rows.length) return h('div', { class: 'empty' }, empty || 'none');
  return h('table', {},
    h('thead', {}, h('tr', {}, headers.map((x) => h('th', { class: x.startsWith('#') ? 'num' : '' }, x.replace(/^#/, ''))))),
    h('tbody', {}, rows));
}
function num(v) { return h('td', { class: 'num' }, v); }

/** Heatmap color of a utilization percentage. */
function heat(u) {
  const x = Math.max(0, Math.min(100, u)) / 100;
  // light blue (idle) → green → amber → red (busy)
  const stops = [[210, 70, 92], [150, 60, 70], [45, 90, 62], [5, 80, 58]];
  const p = x * (stops.length - 1);
  const i = Math.min(stops.length - 2, Math.floor(p));
  const f = p - i;
  const a = stops[i], b = stops[i + 1];
  const mix = (j) => a[j] + (b[j] - a[j]) * f;
  return 'hsl(' + mix(0).toFixed(0) + ',' + mix(1).toFixed(0) + '%,' + mix(2).toFixed(0) + '%)';
}

// ---------- pages ----------

async function cluster() {
  const [members, leader] = await Promise.all([api('Cluster/Members'), api('Cluster/Leader')]);
  const badge = document.getElementById('leader-badge');
  badge.textContent = leader.leader_id ? 'leader s' + leader.leader_id + ' · term ' + leader.term : 'no leader';
  badge.className = 'badge ' + (leader.leader_id ? 'ok' : 'bad');
  return { members, leader };
}

async function overview() {
  const [{ members, leader }, pools, nodes, jobs] = await Promise.all([
    cluster(),
    all('Pools/List', 'pools', 'after', 'next_after'),
    all('Nodes/List', 'nodes', 'after', 'next_after'),
    all('Jobs/List', 'jobs', 'after_id', 'next_after_id'),
  ]);
  const devs = nodes.flatMap((n) => n.devices || []);
  const unhealthy = devs.filter((d) => d.health && d.health !== 'healthy').length;
  const active = jobs.filter((j) => ['running', 'placed'].includes(j.state)).length;
  const pending = jobs.filter((j) => j.state === 'pending').length;
  const ready = nodes.filter((n) => n.status === 'ready').length;
  const card = (k, v, s) => h('div', { class: 'card' }, h('div', { class: 'k' }, k), h('div', { class: 'v' }, v), h('div', { class: 's' }, s));
  const cards = h('div', { class: 'cards' },
    card('Leader', leader.leader_id ? 's' + leader.leader_id : 'none', leader.leader_addr || 'no leader elected'),
    card('Servers', String((members.members || []).length), 'term ' + members.term + ' · commit ' + members.commit_index),
    card('Nodes ready', ready + ' / ' + nodes.length, pools.length + ' pools'),
    card('Devices', String(devs.length), unhealthy ? unhealthy + ' unhealthy' : 'all healthy'),
    card('Jobs running', String(active), pending + ' pending · ' + jobs.length + ' known'));

  const poolRows = pools.map((p) => {
    const c = res(p.capacity), u = res(p.used);
    return h('tr', {}, h('td', {}, h('b', {}, p.name)), num(p.ready_nodes + ' / ' + p.nodes),
      h('td', {}, bar(u.gpu_milli, c.gpu_milli, 0, devices(u.gpu_milli) + ' / ' + devices(c.gpu_milli) + ' GPU')),
      h('td', {}, bar(u.npu_milli, c.npu_milli, 0, devices(u.npu_milli) + ' / ' + devices(c.npu_milli) + ' NPU')),
      h('td', {}, bar(u.cpu_milli, c.cpu_milli, 0, cores(u.cpu_milli) + ' / ' + cores(c.cpu_milli) + ' cores')),
      h('td', {}, bar(u.memory_mib, c.memory_mib, 0, gib(u.memory_mib) + ' / ' + gib(c.memory_mib) + ' GiB')));
  });
  const serverRows = (members.members || []).map((m) => h('tr', {},
    h('td', {}, 's' + m.id), h('td', { class: 'mono' }, m.addr), h('td', {}, m.voter ? 'voter' : 'learner'),
    h('td', {}, m.leader ? state('leader') : ''), num(m.matched_index)));

  const heatmap = h('div', { id: 'heatmap' }, nodes.map((n) => {
    const stats = {};
    for (const s of n.stats || []) stats[s.id] = s;
    const cells = (n.devices || []).map((d) => {
      const s = stats[d.id];
      const bad = d.health && d.health !== 'healthy';
      const cls = ['cell', bad ? 'unhealthy' : '', s ? '' : 'nostats', n.status !== 'ready' ? 'down' : ''].join(' ').trim();
      const c = h('div', {
        class: cls, 'data-device': d.id, 'data-node': n.id,
        title: d.id + ' · ' + (d.model || d.kind) + ' · ' + (bad ? 'UNHEALTHY' : 'healthy') +
          (s ? ' · util ' + pct(s.utilization_pct) + ' · mem ' + s.memory_used_mib + '/' + d.memory_mib + ' MiB · ' +
            fmtNum(s.temperature_c) + ' °C · ' + fmtNum(s.power_w) + ' W' : ' · no stats yet') +
          ' · allocated ' + devices(d.used_milli || 0),
      }, bad ? '✕' : (s ? pct(s.utilization_pct) : '–'));
      if (s && !bad) c.style.background = heat(s.utilization_pct);
      return c;
    });
    return h('div', { class: 'heat-node' },
      h('div', { class: 'heat-label' }, h('div', { class: 'n' }, n.id, ' ', state(n.status)),
        h('div', { class: 'm' }, 'pool ' + n.pool + (n.region ? ' · ' + n.region : '') + ' · ' + (n.devices || []).length + ' devices')),
      h('div', { class: 'heat-cells' }, cells.length ? cells : h('span', { class: 'muted' }, 'no devices (CPU only)')));
  }));
  const legend = h('div', { class: 'legend' },
    h('span', {}, 'utilization 0%', h('span', { class: 'scale' }), '100%'),
    h('span', {}, h('span', { class: 'sw cell nostats' }), 'no stats yet'),
    h('span', {}, h('span', { class: 'sw cell unhealthy' }), 'unhealthy'),
    h('span', {}, 'faded: node down'));

  const recent = jobs.slice(-10).reverse().map(jobRow);
  return [
    cards,
    h('div', { class: 'panel' }, h('h2', {}, 'Device heatmap'), legend, nodes.length ? heatmap : h('div', { class: 'empty' }, 'no nodes registered')),
    h('div', { class: 'panel' }, h('h2', {}, 'Pools'), table(['Pool', '#Nodes ready', 'GPU', 'NPU', 'CPU', 'Memory'], poolRows, 'no pools')),
    h('div', { class: 'grid' },
      h('div', { class: 'panel' }, h('h2', {}, 'Servers'), table(['Id', 'Address', 'Role', '', '#Matched'], serverRows)),
      h('div', { class: 'panel' }, h('h2', {}, 'Recent jobs'), table(['Job', 'Name', 'Queue', 'State', '#Attempt', 'Submitted'], recent, 'no jobs yet'))),
  ];
}

function jobRow(j) {
  return h('tr', {}, h('td', {}, h('a', { href: '#/job/' + j.id, 'data-job': j.id }, 'job ' + j.id)),
    h('td', {}, j.name || ''), h('td', {}, j.queue), h('td', {}, state(j.state)), num(j.attempt), h('td', {}, ago(j.submitted_at)));
}

async function queues() {
  const [, qs, pending] = await Promise.all([
    cluster(),
    all('Queues/List', 'queues', 'after', 'next_after'),
    all('Jobs/List', 'jobs', 'after_id', 'next_after_id', { states: 'pending' }),
  ]);
  const oldest = {};
  for (const j of pending) {
    if (!oldest[j.queue] || j.submitted_at < oldest[j.queue]) oldest[j.queue] = j.submitted_at;
  }
  const rows = qs.map((q) => {
    const n = res(q.nominal), u = res(q.used), b = res(q.borrowed);
    return h('tr', {}, h('td', {}, h('b', {}, q.id)), h('td', {}, q.team || '–'), h('td', {}, q.parent || '–'),
      num(q.pending_jobs), num(q.running_jobs),
      h('td', {}, bar(u.gpu_milli, n.gpu_milli, b.gpu_milli, devices(u.gpu_milli) + (b.gpu_milli ? ' +' + devices(b.gpu_milli) : '') + ' / ' + devices(n.gpu_milli) + ' GPU')),
      h('td', {}, bar(u.cpu_milli, n.cpu_milli, b.cpu_milli, cores(u.cpu_milli) + (b.cpu_milli ? ' +' + cores(b.cpu_milli) : '') + ' / ' + cores(n.cpu_milli) + ' cores')),
      h('td', {}, oldest[q.id] ? dur(now() - oldest[q.id]) : '–'));
  });
  return [h('h1', {}, 'Queues'),
    h('div', { class: 'legend' }, h('span', {}, h('span', { class: 'sw fillsw' }), 'quota bars: used (blue) and borrowed from the cohort (amber) against the nominal quota; ∞: no limit')),
    h('div', { class: 'panel' }, table(['Queue', 'Team', 'Parent', '#Pending', '#Running', 'GPU quota', 'CPU quota', 'Oldest wait'], rows, 'no queues'))];
}

async function jobs() {
  const [, js] = await Promise.all([cluster(), all('Jobs/List', 'jobs', 'after_id', 'next_after_id')]);
  const rows = js.slice(-500).reverse().map((j) => h('tr', {},
    h('td', {}, h('a', { href: '#/job/' + j.id, 'data-job': j.id }, 'job ' + j.id)), h('td', {}, j.name || ''), h('td', {}, j.queue),
    h('td', {}, state(j.state)), num(j.attempt), num(j.failures), num(j.requeues), h('td', {}, ago(j.submitted_at)),
    h('td', {}, (j.allocs || []).map((a) => a.node).filter((x, i, a) => x && a.indexOf(x) === i).join(', ')),
    h('td', { class: 'muted' }, j.reason || '')));
  return [h('h1', {}, 'Jobs'), h('div', { class: 'panel' },
    table(['Job', 'Name', 'Queue', 'State', '#Attempt', '#Failures', '#Requeues', 'Submitted', 'Nodes', 'Reason'], rows, 'no jobs'))];
}

async function job(id) {
  const [, j] = await Promise.all([cluster(), api('Jobs/Get', { job_id: id })]);
  const t0 = j.submitted_at;
  const live = !['succeeded', 'failed', 'cancelled'].includes(j.state);
  const attempts = (j.attempts || []).map((a) => ({ ...a, label: 'attempt ' + a.attempt + ' · ' + (a.node || '?') }));
  for (const a of j.allocs || []) {
    if (a.started_at && !attempts.some((x) => x.alloc_id === a.id)) {
      attempts.push({ attempt: a.epoch, alloc_id: a.id, node: a.node, started_at: a.started_at, ended_at: 0, state: a.state, end: '', label: 'attempt ' + a.epoch + ' · ' + a.node + ' (now)' });
    }
  }
  const ends = attempts.map((a) => a.ended_at || 0);
  const t1 = Math.max(live ? now() : 0, j.updated_at || 0, ...ends, t0 + 1);
  const x = (t) => ((Math.max(t0, Math.min(t1, t)) - t0) / (t1 - t0)) * 100;
  const seg = (cls, a, b, title) => {
    const s = h('div', { class: 'tl-seg ' + cls, title });
    s.style.left = x(a) + '%';
    s.style.width = Math.max(0.4, x(b) - x(a)) + '%';
    return s;
  };
  const firstStart = attempts.length ? Math.min(...attempts.map((a) => a.started_at || t1)) : (live ? t1 : j.updated_at);
  const rows = [h('div', { class: 'tl-row' }, h('div', { class: 'tl-label' }, 'queued'),
    h('div', { class: 'tl-track' }, seg('wait', t0, firstStart, 'waited ' + dur(firstStart - t0))))];
  for (const a of attempts) {
    const end = a.ended_at || t1;
    const track = h('div', { class: 'tl-track' }, seg(a.state || 'running', a.started_at, end,
      a.label + ': ' + time(a.started_at) + ' → ' + (a.ended_at ? time(a.ended_at) : 'now') + (a.end ? ' (' + a.end + ')' : '')));
    rows.push(h('div', { class: 'tl-row' }, h('div', { class: 'tl-label' }, a.label), track));
  }
  let ckAt = j.latest_checkpoint_at || 0;
  if (ckAt > 1e12) ckAt = ckAt / 1000;
  if (ckAt && rows.length > 1) {
    const m = h('div', { class: 'tl-mark', title: 'checkpoint step ' + j.latest_checkpoint_step + ' at ' + time(ckAt) });
    m.style.left = x(ckAt) + '%';
    rows[rows.length - 1].lastChild.appendChild(m);
  }
  const kv = (k, v) => [h('div', { class: 'k' }, k), h('div', {}, v)];
  const info = h('div', { class: 'kv' },
    kv('State', state(j.state)), kv('Queue', j.queue), kv('Priority', String(j.priority)),
    kv('Submitted', time(j.submitted_at)), kv('Updated', time(j.updated_at)),
    kv('Attempt', j.attempt + ' (' + j.failures + ' failures, ' + j.requeues + ' requeues, ' + (j.infra_requeues || 0) + ' infrastructure)'),
    kv('Reason', j.reason || '–'),
    kv('Checkpoint', j.latest_checkpoint_uri ? 'step ' + j.latest_checkpoint_step + ' · ' + j.latest_checkpoint_uri : 'none'),
    kv('Trace', j.trace_id ? h('span', { class: 'mono', id: 'trace-id' }, j.trace_id) : 'no trace id recorded'));
  const attRows = attempts.map((a) => h('tr', {}, num(a.attempt), h('td', {}, a.node || '–'), h('td', {}, time(a.started_at)),
    h('td', {}, a.ended_at ? time(a.ended_at) : 'running'), h('td', {}, a.ended_at ? dur(a.ended_at - a.started_at) : dur(now() - a.started_at)),
    h('td', {}, state(a.state)), h('td', {}, a.end || '–'), num(a.lost_device_s ? a.lost_device_s + ' dev·s' : ''),
    h('td', {}, a.restored_step_set ? 'step ' + a.restored_step : 'start'), h('td', { class: 'muted' }, a.message || '')));
  return [h('h1', {}, 'job ' + j.id + (j.name ? ' · ' + j.name : '')),
    h('div', { class: 'panel' }, info),
    h('div', { class: 'panel' }, h('h2', {}, 'Timeline'),
      h('div', { class: 'legend' }, h('span', {}, h('span', { class: 'sw tl-seg wait' }), 'queued'),
        h('span', {}, h('span', { class: 'sw tl-seg' }), 'running'), h('span', {}, h('span', { class: 'sw tl-seg succeeded' }), 'succeeded'),
        h('span', {}, h('span', { class: 'sw tl-seg stopped' }), 'stopped / preempted'), h('span', {}, h('span', { class: 'sw tl-seg failed' }), 'failed / lost'),
        h('span', {}, '▮ checkpoint')),
      h('div', { class: 'timeline' }, rows),
      h('div', { class: 'tl-axis' }, h('span', {}, time(t0)), h('span', {}, dur(t1 - t0)), h('span', {}, live ? 'now' : time(t1)))),
    h('div', { class: 'panel' }, h('h2', {}, 'Attempts'),
      table(['#Attempt', 'Node', 'Started', 'Ended', 'Ran', 'State', 'End', '#Lost', 'Restored from', 'Message'], attRows, 'not started yet'))];
}

async function cost() {
  await cluster();
  let r;
  try {
    r = await api('Cost/Report', { by: 'team' });
  } catch (e) {
    if (e.status === 404 || e.status === 501) {
      return [h('h1', {}, 'Cost by team'), h('div', { class: 'panel empty', id: 'cost-na' }, 'Cost reporting is not available on this server.')];
    }
    throw e;
  }
  const cats = [['useful', 'Useful'], ['lost_preemption', 'Lost (preemption)'], ['lost_failure', 'Lost (failure)'],
    ['running', 'Running'], ['idle', 'Idle'], ['total', 'Total']];
  const cur = r.currency || '';
  const row = (key, a, cls) => h('tr', { class: cls }, h('td', {}, key), cats.map(([k]) => num((a || {})[k] || '0.000000')));
  const rows = (r.rows || []).map((x) => row(x.key, x.amounts));
  if (r.total) rows.push(row('total', r.total.amounts, 'total'));
  const none = 'no cost recorded: set a price catalog with `suanli cost prices set --file prices.toml`';
  return [h('h1', {}, 'Cost by team'),
    h('div', { class: 'panel' },
      h('p', { id: 'cost-summary' }, `capacity ${r.capacity || '0'} ${cur}`, ' · ',
        r.conserved ? 'categories add up to capacity x time x price' : 'categories DO NOT add up to capacity'),
      table(['Team', ...cats.map(([, t]) => '#' + t + (cur ? ` (${cur})` : ''))], (r.rows || []).length ? rows : [], none))];
}

// ---------- shell ----------

function showError(e) {
  const box = document.getElementById('auth');
  box.replaceChildren();
  box.className = 'banner error';
  if (e instanceof ApiError && (e.status === 401 || e.status === 403)) {
    box.append(h('b', {}, e.status === 401 ? 'Not signed in: ' : 'Not allowed: '), e.message,
      h('br'), 'Get a token with ', h('code', {}, 'suanli token create --name <you> --role viewer'),
      ' and open ', h('code', {}, location.origin + '/#token=<token>'),
      ' (the token stays in this tab\u2019s session storage and is sent only as an Authorization header).');
  } else {
    box.append(h('b', {}, 'Could not load: '), e instanceof ApiError ? e.code + ': ' + e.message : String(e));
  }
}

async function render() {
  if (rendering) return;
  rendering = true;
  const r = route();
  for (const a of document.querySelectorAll('#nav a')) {
    a.classList.toggle('active', r.startsWith('/' + a.dataset.route) || (a.dataset.route === 'jobs' && r.startsWith('/job/')));
  }
  try {
    let content;
    const m = r.match(/^\/job\/(\d+)$/);
    if (m) content = await job(m[1]);
    else if (r === '/queues') content = await queues();
    else if (r === '/jobs') content = await jobs();
    else if (r === '/cost') content = await cost();
    else content = await overview();
    document.getElementById('main').replaceChildren(...content);
    document.getElementById('auth').className = 'banner hidden';
    document.getElementById('updated').textContent = 'updated ' + new Date().toLocaleTimeString();
    document.body.dataset.loaded = r;
  } catch (e) {
    showError(e);
  } finally {
    rendering = false;
  }
}

window.addEventListener('hashchange', render);
document.addEventListener('DOMContentLoaded', () => {
  render();
  refreshTimer = setInterval(render, REFRESH_MS);
});

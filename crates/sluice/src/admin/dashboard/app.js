// sluice dashboard: reads /api/v1/history once, then /api/v1/events (server-sent events, one
// overview per second) through fetch streaming, so the bearer token (when the admin endpoint
// has one) travels in the Authorization header — EventSource cannot set headers. No library,
// no request to any other origin; every string from the gateway goes through textContent.
'use strict';
(function () {
  const TOKEN_KEY = 'sluice-admin-token';
  const MAX_POINTS = 300;       // what /api/v1/history keeps: 5 minutes at 1 s
  const STALE_MS = 5000;        // no event for this long: reconnect
  const SVG = 'http://www.w3.org/2000/svg';
  const $ = (id) => document.getElementById(id);

  let token = sessionStorage.getItem(TOKEN_KEY) || '';
  const hist = { times: [], series: {} };
  let lastSeq = 0;

  class Unauthorized extends Error {}

  function authHeaders() {
    return token ? { Authorization: 'Bearer ' + token } : {};
  }

  async function getJSON(path) {
    const r = await fetch(path, { headers: authHeaders(), cache: 'no-store' });
    if (r.status === 401) throw new Unauthorized();
    if (!r.ok) throw new Error(path + ': HTTP ' + r.status);
    return r.json();
  }

  // ----- formatting -----
  function int(x) {
    return x == null ? '–' : Math.round(x).toLocaleString('en-US');
  }
  function rate(x) {
    if (x == null) return '–';
    if (x >= 100 || x === 0) return Math.round(x).toLocaleString('en-US');
    return x.toFixed(1);
  }
  function bytes(x) {
    if (x == null) return '–';
    const units = ['B', 'KiB', 'MiB', 'GiB', 'TiB'];
    let i = 0;
    while (x >= 1024 && i < units.length - 1) { x /= 1024; i++; }
    return (i === 0 ? Math.round(x) : x.toFixed(1)) + ' ' + units[i];
  }
  function secs(x) {
    if (x == null) return '–';
    if (x < 1) return Math.round(x * 1000) + ' ms';
    if (x < 120) return x.toFixed(1) + ' s';
    if (x < 7200) return Math.round(x / 60) + ' min';
    return (x / 3600).toFixed(1) + ' h';
  }
  function ms(x) {
    if (x == null) return '–';
    return x < 10 ? x.toFixed(2) + ' ms' : Math.round(x) + ' ms';
  }
  function since(s) {
    if (s == null) return '';
    const d = Math.floor(s / 86400), h = Math.floor(s / 3600) % 24, m = Math.floor(s / 60) % 60;
    return 'up ' + (d ? d + 'd ' : '') + (d || h ? h + 'h ' : '') + m + 'm ' + (s % 60) + 's';
  }
  function stateClass(s) {
    if (s === 'connected' || s === 'up' || s === 'running' || s === 'operating') return 'ok';
    if (s === 'disconnected' || s === 'down' || s === 'dead') return 'bad';
    return 'warn';
  }

  // ----- tables (DOM only: gateway strings never become markup) -----
  function table(id, head, rows, empty) {
    const t = $(id);
    const thead = document.createElement('thead');
    const hr = document.createElement('tr');
    for (const h of head) {
      const th = document.createElement('th');
      th.textContent = h;
      hr.appendChild(th);
    }
    thead.appendChild(hr);
    const tbody = document.createElement('tbody');
    if (rows.length === 0) {
      const tr = document.createElement('tr');
      const td = document.createElement('td');
      td.colSpan = head.length;
      td.className = 'empty';
      td.textContent = empty || 'none';
      tr.appendChild(td);
      tbody.appendChild(tr);
    }
    for (const row of rows) {
      const tr = document.createElement('tr');
      for (const cell of row) {
        const td = document.createElement('td');
        if (cell !== null && typeof cell === 'object') {
          td.textContent = cell.text;
          if (cell.cls) td.className = cell.cls;
          if (cell.k) td.dataset.k = cell.k;
        } else {
          td.textContent = cell == null ? '–' : String(cell);
        }
        tr.appendChild(td);
      }
      tbody.appendChild(tr);
    }
    t.replaceChildren(thead, tbody);
  }

  // ----- charts: hand-drawn SVG polylines over the last MAX_POINTS ticks -----
  function chart(id, series, fmt) {
    const svg = $(id);
    let max = 0;
    for (const s of series) for (const v of s) if (v > max) max = v;
    const top = max > 0 ? max * 1.1 : 1;
    const nodes = [];
    series.forEach((s, k) => {
      if (s.length === 0) return;
      const off = MAX_POINTS - s.length;
      const pts = [];
      for (let i = 0; i < s.length; i++) {
        const x = ((off + i) * 300) / (MAX_POINTS - 1);
        const y = 62 - (Math.max(0, s[i]) / top) * 60;
        pts.push(x.toFixed(1) + ',' + y.toFixed(1));
      }
      const pl = document.createElementNS(SVG, 'polyline');
      pl.setAttribute('points', pts.join(' '));
      pl.setAttribute('class', 's' + k);
      nodes.push(pl);
    });
    svg.replaceChildren(...nodes);
    const axis = $('a' + id.slice(1));
    const now = series.map((s) => (s.length ? fmt(s[s.length - 1]) : '–')).join(' / ');
    const left = document.createElement('span');
    left.textContent = '−' + Math.round((MAX_POINTS - 1) / 60) + ' min · max ' + fmt(max);
    const right = document.createElement('span');
    right.textContent = 'now ' + now;
    axis.replaceChildren(left, right);
  }

  function pushHistory(doc) {
    const s = doc.series || {};
    hist.times.push(doc.time_ms || 0);
    if (hist.times.length > MAX_POINTS) hist.times.shift();
    const n = hist.times.length;
    for (const name of Object.keys(s)) {
      if (!hist.series[name]) hist.series[name] = new Array(n - 1).fill(0);
    }
    for (const [name, arr] of Object.entries(hist.series)) {
      arr.push(typeof s[name] === 'number' ? s[name] : 0);
      while (arr.length > n) arr.shift();
    }
  }

  function seedHistory(h) {
    hist.times = (h.times_ms || []).slice(-MAX_POINTS);
    hist.series = {};
    for (const [name, arr] of Object.entries(h.series || {})) {
      hist.series[name] = arr.slice(-MAX_POINTS);
    }
  }

  function drawCharts() {
    const s = (name) => hist.series[name] || [];
    chart('c-dev', [s('device_in_msgs'), s('device_out_msgs')], rate);
    chart('c-cloud', [s('cloud_out_msgs'), s('cloud_acked_msgs')], rate);
    chart('c-bytes', [s('device_in_bytes'), s('cloud_out_bytes')], (x) => bytes(x) + '/s');
    chart('c-queue', [s('queued'), s('inflight'), s('spool_unacked')], int);
    chart('c-lat', [s('ack_p99_ms')], ms);
    chart('c-drops', [s('drops'), s('devices')], rate);
  }

  // ----- one overview -----
  function render(doc) {
    document.body.dataset.seq = String(doc.seq || 0);
    $('version').textContent = doc.version ? 'v' + doc.version : '';
    $('uptime').textContent = since(doc.uptime_seconds);
    const d = doc.devices || {};
    const t = doc.traffic || {};
    const total = (d.mqtt || 0) + (d.coap || 0) + (d.coap_dtls || 0) + (d.phd || 0);
    $('k-devices').textContent = int(total);
    $('k-in').textContent = rate((t.device_in || {}).messages_per_second);
    $('k-out').textContent = rate((t.device_out || {}).messages_per_second);
    $('k-cloud').textContent = rate((t.cloud_out || {}).messages_per_second);
    const series = doc.series || {};
    $('k-inflight').textContent = int(series.inflight);
    $('k-queued').textContent = int(series.queued);
    $('k-p99').textContent = series.ack_p99_ms ? ms(series.ack_p99_ms) : '–';
    $('k-drops').textContent = rate((doc.drops || {}).per_second);

    const shards = doc.shards || [];
    const sum = (k) => shards.reduce((a, r) => a + (r[k] || 0), 0);
    const shardRows = shards.map((r) => [
      String(r.shard), { text: int(r.mqtt), k: 'shard-mqtt' }, int(r.sessions), int(r.coap), int(r.coap_dtls), int(r.phd),
    ]);
    if (shards.length > 1) {
      shardRows.push(['all', { text: int(sum('mqtt')), k: 'all-mqtt' }, int(sum('sessions')), int(sum('coap')), int(sum('coap_dtls')), int(sum('phd'))]);
    }
    table('t-shards', ['shard', 'MQTT', 'sessions', 'CoAP', 'CoAP DTLS', 'PHD'], shardRows);

    const flow = (name, f, k) => [
      name,
      { text: rate(f && f.messages_per_second), k: k + '-rate' },
      f && f.bytes_per_second != null ? bytes(f.bytes_per_second) + '/s' : '–',
      { text: int(f && f.messages_total), k: k + '-total' },
      f && f.bytes_total != null ? bytes(f.bytes_total) : '–',
    ];
    const byp = t.device_in_by_protocol || {};
    table('t-traffic', ['direction', 'msg/s', 'bytes/s', 'messages', 'bytes'], [
      flow('devices → sluice', t.device_in, 'in'),
      ['  MQTT · CoAP · PHD', rate(byp.mqtt_per_second) + ' · ' + rate(byp.coap_per_second) + ' · ' + rate(byp.phd_per_second), '', '', ''],
      flow('sluice → devices', t.device_out, 'out'),
      flow('sluice → cloud', t.cloud_out, 'cloud'),
      flow('cloud acks', t.cloud_acked, 'acked'),
      flow('cloud → sluice', t.cloud_in, 'downlink'),
    ]);

    const upRows = [];
    const pathRows = [];
    for (const u of doc.uplinks || []) {
      for (const l of u.lanes || []) {
        const lat = l.ack_latency || {};
        upRows.push([
          u.name + (u.lanes.length > 1 ? ' · ' + l.lane : ''),
          { text: l.state + ' ' + l.connected_shards + '/' + l.shards, cls: stateClass(l.state) },
          { text: '#' + u.id + ' ' + u.lifecycle + (u.removed_unsent ? ' (' + int(u.removed_unsent) + ' unsent)' : ''), cls: u.lifecycle === 'running' ? 'ok' : u.lifecycle === 'removed' ? '' : 'warn' },
          rate(l.sent_per_second), rate(l.acked_per_second), bytes(l.bytes_per_second) + '/s',
          { text: int(l.inflight), k: 'uplink-inflight' }, int(l.queued), bytes(l.queue_bytes),
          secs(l.queue_oldest_age_seconds), ms(lat.p50_ms), ms(lat.p99_ms),
        ]);
        for (const p of l.paths || []) {
          pathRows.push([
            u.name + ' · ' + p.name,
            { text: p.up_shards + '/' + p.shards + ' up', cls: p.up_shards === p.shards ? 'ok' : p.up_shards ? 'warn' : 'bad' },
            ms(p.srtt_ms), int(p.inflight), rate(p.sent_per_second), rate(p.acked_per_second),
          ]);
        }
      }
    }
    table('t-uplinks', ['uplink', 'state', 'lifecycle', 'sent/s', 'acked/s', 'bytes/s', 'inflight', 'queued', 'queue bytes', 'oldest', 'ack p50', 'ack p99'], upRows, 'no [[uplink]] configured');
    table('t-paths', ['path', 'state', 'srtt', 'inflight', 'sent/s', 'acked/s'], pathRows, 'no multipath uplink');

    table('t-lanes', ['lane', 'inflight', 'queued', 'sent/s'], (doc.lanes || []).map((l) => [l.lane, int(l.inflight), int(l.queued), rate(l.sent_per_second)]), 'no uplink');

    const sp = doc.spool;
    const spoolRows = [['uplink queues', int(series.queued) + ' msgs', '']];
    const oldestQueued = Math.max(-1, ...(doc.uplinks || []).flatMap((u) => (u.lanes || []).map((l) => l.queue_oldest_age_seconds ?? -1)));
    spoolRows[0][2] = oldestQueued >= 0 ? secs(oldestQueued) : '–';
    if (sp) {
      spoolRows.push(['spool unacked', { text: int(sp.unacked_records) + ' records', k: 'spool-unacked' }, sp.oldest_age_seconds == null ? '–' : (sp.oldest_age_basis === 'at_least' ? '≥ ' : '') + secs(sp.oldest_age_seconds)]);
      spoolRows.push(['spool backlog', int(sp.backlog_records) + ' records', '']);
      spoolRows.push(['spool size', bytes(sp.bytes), '']);
      spoolRows.push(['spool in / out', rate(sp.appended_per_second) + ' / ' + rate(sp.acked_per_second) + ' rec/s', '']);
    } else {
      spoolRows.push(['spool', 'not configured', '']);
    }
    table('t-spool', ['', 'depth', 'oldest'], spoolRows);

    table('t-drops', ['where', 'reason', 'total', 'per s'], ((doc.drops || {}).by_reason || []).map((r) => [r.where, r.reason, int(r.total), rate(r.per_second)]), 'no drops');

    const phd = doc.phd;
    if (phd) {
      const rows = (phd.list || []).map((a) => [a.system_id, a.specialization, { text: a.state, cls: stateClass(a.state) }, a.model || '', a.shard == null ? '–' : String(a.shard), secs(a.for_seconds)]);
      rows.push(['all: ' + int(phd.agents) + ' agents, ' + int(phd.configs) + ' configs', '', '', rate(phd.observations_per_second) + ' obs/s', '', '']);
      table('t-phd', ['system id', 'kind', 'state', 'model', 'shard', 'for'], rows);
    } else {
      table('t-phd', ['system id'], [], 'PHD edge not enabled ([phd] listen)');
    }

    const fnRows = [];
    for (const f of doc.functions || []) {
      const inst = (f.instances || []).map((i) => i.state).filter(Boolean);
      const counts = {};
      for (const s of inst) counts[s] = (counts[s] || 0) + 1;
      const desc = Object.entries(counts).map(([s, n]) => n + ' ' + s).join(', ') || '0';
      fnRows.push([f.name, f.kind, rate(f.events_per_second), int(f.inflight), int(f.queued), desc, int(f.cold_starts), { text: int(f.dead_letters), cls: f.dead_letters ? 'bad' : '' }]);
    }
    table('t-functions', ['function', 'kind', 'events/s', 'inflight', 'queued', 'instances', 'cold starts', 'dead letters'], fnRows, 'no [[function]] configured');

    table('t-proxy', ['upstream', 'shard', 'state'], (doc.coap_proxy || []).map((p) => [p.upstream, String(p.shard), { text: p.state, cls: stateClass(p.state) }]), 'no [[coap.proxy]] configured');
  }

  function onOverview(doc) {
    if (!doc || typeof doc.seq !== 'number' || doc.seq === lastSeq) return;
    // The first frame of a stream is usually the history's last point already.
    const lastTime = hist.times.length ? hist.times[hist.times.length - 1] : -1;
    if (!(doc.time_ms <= lastTime)) pushHistory(doc);
    lastSeq = doc.seq;
    render(doc);
    if (!document.hidden) drawCharts();
  }

  // ----- the live stream -----
  function setLive(on, text) {
    const el = $('live');
    el.textContent = text;
    el.className = 'pill ' + (on ? 'on' : 'off');
  }

  function handleEvent(block) {
    let data = '';
    for (const line of block.split('\n')) {
      if (line.startsWith('data:')) data += line.slice(line.startsWith('data: ') ? 6 : 5);
    }
    if (data) onOverview(JSON.parse(data));
  }

  async function stream() {
    const ctrl = new AbortController();
    let last = Date.now();
    const watchdog = setInterval(() => {
      if (Date.now() - last > STALE_MS) ctrl.abort();
    }, 1000);
    try {
      const r = await fetch('api/v1/events', { headers: authHeaders(), cache: 'no-store', signal: ctrl.signal });
      if (r.status === 401) throw new Unauthorized();
      if (!r.ok || !r.body) throw new Error('events: HTTP ' + r.status);
      setLive(true, 'live');
      const reader = r.body.getReader();
      const decoder = new TextDecoder();
      let buf = '';
      for (;;) {
        const { value, done } = await reader.read();
        if (done) return;
        last = Date.now();
        buf += decoder.decode(value, { stream: true });
        let i;
        while ((i = buf.indexOf('\n\n')) >= 0) {
          handleEvent(buf.slice(0, i));
          buf = buf.slice(i + 2);
        }
      }
    } finally {
      clearInterval(watchdog);
    }
  }

  function sleep(t) {
    return new Promise((resolve) => setTimeout(resolve, t));
  }

  let running = false;
  async function run() {
    if (running) return;
    running = true;
    let delay = 1000;
    for (;;) {
      try {
        if (hist.times.length === 0) seedHistory(await getJSON('api/v1/history'));
        await stream();
        delay = 1000;
        setLive(false, 'reconnecting…');
      } catch (e) {
        if (e instanceof Unauthorized) {
          running = false;
          askToken(token ? 'that token was refused' : '');
          return;
        }
        setLive(false, 'offline, retrying…');
      }
      await sleep(delay);
      delay = Math.min(delay * 2, 10000);
    }
  }

  // ----- the token -----
  function askToken(error) {
    setLive(false, 'token needed');
    $('token-form').hidden = false;
    $('token-error').textContent = error || '';
    $('token-input').focus();
  }

  $('token-form').addEventListener('submit', (ev) => {
    ev.preventDefault();
    token = $('token-input').value.trim();
    sessionStorage.setItem(TOKEN_KEY, token);
    $('token-input').value = '';
    $('token-form').hidden = true;
    $('token-button').hidden = false;
    run();
  });
  $('token-button').addEventListener('click', () => {
    $('token-form').hidden = !$('token-form').hidden;
  });
  if (token) $('token-button').hidden = false;
  document.addEventListener('visibilitychange', () => {
    if (!document.hidden) drawCharts();
  });

  run();
})();

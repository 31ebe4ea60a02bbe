// apsup console: refreshes the page from `status` (relative URL, same listener) without a
// reload. Every value goes through textContent: nothing from the host is parsed as HTML.
"use strict";
(function () {
  const main = document.getElementById("console");
  if (!main) return;
  const every = 1000 * (Number(main.dataset.refresh) || 3);
  const MINUTES = 60;

  function el(tag, cls, text) {
    const node = document.createElement(tag);
    if (cls) node.className = cls;
    if (text !== undefined) node.textContent = text === null ? "-" : String(text);
    return node;
  }
  function svg(tag, attrs) {
    const node = document.createElementNS("http://www.w3.org/2000/svg", tag);
    for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, String(v));
    return node;
  }
  function table(headers, rows, empty) {
    if (!rows.length) return el("p", "empty", empty);
    const t = el("table");
    const head = t.appendChild(el("thead")).appendChild(el("tr"));
    headers.forEach((h) => head.appendChild(el("th", null, h)));
    const body = t.appendChild(el("tbody"));
    rows.forEach((r) => {
      const tr = body.appendChild(el("tr"));
      r.forEach((c) => tr.appendChild(el("td", null, c === undefined ? null : c)));
    });
    return t;
  }
  function chart(history, nowMinute) {
    const by = new Map(history.map(([m, ok, f]) => [m, [ok, f]]));
    const height = 60;
    let top = 1;
    by.forEach(([ok, f]) => { top = Math.max(top, ok + f); });
    const box = svg("svg", {
      class: "chart", viewBox: `0 0 ${MINUTES * 6} ${height}`, width: MINUTES * 6, height,
      role: "img", "aria-label": "invocations per minute, last hour",
    });
    let okTotal = 0, failedTotal = 0;
    for (let i = 0; i < MINUTES; i++) {
      const [ok, failed] = by.get(nowMinute - (MINUTES - 1 - i)) || [0, 0];
      const hOk = Math.round((height * ok) / top), hFailed = Math.round((height * failed) / top);
      if (hOk) box.appendChild(svg("rect", { class: "ok", x: i * 6, y: height - hOk, width: 5, height: hOk }));
      if (hFailed) {
        box.appendChild(svg("rect", {
          class: "failed", x: i * 6, y: height - hOk - hFailed, width: 5, height: hFailed,
        }));
      }
    }
    by.forEach(([ok, f]) => { okTotal += ok; failedTotal += f; });
    const legend = el("p", "legend");
    legend.appendChild(el("span", "ok", `${okTotal} succeeded`));
    legend.appendChild(document.createTextNode(" · "));
    legend.appendChild(el("span", "failed", `${failedTotal} failed`));
    legend.appendChild(document.createTextNode(" in the last hour (per minute)"));
    return [box, legend];
  }
  function facts(parts) {
    const p = el("p", "facts");
    parts.forEach((x) => p.appendChild(typeof x === "string" ? document.createTextNode(x) : x));
    return p;
  }
  function family(name, fam, sup, nowMinute) {
    const s = el("section", "family");
    s.dataset.family = name;
    const h = s.appendChild(el("h2", null, name));
    h.appendChild(document.createTextNode(" "));
    const status = fam.status || "ok";
    h.appendChild(el("span", `badge ${status}`, status + (fam.paused ? " · paused" : "")));
    const leader = sup.leader ? "this replica" : `holder ${sup.holder || "-"}`;
    s.appendChild(facts([
      `policy ${fam.policy ?? "-"} · next check ${fam.due_at ?? "-"} · leader: ${leader} ` +
      `(key ${sup.key ?? "-"}, term ${sup.generation ?? "-"})`,
    ]));
    s.appendChild(facts([
      `running ${fam.running ?? "-"} / ${fam.budget ?? "-"} · ready ${fam.ready ?? "-"} · ` +
      `waiting to retry ${fam.retry_wait ?? "-"} · unacknowledged ${fam.unacknowledged ?? "-"}` +
      (fam.reason ? ` · reason: ${fam.reason}` : ""),
    ]));
    s.appendChild(el("h3", null, "Running"));
    s.appendChild(table(["scope", "age"],
      (fam.running_scopes || []).map((r) => [r.scope, `${Number(r.age || 0).toFixed(1)} s`]),
      "nothing running"));
    s.appendChild(el("h3", null, `Failing (${fam.failing_count || 0})`));
    s.appendChild(table(["scope", "failures", "error type", "error", "next attempt", "parked"],
      (fam.failing || []).map((f) => [f.scope, f.consecutive_failures, f.error_type, f.error,
        f.next_attempt_at, f.parked ? "yes" : ""]),
      "no failing Scope"));
    chart(fam.history || [], nowMinute).forEach((n) => s.appendChild(n));
    return s;
  }
  function render(snap) {
    const nodes = [];
    const ready = snap.readiness || {};
    const p = facts([`role ${snap.role ?? "-"} · mode ${snap.mode ?? "-"} · readiness `]);
    if (ready.status) {
      p.appendChild(el("span", `badge ${ready.status}`, ready.status));
      if (ready.reason) p.appendChild(document.createTextNode(` · ${ready.reason}`));
    }
    nodes.push(p);
    if (snap.replicas) {
      nodes.push(el("h2", null, "Replicas"));
      nodes.push(table(["replica", "host", "pid", "role", "leads", "last seen"],
        snap.replicas.map((r) => [String(r.replica_id || "").slice(0, 8), r.host, r.pid, r.role,
          (r.leads || []).join(", ") || "standby", r.last_seen]), "none"));
    }
    const nowMinute = Math.floor(Date.now() / 60000);
    for (const sup of snap.supervisors || []) {
      for (const name of Object.keys(sup.families || {}).sort()) {
        nodes.push(family(name, sup.families[name], sup, nowMinute));
      }
    }
    main.replaceChildren(...nodes);
  }
  async function refresh() {
    const stamp = document.getElementById("updated");
    try {
      const [status, ready] = await Promise.all([
        fetch("status", { cache: "no-store" }).then((r) => r.json()),
        fetch("readyz", { cache: "no-store" }).then((r) => r.json()),
      ]);
      status.readiness = ready;
      render(status);
      if (stamp) stamp.textContent = `updated ${new Date().toLocaleTimeString()}`;
    } catch (err) {
      if (stamp) stamp.textContent = "host unreachable; retrying";
    }
  }
  setInterval(refresh, every);
})();

// apsup console: swaps in the server-rendered `console-main` (same listener, relative URL)
// every few seconds while the tab is visible, and at once when it becomes visible again. The
// server escapes every value it renders; nothing else is parsed as HTML.
"use strict";
(function () {
  const main = document.getElementById("console");
  if (!main) return;
  const every = 1000 * (Number(main.dataset.refresh) || 3);
  const stamp = document.getElementById("updated");
  let busy = false;

  async function refresh() {
    if (busy || document.visibilityState !== "visible") return;
    busy = true;
    try {
      const resp = await fetch(main.dataset.source || "console-main", { cache: "no-store" });
      if (!resp.ok) throw new Error(`HTTP ${resp.status}`);
      main.innerHTML = await resp.text();
      if (stamp) stamp.textContent = `updated ${new Date().toLocaleTimeString()}`;
    } catch (err) {
      if (stamp) stamp.textContent = "replica unreachable; retrying";
    } finally {
      busy = false;
    }
  }
  setInterval(refresh, every);
  document.addEventListener("visibilitychange", refresh);
})();

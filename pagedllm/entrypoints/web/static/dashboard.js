// The dashboard: polls GET /v1/dashboard once a second and redraws the plots and the table.
"use strict";

(() => {
  const $ = (id) => document.getElementById(id);
  const COLORS = ["#2f6fde", "#e8832a", "#9b59b6", "#2aa876", "#d64545"];
  let waitingForKey = false;
  let busy = false;

  const pct = (values) => values.map((v) => (v === null ? null : 100 * v));
  const ms = (v) => (v === null || v === undefined ? "–" : v.toFixed(0));

  function plots(d) {
    const s = d.series;
    const lines = (pairs) => pairs.map(([name, values], i) => ({ name, values,
                                                                  color: COLORS[i] }));
    const common = { t: d.t, window: d.window_s };
    PagedPlot.draw($("plot-requests"), Object.assign({ series: lines([
      ["running", s.running], ["waiting", s.waiting], ["swapped", s.swapped]]) }, common));
    PagedPlot.draw($("plot-kv"), Object.assign({ yMax: 100, series: lines([
      ["device", pct(s.kv_device)], ["host", pct(s.kv_host)]]) }, common));
    PagedPlot.draw($("plot-prefix"), Object.assign({ yMax: 100, series: lines([
      ["hit rate", pct(s.prefix_hit_rate)]]) }, common));
    PagedPlot.draw($("plot-tps"), Object.assign({ series: lines([
      ["prompt", s.prompt_tps], ["generation", s.gen_tps]]) }, common));
    PagedPlot.draw($("plot-ttft"), Object.assign({ series: lines([
      ["p50", s.ttft_p50], ["p90", s.ttft_p90]]) }, common));
    PagedPlot.draw($("plot-itl"), Object.assign({ series: lines([
      ["p50", s.itl_p50], ["p90", s.itl_p90]]) }, common));
    if (d.kv_tiers) {
      $("card-tiers").hidden = false;
      PagedPlot.draw($("plot-tiers"), Object.assign({ series: lines([
        ["host", s.tier_host_bps], ["disk", s.tier_disk_bps]]) }, common));
    }
  }

  // The lower KV tiers' tile: hits per tier, disk use, mean disk read / write latency.
  function tierTile(k) {
    $("tile-tiers-box").hidden = false;
    const gib = (b) => (b / 2 ** 30).toFixed(2);
    const ms1 = (v) => (v === null || v === undefined ? "–" : v.toFixed(1));
    $("tile-tiers").textContent = k.host_hits + " / " + k.disk_hits + " · " +
      gib(k.disk_bytes) + " of " + gib(k.disk_capacity_bytes) + " · " + ms1(k.load_ms) +
      " / " + ms1(k.store_ms);
  }

  function tiles(d) {
    const s = d.series;
    const n = d.t.length - 1;
    $("tile-queues").textContent = [s.running[n], s.waiting[n], s.swapped[n]].join(" / ");
    $("tile-kv").textContent = (100 * s.kv_device[n]).toFixed(1) + "% / " +
      (100 * s.kv_host[n]).toFixed(1) + "%";
    $("tile-gen").textContent = s.gen_tps[n].toFixed(1);
    for (const [id, key] of [["tile-ttft", "ttft_ms"], ["tile-itl", "itl_ms"]]) {
      const l = d.latency[key];
      $(id).textContent = [l.p50, l.p90, l.p99].map(ms).join(" / ");
    }
    $("tile-pooling").textContent = d.totals.pooling_requests_embed + " / " +
      d.totals.pooling_requests_classify;
    if (d.kv_tiers) tierTile(d.kv_tiers);
    $("updated").textContent = "updated " + new Date(d.time * 1000).toLocaleTimeString();
  }

  function table(d) {
    const body = $("requests");
    body.textContent = "";
    for (const r of d.requests) {
      const tr = document.createElement("tr");
      tr.className = r.state;
      tr.dataset.id = r.id;
      const cells = [r.id, null, r.tokens + (r.max_tokens ? " / " + r.max_tokens : ""),
                     r.prompt_tokens, r.age_s.toFixed(1) + " s"];
      cells.forEach((text, i) => {
        const td = document.createElement("td");
        if (i === 1) {
          const tag = document.createElement("span");
          tag.className = "state " + r.state;
          tag.textContent = r.state + (r.finish_reason ? " (" + r.finish_reason + ")" : "");
          td.appendChild(tag);
        } else {
          td.textContent = text;
          if (i > 1) td.className = "num";
        }
        tr.appendChild(td);
      });
      const td = document.createElement("td");
      if (r.state !== "finished") {
        const btn = document.createElement("button");
        btn.type = "button";
        btn.className = "abort";
        btn.textContent = "abort";
        btn.onclick = () => abort(r.id, btn);
        td.appendChild(btn);
      }
      tr.appendChild(td);
      body.appendChild(tr);
    }
  }

  // Data-parallel replicas: the router's policy and one row per replica.
  function replicas(d) {
    const r = d.replicas;
    if (!r) return;
    $("replicas-box").hidden = false;
    const rate = (v) => (v === null || v === undefined ? "–" : (100 * v).toFixed(1) + "%");
    $("router-policy").textContent = "(router: " + r.policy + ", predicted prefix matches " +
      rate(r.matched_rate) + ")";
    const body = $("replicas");
    body.textContent = "";
    for (const row of r.rows) {
      const tr = document.createElement("tr");
      const cells = [row.replica, row.state, row.routed, row.in_flight, row.load_tokens,
                     row.running + " / " + row.waiting, rate(row.kv_usage),
                     rate(row.prefix_hit_rate), row.restarts];
      cells.forEach((text, i) => {
        const td = document.createElement("td");
        td.textContent = text;
        if (i > 1) td.className = "num";
        tr.appendChild(td);
      });
      body.appendChild(tr);
    }
  }

  async function abort(id, btn) {
    btn.disabled = true;
    try {
      await PagedAPI.postJSON("/v1/dashboard/requests/" + encodeURIComponent(id) + "/abort");
    } catch (e) {
      $("updated").textContent = "abort failed: " + e.message;
    }
  }

  async function refresh() {
    if (busy || waitingForKey) return;
    busy = true;
    try {
      const d = await PagedAPI.getJSON("/v1/dashboard");
      plots(d);
      tiles(d);
      replicas(d);
      table(d);
    } catch (e) {
      if (e.status === 401) {
        waitingForKey = true;
        PagedAPI.askKey(e.message).then(() => { waitingForKey = false; });
      } else {
        $("updated").textContent = "error: " + e.message;
      }
    } finally {
      busy = false;
    }
  }

  $("change-key").addEventListener("click", (ev) => {
    ev.preventDefault();
    waitingForKey = true;
    PagedAPI.askKey("Enter the API key for this server (empty for none).")
      .then(() => { waitingForKey = false; });
  });
  refresh();
  setInterval(refresh, 1000);
})();

// Line charts on a <canvas>: time on x (seconds before now), one line per series, gaps where a
// value is null. The canvas also records what it drew (data-points, data-last) for tests.
"use strict";

const PagedPlot = (() => {
  const PAD = { left: 46, right: 10, top: 22, bottom: 22 };

  function niceMax(value) {
    if (!(value > 0)) return 1;
    const step = Math.pow(10, Math.floor(Math.log10(value)));
    for (const m of [1, 2, 2.5, 5, 10]) if (m * step >= value) return m * step;
    return 10 * step;
  }

  function format(v) {
    if (Math.abs(v) >= 1000) return (v / 1000).toFixed(v >= 10000 ? 0 : 1) + "k";
    return Number.isInteger(v) ? String(v) : v.toFixed(1);
  }

  // opts: {t: [seconds <= 0], series: [{name, color, values}], window: s, yMax?: number}
  function draw(canvas, opts) {
    const ratio = window.devicePixelRatio || 1;
    const w = canvas.clientWidth || 400;
    const h = canvas.clientHeight || 190;
    if (canvas.width !== Math.round(w * ratio)) canvas.width = Math.round(w * ratio);
    if (canvas.height !== Math.round(h * ratio)) canvas.height = Math.round(h * ratio);
    const ctx = canvas.getContext("2d");
    ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
    ctx.clearRect(0, 0, w, h);
    const t = opts.t;
    const span = opts.window || 300;
    let top = 0;
    for (const s of opts.series) for (const v of s.values) if (v !== null && v > top) top = v;
    const yMax = opts.yMax !== undefined ? Math.max(opts.yMax, top) : niceMax(top * 1.1);
    const x = (sec) => PAD.left + (w - PAD.left - PAD.right) * (1 + sec / span);
    const y = (v) => h - PAD.bottom - (h - PAD.top - PAD.bottom) * (v / yMax);
    // grid and axes
    ctx.font = "11px system-ui, sans-serif";
    ctx.strokeStyle = "#e3e6eb";
    ctx.fillStyle = "#6b7585";
    ctx.lineWidth = 1;
    for (let i = 0; i <= 4; i++) {
      const v = (yMax * i) / 4;
      ctx.beginPath();
      ctx.moveTo(PAD.left, y(v));
      ctx.lineTo(w - PAD.right, y(v));
      ctx.stroke();
      ctx.textAlign = "right";
      ctx.fillText(format(v), PAD.left - 6, y(v) + 4);
    }
    ctx.textAlign = "center";
    for (let sec = -span; sec <= 0; sec += span / 5) {
      ctx.fillText(sec === 0 ? "now" : Math.round(sec) + "s", x(sec), h - 6);
    }
    // lines
    const last = {};
    let points = 0;
    for (const s of opts.series) {
      ctx.strokeStyle = s.color;
      ctx.lineWidth = 2;
      ctx.beginPath();
      let pen = false;
      for (let i = 0; i < t.length; i++) {
        const v = s.values[i];
        if (v === null || v === undefined || t[i] < -span) {
          pen = false;
          continue;
        }
        points += 1;
        if (pen) ctx.lineTo(x(t[i]), y(v));
        else ctx.moveTo(x(t[i]), y(v));
        pen = true;
        last[s.name] = v;
      }
      ctx.stroke();
    }
    // legend
    let lx = PAD.left;
    ctx.textAlign = "left";
    for (const s of opts.series) {
      ctx.fillStyle = s.color;
      ctx.fillRect(lx, 6, 10, 10);
      ctx.fillStyle = "#1d2430";
      const label = s.name + (last[s.name] !== undefined ? " " + format(last[s.name]) : "");
      ctx.fillText(label, lx + 14, 15);
      lx += ctx.measureText(label).width + 30;
    }
    canvas.dataset.points = String(points);
    canvas.dataset.last = JSON.stringify(last);
  }

  return { draw };
})();

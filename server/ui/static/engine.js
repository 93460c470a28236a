// The live engine view: /metrics.json (the JSON twin of /metrics) once a second, shown as numbers and as a chart
// of generated tokens per second over the last five minutes (or since the page opened, at least one minute).
//
// The server sends cumulative counters and its own clock; the rate is the counter's growth between two samples
// divided by the server time between them, so a slow poll or a busy tab never distorts it.
"use strict";

const FerryEngine = (() => {
  const POLL_MS = 1000;
  const WINDOW_SECONDS = 300;
  const MIN_SPAN_SECONDS = 60;
  const $ = (id) => document.getElementById(id);

  let last = null; // the previous sample: {time, generated}
  let first = null; // server time of the first sample (since the page opened or the server restarted)
  let rates = []; // {from, time, value}: tokens/s between two consecutive samples, oldest first

  function percent(fraction) {
    return `${(100 * fraction).toFixed(fraction > 0 && fraction < 0.1 ? 1 : 0)}%`;
  }

  function count(n) {
    return Math.round(n).toLocaleString("en-US");
  }

  function show(stats) {
    $("stat-running").textContent = count(stats.num_requests_running);
    $("stat-waiting").textContent = count(stats.num_requests_waiting);
    $("stat-kv").textContent = percent(stats.kv_cache_usage_perc);
    $("kv-meter").value = stats.kv_cache_usage_perc;
    const rate = stats.prefix_cache_hit_rate;
    $("stat-prefix").textContent = rate === null ? "–" : percent(rate);
    $("stat-prefix").title =
      `${count(stats.prefix_cache_hits_total)} of ${count(stats.prefix_cache_queries_total)} ` +
      "prompt tokens looked up since start";
    const accepted = stats.spec_decode_acceptance_rate;
    $("stat-drafts").textContent = accepted === null ? "–" : percent(accepted);
    $("stat-drafts").title =
      `${count(stats.spec_decode_num_accepted_tokens_total)} of ${count(stats.spec_decode_num_draft_tokens_total)} ` +
      "drafted tokens accepted since start (--speculative-config)";
    // Images: how many prompts held, how many the encoder cache served, and how full it is.
    $("stat-images").textContent = stats.images_processed_total
      ? `${count(stats.images_processed_total)} (${count(stats.encoder_cache_hits_total)} cached)`
      : "–";
    $("stat-images").dataset.value = stats.images_processed_total;
    $("stat-images").title = "images in prompts since start (of them, encodings the encoder cache held)";
    $("encoder-meter").value = stats.encoder_cache_usage_perc;
    $("stat-generated").textContent = count(stats.generation_tokens_total);
    $("stat-generated").dataset.value = stats.generation_tokens_total;
  }

  function record(stats) {
    const sample = { time: stats.time, generated: stats.generation_tokens_total };
    if (!last || sample.generated < last.generated) {
      rates = []; // a new page, or the server restarted (its counters too)
      first = sample.time;
    }
    if (last && sample.time > last.time && sample.generated >= last.generated) {
      rates.push({
        from: last.time,
        time: sample.time,
        value: (sample.generated - last.generated) / (sample.time - last.time),
      });
    }
    last = sample;
    rates = rates.filter((point) => point.time >= sample.time - WINDOW_SECONDS);
    const current = rates.length ? rates[rates.length - 1].value : 0;
    $("stat-tps").textContent = current.toFixed(current && current < 10 ? 1 : 0);
    draw(sample.time);
  }

  // A round number at least `value`: 1, 2 or 5 times a power of ten.
  function niceCeiling(value) {
    const power = 10 ** Math.floor(Math.log10(value));
    return [1, 2, 5, 10].map((step) => step * power).find((candidate) => candidate >= value);
  }

  function draw(now) {
    const canvas = $("tps-chart");
    const peak = rates.reduce((max, point) => Math.max(max, point.value), 0);
    canvas.dataset.points = rates.length;
    canvas.dataset.peak = peak.toFixed(1);
    $("tps-peak").textContent = peak.toFixed(peak && peak < 10 ? 1 : 0);

    // Draw at the device's pixel density, in CSS pixels.
    const ratio = window.devicePixelRatio || 1;
    const width = canvas.clientWidth;
    const height = canvas.clientHeight;
    if (!width || !height) return;
    if (canvas.width !== Math.round(width * ratio) || canvas.height !== Math.round(height * ratio)) {
      canvas.width = Math.round(width * ratio);
      canvas.height = Math.round(height * ratio);
    }
    const ctx = canvas.getContext("2d");
    ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
    ctx.clearRect(0, 0, width, height);

    const style = getComputedStyle(canvas);
    const line = style.getPropertyValue("--chart-line").trim() || "#2563eb";
    const fill = style.getPropertyValue("--chart-fill").trim() || "rgba(37, 99, 235, 0.15)";
    const grid = style.getPropertyValue("--chart-grid").trim() || "#ccc";
    const text = style.getPropertyValue("--chart-text").trim() || "#666";

    const span = Math.min(WINDOW_SECONDS, Math.max(MIN_SPAN_SECONDS, now - first));
    const top = niceCeiling(Math.max(peak, 1));
    const pad = { left: 4, right: 4, top: 14, bottom: 14 };
    const plotWidth = width - pad.left - pad.right;
    const plotHeight = height - pad.top - pad.bottom;
    const x = (time) => pad.left + plotWidth * (1 - (now - time) / span);
    const y = (value) => pad.top + plotHeight * (1 - value / top);

    ctx.font = "10px system-ui, sans-serif";
    ctx.fillStyle = text;
    ctx.strokeStyle = grid;
    ctx.lineWidth = 1;
    ctx.beginPath();
    for (const value of [0, top / 2, top]) {
      ctx.moveTo(pad.left, Math.round(y(value)) + 0.5);
      ctx.lineTo(width - pad.right, Math.round(y(value)) + 0.5);
    }
    ctx.stroke();
    ctx.textBaseline = "bottom";
    ctx.fillText(`${top} tok/s`, pad.left, pad.top - 2);
    ctx.textBaseline = "top";
    ctx.fillText(`${Math.round(span / 60)} min ago`, pad.left, height - pad.bottom + 2);
    ctx.textAlign = "right";
    ctx.fillText("now", width - pad.right, height - pad.bottom + 2);
    ctx.textAlign = "left";

    if (rates.length < 1) return;
    // Each rate covers the interval between two samples: a step line shows that without inventing slopes.
    const clip = (time) => x(Math.max(time, now - span));
    ctx.beginPath();
    ctx.moveTo(clip(rates[0].from), y(0));
    for (const point of rates) {
      ctx.lineTo(clip(point.from), y(point.value));
      ctx.lineTo(x(point.time), y(point.value));
    }
    ctx.lineTo(x(rates[rates.length - 1].time), y(0));
    ctx.closePath();
    ctx.fillStyle = fill;
    ctx.fill();
    ctx.strokeStyle = line;
    ctx.lineWidth = 1.5;
    ctx.stroke();
  }

  async function poll() {
    try {
      const response = await fetch("metrics.json", { cache: "no-store" });
      if (!response.ok) throw new Error(`${response.status}`);
      const stats = await response.json();
      show(stats);
      record(stats);
      $("engine-status").textContent = "";
    } catch {
      $("engine-status").textContent = "metrics unavailable";
    } finally {
      setTimeout(poll, POLL_MS);
    }
  }

  function start() {
    poll();
    // Redraw when the panel changes size (window resized, layout switched).
    new ResizeObserver(() => last && draw(last.time)).observe($("tps-chart"));
  }

  return { start };
})();

window.FerryEngine = FerryEngine;
document.addEventListener("DOMContentLoaded", FerryEngine.start);

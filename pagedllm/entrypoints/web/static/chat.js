// The chat page: conversations in localStorage, answers streamed from /v1/chat/completions.
// Stop aborts the fetch, which closes the connection; the server then aborts the request and
// frees its KV blocks.
"use strict";

(() => {
  const STORE = "pagedllm.conversations";
  const CURRENT = "pagedllm.current";
  const SETTINGS = "pagedllm.settings";
  const $ = (id) => document.getElementById(id);

  let conversations = load(STORE, []);
  let current = localStorage.getItem(CURRENT);
  let controller = null;  // the AbortController of the answer being streamed

  function load(name, fallback) {
    try {
      const value = JSON.parse(localStorage.getItem(name));
      return value === null ? fallback : value;
    } catch (e) {
      return fallback;
    }
  }

  function save() {
    localStorage.setItem(STORE, JSON.stringify(conversations));
    if (current) localStorage.setItem(CURRENT, current);
  }

  function conversation() {
    let conv = conversations.find((c) => c.id === current);
    if (!conv) {
      conv = { id: "c" + Date.now().toString(36) + Math.random().toString(36).slice(2, 6),
               title: "New chat", system: $("system").value, messages: [] };
      conversations.unshift(conv);
      current = conv.id;
    }
    return conv;
  }

  // -- settings ------------------------------------------------------------------------------
  const FIELDS = ["temperature", "top-p", "max-tokens", "stop"];

  function restoreSettings() {
    const saved = load(SETTINGS, {});
    for (const id of FIELDS) if (saved[id] !== undefined) $(id).value = saved[id];
    for (const id of FIELDS) {
      $(id).addEventListener("change", () => {
        const values = load(SETTINGS, {});
        values[id] = $(id).value;
        localStorage.setItem(SETTINGS, JSON.stringify(values));
      });
    }
    $("system").addEventListener("input", () => {
      conversation().system = $("system").value;
      save();
    });
  }

  function samplingFields() {
    const body = {};
    const num = (id) => (($(id).value || "").trim() === "" ? null : Number($(id).value));
    if (num("temperature") !== null) body.temperature = num("temperature");
    if (num("top-p") !== null) body.top_p = num("top-p");
    if (num("max-tokens") !== null) body.max_tokens = num("max-tokens");
    const stop = $("stop").value.split(",").map((s) => s.trim()).filter((s) => s);
    if (stop.length) body.stop = stop;
    return body;
  }

  // -- rendering -----------------------------------------------------------------------------
  function renderList() {
    const list = $("conversations");
    list.textContent = "";
    for (const conv of conversations) {
      const li = document.createElement("li");
      li.dataset.id = conv.id;
      li.className = conv.id === current ? "active" : "";
      const title = document.createElement("span");
      title.textContent = conv.title;
      title.onclick = () => select(conv.id);
      const del = document.createElement("button");
      del.type = "button";
      del.className = "delete";
      del.title = "delete";
      del.textContent = "×";
      del.onclick = () => remove(conv.id);
      li.append(title, del);
      list.appendChild(li);
    }
  }

  function metaText(meta) {
    const parts = [];
    if (meta.ttft_ms !== null && meta.ttft_ms !== undefined) {
      parts.push("TTFT " + meta.ttft_ms.toFixed(0) + " ms");
    }
    if (meta.tps) parts.push(meta.tps.toFixed(1) + " tok/s");
    parts.push(meta.tokens + " tokens");
    if (meta.finish) parts.push(meta.finish);
    return parts.join(" · ");
  }

  function fillMessage(el, msg) {
    el.className = "msg " + msg.role;
    el.dataset.state = msg.state || "done";
    el.dataset.chars = String(msg.content.length);
    const body = el.querySelector(".content");
    if (msg.role === "assistant") body.innerHTML = PagedMarkdown.render(msg.content);
    else body.textContent = msg.content;
    const err = el.querySelector(".error");
    err.textContent = msg.error || "";
    err.hidden = !msg.error;
    const meta = el.querySelector(".meta");
    meta.textContent = msg.meta ? metaText(msg.meta) : "";
  }

  function messageElement(msg) {
    const el = document.createElement("div");
    for (const cls of ["role", "content", "error", "meta"]) {
      const part = document.createElement("div");
      part.className = cls;
      el.appendChild(part);
    }
    el.querySelector(".role").textContent = msg.role === "user" ? "You" : "Assistant";
    fillMessage(el, msg);
    return el;
  }

  function render() {
    const conv = conversation();
    $("system").value = conv.system || "";
    const box = $("messages");
    box.textContent = "";
    for (const msg of conv.messages) box.appendChild(messageElement(msg));
    box.scrollTop = box.scrollHeight;
    renderList();
  }

  function setBusy(busy) {
    $("send").disabled = busy;
    $("regenerate").disabled = busy;
    $("stop-btn").hidden = !busy;
  }

  // -- the API -------------------------------------------------------------------------------
  // An empty field is left out of the request, so the server applies the model's default;
  // the placeholder says what that is (/v1/models' sampling_defaults).
  function showDefaults(model) {
    const defaults = (model && model.sampling_defaults) || {};
    for (const [id, key] of [["temperature", "temperature"], ["top-p", "top_p"]]) {
      $(id).placeholder = key in defaults ? "model: " + defaults[key] : "model default";
    }
  }

  async function loadModels() {
    for (;;) {
      try {
        const models = await PagedAPI.getJSON("/v1/models");
        const select = $("model");
        const keep = select.value;
        select.textContent = "";
        for (const m of models.data) {
          const opt = document.createElement("option");
          opt.value = opt.textContent = m.id;
          select.appendChild(opt);
        }
        if (keep) select.value = keep;
        showDefaults(models.data[0]);
        $("status").textContent = "";
        return;
      } catch (e) {
        if (e.status === 401) {
          await PagedAPI.askKey(e.message);
          continue;
        }
        $("status").textContent = "cannot list models: " + e.message;
        return;
      }
    }
  }

  async function complete() {
    const conv = conversation();
    const messages = [];
    if (conv.system) messages.push({ role: "system", content: conv.system });
    for (const m of conv.messages) {
      if (!m.error || m.content) messages.push({ role: m.role, content: m.content });
    }
    const answer = { role: "assistant", content: "", state: "streaming" };
    conv.messages.push(answer);
    render();
    const el = $("messages").lastElementChild;
    const body = Object.assign({ model: $("model").value, messages: messages, stream: true,
                                 stream_options: { include_usage: true } }, samplingFields());
    controller = new AbortController();
    setBusy(true);
    const t0 = performance.now();
    let first = null;
    let chunks = 0;
    let usage = null;
    let finish = null;
    try {
      const resp = await fetch("/v1/chat/completions", {
        method: "POST", body: JSON.stringify(body), signal: controller.signal,
        headers: PagedAPI.headers({ "Content-Type": "application/json" }),
      });
      if (!resp.ok) {
        answer.error = await PagedAPI.errorText(resp);
        answer.state = "error";
        if (resp.status === 401) PagedAPI.askKey(answer.error).then(loadModels);
      } else {
        for await (const ev of PagedAPI.events(resp)) {
          if (ev.error) {
            answer.error = ev.error.message;
            answer.state = "error";
            break;
          }
          if (ev.id) answer.id = ev.id;
          if (ev.usage) usage = ev.usage;
          for (const c of ev.choices || []) {
            const delta = c.delta && c.delta.content;
            if (delta) {
              if (first === null) first = performance.now();
              chunks += 1;
              answer.content += delta;
              fillMessage(el, answer);
              $("messages").scrollTop = $("messages").scrollHeight;
            }
            if (c.finish_reason) finish = c.finish_reason;
          }
        }
        if (answer.state === "streaming") answer.state = "done";
      }
    } catch (e) {
      if (e.name === "AbortError") {
        answer.state = "stopped";
        finish = "stopped";
      } else {
        answer.error = String(e.message || e);
        answer.state = "error";
      }
    } finally {
      const t1 = performance.now();
      const tokens = usage ? usage.completion_tokens : chunks;
      const tps = first !== null && tokens > 1 && t1 > first
        ? (tokens - 1) / ((t1 - first) / 1000) : null;
      answer.meta = { ttft_ms: first === null ? null : first - t0, tps: tps, tokens: tokens,
                      finish: finish };
      controller = null;
      setBusy(false);
      if (conv.title === "New chat") {
        const user = conv.messages.find((m) => m.role === "user");
        if (user) conv.title = user.content.slice(0, 40);
      }
      save();
      fillMessage(el, answer);
      renderList();
    }
  }

  // -- actions -------------------------------------------------------------------------------
  function send(ev) {
    if (ev) ev.preventDefault();
    const text = $("prompt").value.trim();
    if (!text || controller) return;
    conversation().messages.push({ role: "user", content: text });
    $("prompt").value = "";
    save();
    complete();
  }

  function regenerate() {
    const conv = conversation();
    if (controller || !conv.messages.length) return;
    if (conv.messages[conv.messages.length - 1].role === "assistant") conv.messages.pop();
    if (!conv.messages.length) return;
    save();
    complete();
  }

  function select(id) {
    if (controller) return;
    current = id;
    save();
    render();
  }

  function remove(id) {
    if (controller && id === current) return;
    conversations = conversations.filter((c) => c.id !== id);
    if (id === current) current = conversations.length ? conversations[0].id : null;
    save();
    render();
  }

  function newChat() {
    if (controller) return;
    current = null;
    conversation();
    save();
    render();
  }

  $("composer").addEventListener("submit", send);
  $("prompt").addEventListener("keydown", (ev) => {
    if (ev.key === "Enter" && !ev.shiftKey) send(ev);
  });
  $("stop-btn").addEventListener("click", () => controller && controller.abort());
  $("regenerate").addEventListener("click", regenerate);
  $("new-chat").addEventListener("click", newChat);
  $("toggle-settings").addEventListener("click", () => {
    $("settings").hidden = !$("settings").hidden;
  });
  $("change-key").addEventListener("click", (ev) => {
    ev.preventDefault();
    PagedAPI.askKey("Enter the API key for this server (empty for none).").then(loadModels);
  });
  $("messages").addEventListener("click", (ev) => {
    if (!ev.target.classList.contains("copy")) return;
    const code = ev.target.closest(".codeblock").querySelector("code").textContent;
    if (navigator.clipboard) navigator.clipboard.writeText(code);
  });
  window.addEventListener("pagehide", () => controller && controller.abort());

  restoreSettings();
  render();
  loadModels();
})();

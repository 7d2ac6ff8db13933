// Shared by the chat page and the dashboard: the API key, JSON calls, OpenAI-shaped errors and
// server-sent events. The key lives in this browser's localStorage and travels as a Bearer token.
"use strict";

const PagedAPI = (() => {
  const KEY = "pagedllm.apiKey";

  class APIError extends Error {
    constructor(status, message) {
      super(message);
      this.status = status;
    }
  }

  function key() {
    return localStorage.getItem(KEY) || "";
  }

  function setKey(value) {
    if (value) localStorage.setItem(KEY, value);
    else localStorage.removeItem(KEY);
  }

  function headers(extra) {
    const h = Object.assign({}, extra || {});
    if (key()) h["Authorization"] = "Bearer " + key();
    return h;
  }

  // The server's error text: `{"error": {"message": ...}}`, else the status and the body.
  async function errorText(resp) {
    const text = await resp.text();
    try {
      const body = JSON.parse(text);
      if (body && body.error && body.error.message) return body.error.message;
    } catch (e) {
      // not JSON: fall through
    }
    return "HTTP " + resp.status + ": " + (text.slice(0, 300) || resp.statusText);
  }

  async function request(method, path, body, signal) {
    const init = { method: method, headers: headers(), signal: signal };
    if (body !== undefined) {
      init.headers["Content-Type"] = "application/json";
      init.body = JSON.stringify(body);
    }
    const resp = await fetch(path, init);
    if (!resp.ok) throw new APIError(resp.status, await errorText(resp));
    return resp;
  }

  async function getJSON(path) {
    return (await request("GET", path)).json();
  }

  async function postJSON(path, body) {
    return (await request("POST", path, body === undefined ? {} : body)).json();
  }

  // Parsed `data:` events of a text/event-stream response, until `[DONE]` or the end.
  async function* events(resp) {
    const reader = resp.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buffer += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buffer.indexOf("\n\n")) >= 0) {
        const block = buffer.slice(0, cut);
        buffer = buffer.slice(cut + 2);
        for (const line of block.split("\n")) {
          if (!line.startsWith("data:")) continue;
          const data = line.slice(5).trim();
          if (data === "[DONE]") return;
          yield JSON.parse(data);
        }
      }
    }
  }

  // Show the key dialog (markup shared by both pages) and resolve once a key is saved.
  function askKey(reason) {
    const box = document.getElementById("key-dialog");
    const input = document.getElementById("key-input");
    const note = document.getElementById("key-reason");
    note.textContent = reason || "This server needs an API key.";
    input.value = key();
    box.hidden = false;
    input.focus();
    return new Promise((resolve) => {
      const form = document.getElementById("key-form");
      form.onsubmit = (ev) => {
        ev.preventDefault();
        setKey(input.value.trim());
        box.hidden = true;
        resolve(key());
      };
    });
  }

  return { APIError, key, setKey, headers, errorText, request, getJSON, postJSON, events,
           askKey };
})();

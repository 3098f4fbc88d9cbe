// superfluid's built-in page: a client of the public API, nothing more (superfluid/api/_ui.py).
// No framework, no build step. Every text from the server is put in the page as text (textContent),
// never as HTML. The key, when the server asks for one, lives in sessionStorage only.
"use strict";

(() => {
  const params = new URLSearchParams(location.search);
  // ?api=http://host:port: the daemon, when this page is served from another origin (--web-origin).
  // Served by the daemon itself, its CSP (connect-src 'self') keeps the page on its own origin.
  const API = (params.get("api") || "").replace(/\/+$/, "");
  const KEY_ITEM = "superfluid.key";
  const MINE_ITEM = "superfluid.conversations";  // ids this tab made, for servers without ?view=tree
  const $ = (id) => document.getElementById(id);

  const state = {
    models: [],
    tree: null,          // true: GET /v1/sessions?view=tree answers (parents, titles); false: a flat list
    convs: [],           // [{id, parent, fork_at, title, archived, model, version, last_event_id}]
    current: null,       // the conversation shown (its id), null for a new one
    info: null,          // its GET /v1/sessions/{id}
    events: new Map(),   // its events by id
    streaming: null,     // {cid, controller, turn}: this tab's own /generate stream
    provisional: new Map(),  // turn -> text, from a subscription (another tab's, or a client's, turn)
    sub: null,           // {cid, controller, cursor}: the live subscription of the current conversation
    ops: null,           // null: unknown yet; true: the session-tree operations exist (rebase, trim, meta...)
  };

  // ---------- the API ----------

  class ApiError extends Error {
    constructor(status, code, message) { super(message); this.status = status; this.code = code; }
  }

  function headers(json) {
    const h = {};
    if (json) h["content-type"] = "application/json";
    const key = sessionStorage.getItem(KEY_ITEM);
    if (key) h.authorization = "Bearer " + key;
    return h;
  }

  async function request(method, path, body, opts = {}) {
    for (;;) {
      let r;
      try {
        r = await fetch(API + path, {
          method, headers: headers(body !== undefined), body: body === undefined ? undefined : JSON.stringify(body),
          signal: opts.signal, cache: "no-store",
        });
      } catch (e) {
        if (e.name === "AbortError") throw e;
        setConn(false, "cannot reach " + (API || location.origin) + " (refused or down)");
        throw new ApiError(0, "unreachable", "the daemon cannot be reached from this page (refused, or down)");
      }
      setConn(true);
      if (r.status === 401) {
        const err = await errorOf(r);
        if (err.code === "invalid_api_key") {
          await askKey(sessionStorage.getItem(KEY_ITEM) ? "that key was refused" : "");
          continue;  // again, with the key
        }
        throw err;
      }
      if (!r.ok) throw await errorOf(r);
      if (opts.raw) return r;
      const text = await r.text();
      return text ? JSON.parse(text) : null;
    }
  }

  async function errorOf(r) {
    let code = "http_" + r.status, message = r.status + " " + r.statusText;
    try {
      const body = await r.json();
      const e = body.error || body;
      if (typeof e === "string") message = e;
      else { code = e.code || code; message = e.message || message; }
    } catch (_) { /* not JSON */ }
    return new ApiError(r.status, code, message);
  }

  // Read a text/event-stream response; onEvent(event, data, id) per event. Ends when the stream does.
  async function readSse(response, onEvent) {
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    let event = "message", data = [], id = null;
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let nl;
      while ((nl = buffer.indexOf("\n")) >= 0) {
        let line = buffer.slice(0, nl);
        buffer = buffer.slice(nl + 1);
        if (line.endsWith("\r")) line = line.slice(0, -1);
        if (line === "") {
          if (data.length) onEvent(event, data.join("\n"), id);
          event = "message"; data = [];
          continue;
        }
        if (line.startsWith(":")) continue;
        const colon = line.indexOf(":");
        const field = colon < 0 ? line : line.slice(0, colon);
        let v = colon < 0 ? "" : line.slice(colon + 1);
        if (v.startsWith(" ")) v = v.slice(1);
        if (field === "event") event = v;
        else if (field === "data") data.push(v);
        else if (field === "id") id = v;
      }
    }
  }

  // ---------- small helpers ----------

  function el(tag, cls, text) {
    const e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined && text !== null) e.textContent = text;
    return e;
  }

  function button(label, onClick, cls) {
    const b = el("button", cls || "small", label);
    b.type = "button";
    b.addEventListener("click", onClick);
    return b;
  }

  function setStatus(text, error) {
    const s = $("status");
    s.textContent = text || "";
    s.classList.toggle("err", !!error);
  }

  function fail(e) {
    if (e && e.name === "AbortError") return;
    setStatus(e && e.code ? `${e.message} (${e.code})` : String(e), true);
  }

  function setConn(ok, why) {
    const c = $("conn");
    c.className = "conn " + (ok ? "ok" : "bad");
    c.textContent = ok ? (API ? API.replace(/^https?:\/\//, "") : location.host) : (why || "offline");
  }

  function contentText(content) {
    if (content === null || content === undefined) return "";
    if (typeof content === "string") return content;
    if (Array.isArray(content)) return content.map((p) => (typeof p === "string" ? p : p.text || "")).join("");
    return JSON.stringify(content);
  }

  function short(id) { return id.length > 14 ? id.slice(0, 12) + "…" : id; }

  function nameOf(id) {  // a conversation's title, else its id, shortened
    const c = state.convs.find((x) => x.id === id);
    return c && c.title ? c.title : short(id);
  }

  // ---------- the key ----------

  let keyWaiters = null;

  function askKey(error) {
    $("key-error").textContent = error || "";
    $("key-dialog").hidden = false;
    $("key-input").value = "";
    $("key-input").focus();
    if (!keyWaiters) keyWaiters = [];
    return new Promise((resolve) => keyWaiters.push(resolve));
  }

  function keyEntered() {
    const key = $("key-input").value.trim();
    if (!key) { $("key-error").textContent = "enter a key"; return; }
    sessionStorage.setItem(KEY_ITEM, key);
    $("key-dialog").hidden = true;
    $("key-button").hidden = false;
    const waiters = keyWaiters || [];
    keyWaiters = null;
    waiters.forEach((w) => w());
  }

  // ---------- a small text prompt (no window.prompt: it blocks the page and its tests) ----------

  function askText(title, value) {
    return new Promise((resolve) => {
      $("text-title").textContent = title;
      $("text-input").value = value || "";
      $("text-dialog").hidden = false;
      $("text-input").focus();
      const done = (v) => {
        $("text-dialog").hidden = true;
        $("text-ok").removeEventListener("click", ok);
        $("text-cancel").removeEventListener("click", cancel);
        $("text-input").removeEventListener("keydown", key);
        resolve(v);
      };
      const ok = () => done($("text-input").value);
      const cancel = () => done(null);
      const key = (ev) => { if (ev.key === "Enter") ok(); else if (ev.key === "Escape") cancel(); };
      $("text-ok").addEventListener("click", ok);
      $("text-cancel").addEventListener("click", cancel);
      $("text-input").addEventListener("keydown", key);
    });
  }

  // ---------- models ----------

  async function loadModels() {
    const list = await request("GET", "/v1/models");
    state.models = list.data.map((m) => m.id);
    const sel = $("model");
    const was = sel.value;
    sel.replaceChildren(...state.models.map((id) => { const o = el("option", null, id); o.value = id; return o; }));
    if (state.models.includes(was)) sel.value = was;
  }

  // ---------- the conversation list / tree ----------

  function mine() {
    try { return JSON.parse(sessionStorage.getItem(MINE_ITEM) || "[]"); } catch (_) { return []; }
  }

  function remember(info) {
    const list = mine().filter((c) => c.id !== info.id);
    list.push({ id: info.id, parent: info.forked_from ? info.forked_from.id : null,
      fork_at: info.forked_from ? info.forked_from.at : null, model: info.model });
    sessionStorage.setItem(MINE_ITEM, JSON.stringify(list.slice(-500)));
  }

  async function loadTree() {
    const archived = $("show-archived").checked ? "&include_archived=1" : "";
    let list;
    try {
      list = await request("GET", "/v1/sessions?view=tree&limit=1000" + archived);
    } catch (e) {
      if (e.status === 400 && state.tree !== true) list = await request("GET", "/v1/sessions?limit=1000");
      else throw e;
    }
    const data = list.data || [];
    // the tree view gives each conversation its parent; a server without it ignores ?view and pages its sessions
    const isTree = data.length > 0 ? "parent" in data[0] : !("first_id" in list);
    if (isTree) {
      state.tree = true;
      state.convs = data;
    } else {
      // a server without the tree view: its conversations (kind), parents as this tab saw them fork
      const known = new Map(mine().map((c) => [c.id, c]));
      state.tree = false;
      state.convs = data.filter((c) => c.kind === "conversation").map((c) => ({
        id: c.id, model: c.model, parent: (known.get(c.id) || {}).parent || null,
        fork_at: (known.get(c.id) || {}).fork_at, title: null, archived: false, created: c.created,
      }));
    }
    $("archived-toggle").hidden = !state.tree;
    renderTree();
  }

  function renderTree() {
    const byId = new Map(state.convs.map((c) => [c.id, c]));
    const children = new Map();
    const roots = [];
    for (const c of state.convs) {
      if (c.parent && byId.has(c.parent)) {
        if (!children.has(c.parent)) children.set(c.parent, []);
        children.get(c.parent).push(c);
      } else roots.push(c);
    }
    const newest = (a, b) => (b.created || 0) - (a.created || 0) || (a.id < b.id ? 1 : -1);
    const oldest = (a, b) => (a.fork_at || 0) - (b.fork_at || 0) || (a.created || 0) - (b.created || 0);
    const item = (c, depth) => {
      const li = el("li");
      const b = el("button", "node" + (c.id === state.current ? " current" : "") + (c.archived ? " archived" : ""));
      b.type = "button";
      b.dataset.id = c.id;
      b.title = c.id + (c.model ? " · " + c.model : "");
      b.append(el("span", "label", c.title || short(c.id)));
      if (c.parent) b.append(el("span", "fork-at", "@" + c.fork_at));
      b.addEventListener("click", () => select(c.id).catch(fail));
      li.append(b);
      const kids = (children.get(c.id) || []).sort(oldest);
      if (kids.length && depth < 64) {
        const ul = el("ul");
        kids.forEach((k) => ul.append(item(k, depth + 1)));
        li.append(ul);
      }
      return li;
    };
    $("tree").replaceChildren(...roots.sort(newest).map((c) => item(c, 0)));
  }

  // ---------- one conversation ----------

  async function select(cid) {
    if (state.streaming && state.streaming.cid !== cid) { /* its stream goes on in the background */ }
    state.current = cid;
    state.info = null;  // until refresh() reads it: no action acts on the conversation shown before
    state.events = new Map();
    state.provisional = new Map();
    const url = new URL(location.href);
    if (cid) url.searchParams.set("c", cid); else url.searchParams.delete("c");
    history.replaceState(null, "", url);
    unsubscribe();
    renderHead();
    if (!cid) {
      renderHead();
      renderMessages();
      renderTree();
      return;
    }
    await refresh();
    renderTree();
    subscribe(cid);
  }

  async function refresh() {
    const cid = state.current;
    if (!cid) return;
    const [info, page] = await Promise.all([
      request("GET", `/v1/sessions/${encodeURIComponent(cid)}`),
      request("GET", `/v1/sessions/${encodeURIComponent(cid)}/events?limit=10000`),
    ]);
    if (state.current !== cid) return;
    state.info = info;
    for (const ev of page.events) state.events.set(ev.id, ev);
    if (info.model && state.models.includes(info.model)) $("model").value = info.model;
    if (info.qos) $("qos").value = info.qos;  // the conversation's own class (PATCH qos)
    renderHead();
    renderMessages();
  }

  function renderHead() {
    const info = state.info;
    const conv = state.convs.find((c) => c.id === state.current) || {};
    $("conv-title").textContent = info ? (info.title || conv.title || info.id) : "New conversation";
    const meta = [];
    if (info) {
      meta.push(info.model);
      meta.push(`${info.messages} messages`);
      if (conv.parent) meta.push(`branch of ${nameOf(conv.parent)} at event ${conv.fork_at}`);
      if (info.archived || conv.archived) meta.push("archived");
      if (info.generating) meta.push("generating…");
    }
    $("conv-meta").textContent = meta.join(" · ");
    const ops = !!info && state.ops === true;
    $("rename").hidden = !ops;
    $("archive").hidden = !ops;
    $("archive").textContent = info && (info.archived || conv.archived) ? "unarchive" : "archive";
    $("delete").hidden = !ops;
  }

  function renderCalls(calls) {
    const box = el("div", "calls");
    for (const call of calls) {
      const fn = call.function || call;
      const c = el("div", "call");
      c.append(el("span", "name", "⚙ " + (fn.name || "…")), el("div", "args", fn.arguments || ""));
      box.append(c);
    }
    return box;
  }

  function messageView(ev) {
    const m = ev.message || {};
    const role = m.role || "assistant";
    const div = el("div", "msg " + role);
    div.dataset.event = ev.id;
    const who = el("div", "who");
    who.append(el("span", null, role), el("span", "eid", "#" + ev.id));
    const acts = el("span", "acts");
    acts.append(button("fork here", () => fork(ev.id).catch(fail), "small act-fork"));
    if (state.ops === true) {
      if (role === "user" || role === "assistant" || role === "system")
        acts.append(button("edit", () => edit(div, ev), "small act-edit"));
      acts.append(button("trim here", () => trim(ev.id).catch(fail), "small act-trim"));
    }
    who.append(acts);
    div.append(who);
    if (m.reasoning_content) div.append(el("div", "reasoning", m.reasoning_content));
    div.append(el("div", "text", contentText(m.content)));
    if (Array.isArray(m.tool_calls) && m.tool_calls.length) div.append(renderCalls(m.tool_calls));
    if (role === "tool" && m.tool_call_id) div.append(el("div", "finish", "result of " + m.tool_call_id));
    if (ev.finish && ev.finish !== "stop") div.append(el("div", "finish", "finish: " + ev.finish));
    return div;
  }

  function renderMessages() {
    const box = $("messages");
    const atBottom = box.scrollHeight - box.scrollTop - box.clientHeight < 40;
    const out = [];
    const events = [...state.events.values()].sort((a, b) => a.id - b.id);
    for (const ev of events) {
      if (ev.type === "conversation" && ev.system) out.push(el("div", "msg system", "system: " + ev.system));
      else if (ev.type === "message") out.push(messageView(ev));
      else if (ev.type === "turn_end" && ev.finish === "error")
        out.push(el("div", "note err", "the turn failed" + (ev.error ? ": " + (ev.error.message || ev.error) : "")));
      else if (ev.type === "fork") {
        const edits = Array.isArray(ev.edits) && ev.edits.length ? `, ${ev.edits.length} edit${ev.edits.length > 1 ? "s" : ""}` : "";
        out.push(el("div", "note", `— branched from ${nameOf(ev.source)} at event ${ev.at}${edits} —`));
      }
    }
    const s = state.streaming;
    if (s && s.cid === state.current && s.view) out.push(s.view.div);
    else for (const [turn, text] of state.provisional) {
      const div = el("div", "msg assistant provisional");
      div.dataset.turn = turn;
      const who = el("div", "who");
      who.append(el("span", null, "assistant (live)"));
      div.append(who, el("div", "text", text));
      out.push(div);
    }
    const open = openCalls(events);
    if (open.length && !(s && s.cid === state.current)) out.push(ledgerView(open));
    if (!out.length) out.push(el("div", "note", state.current ? "no messages yet" : "Start a conversation below."));
    box.replaceChildren(...out);
    if (atBottom || s) box.scrollTop = box.scrollHeight;
  }

  // ---------- the tool ledger: the last reply's calls that have no result yet ----------

  function openCalls(events) {
    const messages = events.filter((e) => e.type === "message").map((e) => e.message || {});
    let last = -1;
    messages.forEach((m, i) => { if (m.role === "assistant") last = i; });
    if (last < 0) return [];
    const answered = new Set(messages.slice(last + 1).filter((m) => m.role === "tool").map((m) => m.tool_call_id));
    return (messages[last].tool_calls || []).filter((c) => c.id && !answered.has(c.id));
  }

  function ledgerView(calls) {
    const box = el("div", "ledger");
    box.append(el("div", "who", "open tool calls: answer each, and the model goes on"));
    for (const call of calls) {
      const fn = call.function || {};
      const row = el("div", "ledger-call");
      row.dataset.call = call.id;
      row.append(el("div", "call", `⚙ ${fn.name || "?"}(${fn.arguments || ""})`));
      const area = el("textarea", "ledger-result");
      area.rows = 2;
      area.placeholder = "the tool's result";
      const buttons = el("div", "ledger-buttons");
      buttons.append(button("send result", () => answer(call.id, { content: area.value }).catch(fail), "small primary act-result"));
      if (state.ops === true) {
        buttons.append(button("failed", () => answer(call.id, { outcome: "failed", note: area.value || undefined }).catch(fail), "small act-failed"));
        buttons.append(button("cancelled", () => answer(call.id, { outcome: "cancelled" }).catch(fail), "small act-cancelled"));
      }
      row.append(area, buttons);
      box.append(row);
    }
    return box;
  }

  async function answer(callId, result) {
    const cid = state.current;
    if (state.ops === true) {
      await request("POST", `/v1/sessions/${encodeURIComponent(cid)}/tool_results`, { tool_call_id: callId, ...result });
    } else {
      await request("POST", `/v1/sessions/${encodeURIComponent(cid)}/messages`,
        { messages: [{ role: "tool", tool_call_id: callId, content: result.content || "" }] });
    }
    await refresh();
    if (state.current === cid && !openCalls([...state.events.values()].sort((a, b) => a.id - b.id)).length) {
      await generate(cid);  // every call answered: the model reads the results and goes on
    }
  }

  // ---------- sending and streaming ----------

  function streamView() {
    const div = el("div", "msg assistant streaming");
    const who = el("div", "who");
    who.append(el("span", null, "assistant"));
    const reasoning = el("div", "reasoning");
    reasoning.hidden = true;
    const text = el("div", "text");
    const calls = el("div", "calls");
    const finish = el("div", "finish");
    div.append(who, reasoning, text, calls, finish);
    return { div, reasoning, text, calls, finish, toolCalls: [] };
  }

  function applyDelta(view, delta) {
    if (delta.reasoning_content) { view.reasoning.hidden = false; view.reasoning.textContent += delta.reasoning_content; }
    if (delta.content) view.text.textContent += delta.content;
    for (const tc of delta.tool_calls || []) {  // shown as they arrive: name first, arguments as they stream
      const i = tc.index || 0;
      if (!view.toolCalls[i]) view.toolCalls[i] = { name: "", arguments: "" };
      const fn = tc.function || {};
      if (fn.name) view.toolCalls[i].name += fn.name;
      if (fn.arguments) view.toolCalls[i].arguments += fn.arguments;
      view.calls.replaceChildren(...renderCalls(view.toolCalls.filter(Boolean)).children);
    }
  }

  async function send() {
    const text = $("input").value;
    if (!text.trim() || state.streaming) return;
    setStatus("");
    const message = { role: "user", content: text };
    let cid = state.current;
    try {
      if (!cid) {
        const info = await request("POST", "/v1/sessions", { model: $("model").value, messages: [message] });
        remember(info);
        cid = info.id;
        $("input").value = "";
        await select(cid);
        loadTree().catch(fail);
      } else {
        await request("POST", `/v1/sessions/${encodeURIComponent(cid)}/messages`, { messages: [message] });
        $("input").value = "";
        await refresh();
      }
      await generate(cid);
    } catch (e) { fail(e); }
  }

  async function generate(cid) {
    const controller = new AbortController();
    const view = streamView();
    const s = { cid, controller, view, cursor: 0, generation: null, done: false };
    state.streaming = s;
    document.body.dataset.generating = "1";
    $("stop").disabled = false;
    $("send").disabled = true;
    renderMessages();
    const started = performance.now();
    let first = null, note = "";
    try {
      const turn = () => {
        const body = { stream: true };
        if ($("qos").value) body.qos = $("qos").value;  // "": the key's (or the server's) own class
        return request("POST", `/v1/sessions/${encodeURIComponent(cid)}/generate`, body,
          { raw: true, signal: controller.signal });
      };
      let r;
      try {
        r = await turn();
      } catch (e) {
        if (e.code !== "qos_class_not_allowed") throw e;
        const asked = $("qos").value;
        $("qos").value = "";  // this key may not ask that class: its own, from now on
        r = await turn();
        note = `this key may not ask ${asked}: its own class is used; `;
      }
      s.generation = r.headers.get("x-superfluid-session");
      for (let attempt = 0; attempt < 20; attempt++) {
        try {
          await readSse(r, (event, data, id) => {
            if (id !== null) s.cursor = Number(id);
            if (data === "[DONE]") { s.done = true; return; }
            const obj = JSON.parse(data);
            if (obj.error) { view.finish.textContent = "error: " + (obj.error.message || obj.error.code); view.finish.classList.add("error"); return; }
            const choice = (obj.choices || [])[0];
            if (choice) {
              if (first === null && (choice.delta.content || choice.delta.tool_calls)) first = performance.now();
              applyDelta(view, choice.delta);
              if (choice.finish_reason) view.finish.textContent = "finish: " + choice.finish_reason;
            }
            const box = $("messages");
            box.scrollTop = box.scrollHeight;
          });
        } catch (e) {
          if (e.name === "AbortError") throw e;
        }
        if (s.done) break;
        // the connection dropped mid-reply: the turn goes on in the daemon; follow it from the cursor
        for (let wait = 250; ; wait = Math.min(4000, wait * 2)) {
          await new Promise((res) => setTimeout(res, wait));
          try {
            r = await request("GET", `/v1/sessions/${encodeURIComponent(cid)}/stream?after=${s.cursor}`, undefined,
              { raw: true, signal: controller.signal });
            break;
          } catch (e) {
            if (e.status !== 0 || attempt >= 20) throw e;  // only "unreachable" is worth another try
            attempt++;
          }
        }
        note += "the connection dropped and was resumed; ";
        setStatus("reconnected");
      }
      setStatus(note + (first !== null ? `first token after ${Math.round(first - started)} ms` : ""));
    } catch (e) {
      fail(e);
    } finally {
      state.streaming = null;
      $("stop").disabled = true;
      $("send").disabled = false;
      if (state.current === cid) {
        state.provisional = new Map();
        await refresh().catch(fail);
      }
      if (state.tree) await loadTree().catch(fail);
      document.body.dataset.generating = "0";  // the reply is shown as the conversation's event
    }
  }

  async function stop() {
    const s = state.streaming;
    if (!s) return;
    try {
      await request("DELETE", `/v1/sessions/${encodeURIComponent(s.cid)}/generation`);
      setStatus("stopped");
    } catch (e) {
      if (e.code !== "no_generation") fail(e);
    }
  }

  // ---------- branches ----------

  async function branched(info, generateAfter) {
    remember(info);
    await loadTree();
    await select(info.id);
    if (generateAfter) await generate(info.id);
  }

  async function fork(at) {
    const info = await request("POST", `/v1/sessions/${encodeURIComponent(state.current)}/fork`, { at });
    setStatus(`forked at event ${at}: ${info.id}`);
    await branched(info, false);
  }

  function edit(div, ev) {
    const m = ev.message || {};
    const area = el("textarea");
    area.rows = 3;
    area.value = contentText(m.content);
    const row = el("div", "modal-buttons");
    const save = button("Save as a branch", async () => {
      try {
        // the message replaced, and what followed it dropped: a new branch that the model then answers
        const last = Math.max(...state.events.keys());
        const edits = [{ replace: { from: ev.id, to: ev.id + 1, message: { role: m.role, content: area.value } } }];
        if (last > ev.id) edits.push({ drop: { from: ev.id + 1, to: last + 1 } });
        const info = await request("POST", `/v1/sessions/${encodeURIComponent(state.current)}/rebase`, { edits });
        setStatus(`edited event ${ev.id}: ${info.id}`);
        await branched(info, m.role === "user");
      } catch (e) { fail(e); }
    }, "small primary act-save");
    row.append(button("Cancel", () => renderMessages(), "small"), save);
    div.querySelector(".text").replaceWith(area);
    div.append(row);
    area.focus();
  }

  async function trim(to) {
    const info = await request("POST", `/v1/sessions/${encodeURIComponent(state.current)}/trim`, { to });
    setStatus(`trimmed before event ${to}: ${info.id}`);
    await branched(info, false);
  }

  async function patch(body) {
    const cid = state.current;
    if (!state.info || state.info.id !== cid) return;
    const version = state.info.version;
    const info = await request("PATCH", `/v1/sessions/${encodeURIComponent(cid)}`,
      version === undefined ? body : { ...body, expected_version: version });
    state.info = { ...state.info, ...info };
    await loadTree();
    renderHead();
  }

  async function rename() {
    const title = await askText("Rename the conversation", (state.info && state.info.title) || "");
    if (title !== null) await patch({ title });
  }

  async function archive() {
    const conv = state.convs.find((c) => c.id === state.current) || {};
    await patch({ archived: !(state.info.archived || conv.archived) });
  }

  async function remove() {
    const cid = state.current;
    if (!state.info || state.info.id !== cid) return;
    const kids = state.convs.some((c) => c.parent === cid);
    const mode = kids ? "reroot" : "cascade";  // branches of it stay, as roots
    const v = state.info && state.info.version !== undefined ? `&expected_version=${state.info.version}` : "";
    const done = await request("DELETE", `/v1/sessions/${encodeURIComponent(cid)}?mode=${mode}${v}`);
    setStatus(`deleted ${cid}` + (done && done.purged && done.purged.length > 1 ? ` and ${done.purged.length - 1} more` : ""));
    await select(null);
    await loadTree();
  }

  // ---------- live: a subscription to the conversation shown ----------

  function unsubscribe() {
    if (state.sub) state.sub.controller.abort();
    state.sub = null;
  }

  async function subscribe(cid) {
    if (state.ops === false) return;
    const sub = { cid, controller: new AbortController(), cursor: Math.max(-1, ...state.events.keys()) };
    state.sub = sub;
    for (let tries = 0; state.sub === sub && tries < 50; tries++) {
      let ended = null;
      try {
        const r = await request("GET", `/v1/sessions/${encodeURIComponent(cid)}/subscribe?after=${sub.cursor}`,
          undefined, { raw: true, signal: sub.controller.signal });
        state.ops = true;
        renderHead();
        await readSse(r, (event, data, id) => {
          if (state.sub !== sub) return;
          const obj = JSON.parse(data);
          if (event === "committed") {
            if (id !== null) sub.cursor = Math.max(sub.cursor, Number(id));
            state.events.set(obj.id, obj);
            if (obj.type === "message" && obj.turn !== undefined && obj.turn !== null) state.provisional.delete(obj.turn);
            if (obj.type === "turn_end") state.provisional.delete(obj.turn);
            if (!(state.streaming && state.streaming.cid === cid)) renderMessages();
          } else if (event === "provisional") {
            state.provisional.set(obj.turn, (state.provisional.get(obj.turn) || "") + (obj.text || ""));
            if (!(state.streaming && state.streaming.cid === cid)) renderMessages();
          } else if (event === "ended") {
            ended = obj.reason;
          }
        });
      } catch (e) {
        if (e.name === "AbortError") return;
        if (e.status === 404 || e.status === 405) {
          if (e.code === "session_not_found") await loadTree().catch(fail);  // deleted meanwhile
          else state.ops = false;  // no /subscribe on this server: no live updates, no tree operations
          return;
        }
      }
      if (ended === "purged") {  // deleted, here or elsewhere
        await loadTree().catch(fail);
        if (state.current === cid) { await select(null).catch(fail); setStatus("that conversation was deleted"); }
        return;
      }
      if (ended === "shutdown") return;
      await new Promise((res) => setTimeout(res, ended === "lagged" ? 0 : 1000));  // lagged: again from the cursor
    }
  }

  async function probeOps() {
    // the tree view answers with parents: the session-tree operations are there
    if (state.tree) state.ops = true;
  }

  // ---------- the live view of the daemon (from /metrics) ----------

  const CLASSES = ["interactive", "completion", "agent", "background"];
  const live = { timer: null, last: null, history: new Map() };

  function parseMetrics(text) {
    const out = [];
    for (const line of text.split("\n")) {
      if (!line || line.startsWith("#")) continue;
      const m = line.match(/^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)/);
      if (!m) continue;
      const labels = {};
      if (m[2]) for (const p of m[2].matchAll(/([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"/g)) labels[p[1]] = p[2].replace(/\\(.)/g, "$1");
      out.push({ name: m[1], labels, value: Number(m[3]) });
    }
    return out;
  }

  function byModel(samples) {
    const models = new Map();
    for (const s of samples) {
      const model = s.labels.model;
      if (model === undefined) continue;
      if (!models.has(model)) models.set(model, { queues: {}, outcomes: {}, buckets: [] });
      const m = models.get(model);
      const short = s.name.replace(/^superfluid_/, "");
      if (short === "queue_depth") m.queues[s.labels.class] = s.value;
      else if (short === "requests_total") m.outcomes[s.labels.outcome] = s.value;
      else if (short === "ttft_seconds_bucket") m.buckets.push([s.labels.le === "+Inf" ? Infinity : Number(s.labels.le), s.value]);
      else if (!Object.keys(s.labels).some((k) => k !== "model")) m[short] = s.value;
    }
    return models;
  }

  function quantile(q, buckets) {
    buckets = buckets.slice().sort((a, b) => a[0] - b[0]);
    if (!buckets.length || buckets[buckets.length - 1][1] <= 0) return null;
    const rank = q * buckets[buckets.length - 1][1];
    let lower = 0, below = 0;
    for (const [le, count] of buckets) {
      if (count >= rank) {
        if (le === Infinity) return lower;
        const span = count - below;
        return lower + (le - lower) * (span ? (rank - below) / span : 1);
      }
      lower = le; below = count;
    }
    return lower;
  }

  const SPARK = "▁▂▃▄▅▆▇█";
  function spark(values) {
    const max = Math.max(1, ...values);
    return values.map((v) => SPARK[Math.min(7, Math.floor((v / max) * 7.99))]).join("");
  }

  function ms(seconds) { return seconds === null ? "–" : seconds < 1 ? `${Math.round(seconds * 1000)} ms` : `${seconds.toFixed(2)} s`; }

  async function pollLive() {
    let text, running = new Map();
    try {
      const r = await request("GET", "/metrics", undefined, { raw: true });
      text = await r.text();
    } catch (e) { fail(e); return; }
    try {  // each busy lane's class (not in /metrics); absent from a daemon run with --no-ui
      for (const m of (await request("GET", "/ui/lanes")).data) running.set(m.model, m.lanes);
    } catch (_) { /* busy/idle only */ }
    const now = performance.now() / 1000;
    const models = byModel(parseMetrics(text));
    const cards = [];
    for (const [name, m] of [...models.entries()].sort()) {
      const prev = live.last && live.last.models.get(name);
      const dt = live.last ? now - live.last.at : 0;
      const rate = (k) => (prev && dt > 0 ? Math.max(0, ((m[k] || 0) - (prev[k] || 0)) / dt) : 0);
      const decode = rate("decode_tokens_total"), prefill = rate("prefill_tokens_total");
      const hist = live.history.get(name) || [];
      hist.push(decode);
      while (hist.length > 40) hist.shift();
      live.history.set(name, hist);
      const card = el("div", "card model-card");
      card.dataset.model = name;
      card.append(el("h3", null, name));
      const active = m.lanes_active || 0, total = m.lanes_total || 0;
      const lanes = el("div", "lanes");
      // each busy lane with its class and phase (/ui/lanes), else busy/idle from the gauges
      const rows = (running.get(name) || []).slice().sort((a, b) => CLASSES.indexOf(a.class) - CLASSES.indexOf(b.class));
      const busyN = rows.length || active;
      for (let i = 0; i < Math.max(total, busyN); i++) {
        const r = rows[i];
        const busy = i < busyN;
        const lane = el("div", "lane" + (busy ? " busy" : "") + (r ? " c-" + r.class : ""),
          busy ? (r ? r.class : "busy") : "idle");
        if (r) { lane.title = `${r.class} · ${r.phase} · ${r.tokens} tokens`; lane.dataset.class = r.class; }
        lanes.append(lane);
      }
      card.append(lanes);
      const table = el("table");
      const row = (k, v, extra) => {
        const tr = el("tr");
        const td = el("td");
        if (extra) td.append(el("span", null, v), extra); else td.textContent = v;
        tr.append(el("td", null, k), td);
        tr.dataset.metric = k;
        table.append(tr);
      };
      row("lanes", `${busyN} / ${total} busy`);
      row("queued", CLASSES.map((c) => `${c} ${m.queues[c] || 0}`).join(" · "));
      row("decode", `${decode.toFixed(1)} tokens/s `, el("span", "spark", spark(hist)));
      row("prefill", `${prefill.toFixed(1)} tokens/s`);
      row("TTFT", `p50 ${ms(quantile(0.5, m.buckets))} · p99 ${ms(quantile(0.99, m.buckets))}`);
      const kvUsed = m.kv_used_tokens || 0, kvTotal = m.kv_total_tokens || 0;
      const bar = el("div", "bar");
      const fill = el("span");
      fill.style.width = kvTotal ? `${Math.min(100, (100 * kvUsed) / kvTotal).toFixed(1)}%` : "0%";
      bar.append(fill);
      row("KV use", `${kvUsed} / ${kvTotal} cells `, bar);
      row("requests", Object.entries(m.outcomes).map(([k, v]) => `${k} ${v}`).join(" · ") || "0");
      row("preemptions", String(m.preemptions_total || 0));
      row("worker respawns", String(m.worker_respawns_total || 0));
      card.append(table);
      cards.push(card);
    }
    if (!cards.length) cards.push(el("p", "muted", "no model loaded"));
    $("live-models").replaceChildren(...cards);
    live.last = { at: now, models };
  }

  function showTab(name) {
    const chat = name === "chat";
    $("chat-view").hidden = !chat;
    $("live-view").hidden = chat;
    $("tab-chat").classList.toggle("active", chat);
    $("tab-live").classList.toggle("active", !chat);
    $("tab-chat").setAttribute("aria-pressed", String(chat));
    $("tab-live").setAttribute("aria-pressed", String(!chat));
    const url = new URL(location.href);
    if (chat) url.searchParams.delete("view"); else url.searchParams.set("view", "live");
    history.replaceState(null, "", url);
    clearInterval(live.timer);
    live.timer = null;
    if (!chat) {
      pollLive();
      live.timer = setInterval(pollLive, 1000);
    }
  }

  // ---------- start ----------

  function wire() {
    $("send").addEventListener("click", send);
    $("stop").addEventListener("click", stop);
    $("input").addEventListener("keydown", (ev) => {
      if (ev.key === "Enter" && !ev.shiftKey && !ev.isComposing) { ev.preventDefault(); send(); }
    });
    $("new-chat").addEventListener("click", () => { select(null).catch(fail); $("input").focus(); });
    $("show-archived").addEventListener("change", () => loadTree().catch(fail));
    $("qos").addEventListener("change", () => {  // with the tree operations, the class is the conversation's
      if (state.ops === true && state.current) patch({ qos: $("qos").value || null }).catch(fail);
    });
    $("rename").addEventListener("click", () => rename().catch(fail));
    $("archive").addEventListener("click", () => archive().catch(fail));
    $("delete").addEventListener("click", () => remove().catch(fail));
    $("key-ok").addEventListener("click", keyEntered);
    $("key-input").addEventListener("keydown", (ev) => { if (ev.key === "Enter") keyEntered(); });
    $("key-button").addEventListener("click", () => { sessionStorage.removeItem(KEY_ITEM); askKey("").then(start); });
    $("key-button").hidden = !sessionStorage.getItem(KEY_ITEM);
    document.addEventListener("visibilitychange", () => {  // back to this tab: what other tabs made since
      if (document.visibilityState === "visible" && document.body.dataset.ready === "1") loadTree().catch(fail);
    });
    $("tab-chat").addEventListener("click", () => showTab("chat"));
    $("tab-live").addEventListener("click", () => showTab("live"));
  }

  async function start() {
    try {
      await loadModels();
      await loadTree();
      await probeOps();
      const c = params.get("c");
      await select(c && state.convs.some((x) => x.id === c) ? c : null);
      document.body.dataset.ready = "1";
    } catch (e) {
      fail(e);
      document.body.dataset.ready = "error";
    }
  }

  // for the tests and the curious: the page's state, read only
  window.superfluid = { state, parseMetrics, byModel, quantile };
  wire();
  if (params.get("view") === "live") showTab("live");
  start();
})();

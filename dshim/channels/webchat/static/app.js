// dshim web chat: one websocket per tab, JSON text frames (README.md, "Web chat").
// No build step, no dependencies.  Nothing from the server or a user is ever parsed as
// HTML: every message is built from DOM nodes and text nodes (see renderText).
"use strict";

(function () {
  // The core's limits (dshim/pipeline/turn.py), checked before anything is uploaded.
  const MIB = 1024 * 1024;
  const IMAGE_MAX = 5 * MIB;
  const FILE_MAX = 20 * MIB;
  const TOTAL_MAX = 20 * MIB;
  const MAX_ATTACHMENTS = 20;
  const MAX_TEXT = 100000;
  const IMAGE_TYPES = ["image/png", "image/jpeg", "image/gif", "image/webp"];
  const RECONNECT_MIN_MS = 500;
  const RECONNECT_MAX_MS = 10000;
  const TYPING_MS = 30000;

  const $ = (id) => document.getElementById(id);
  const ui = {
    name: $("name"),
    newChat: $("new-chat"),
    newRoom: $("new-room"),
    roomForm: $("room-form"),
    roomName: $("room-name"),
    conversations: $("conversations"),
    title: $("title"),
    kind: $("kind"),
    status: $("status"),
    notice: $("notice"),
    messages: $("messages"),
    typing: $("typing"),
    composer: $("composer"),
    replyPreview: $("reply-preview"),
    replyCancel: $("reply-cancel"),
    attachments: $("attachments"),
    files: $("files"),
    input: $("input"),
  };

  // --- storage ----------------------------------------------------------------------

  function load(storage, key, fallback) {
    try {
      const raw = storage.getItem(key);
      return raw === null ? fallback : JSON.parse(raw);
    } catch (e) {
      return fallback;
    }
  }

  function save(storage, key, value) {
    try {
      storage.setItem(key, JSON.stringify(value));
    } catch (e) {
      /* full or disabled: the page still works for this visit */
    }
  }

  function randomId(prefix) {
    const bytes = new Uint8Array(8);
    crypto.getRandomValues(bytes);
    return prefix + Array.from(bytes, (b) => b.toString(16).padStart(2, "0")).join("");
  }

  // This tab's identity: kept per tab (sessionStorage, survives a reload) and remembered
  // for new tabs (localStorage).  Another name makes another user, so several tabs can
  // join one room as different people.
  function initialIdentity() {
    const mine = load(sessionStorage, "dshim.identity", null) || load(localStorage, "dshim.identity", null);
    if (mine && typeof mine.id === "string" && typeof mine.name === "string") return mine;
    return { id: randomId("u-"), name: "me" };
  }

  let identity = initialIdentity();
  save(sessionStorage, "dshim.identity", identity);

  function setName(name) {
    name = name.replace(/\s+/g, " ").trim().slice(0, 64);
    if (!name || name === identity.name) return;
    identity = { id: randomId("u-"), name: name };
    save(sessionStorage, "dshim.identity", identity);
    save(localStorage, "dshim.identity", identity);
    const conv = conversation(current);
    if (conv) send(joinFrame(conv));
    renderMessages();
  }

  // Conversations: {id, kind: "direct"|"room", title}, shared by the tabs of this browser.
  let conversations = load(localStorage, "dshim.conversations", []).filter(
    (c) => c && typeof c.id === "string" && (c.kind === "direct" || c.kind === "room"),
  );
  let current = load(sessionStorage, "dshim.current", null);
  // Sends not yet accepted, by client_id: sent again after a reconnect or a reload.
  const outbox = new Map(Object.entries(load(localStorage, "dshim.outbox", {})));

  function saveOutbox() {
    save(localStorage, "dshim.outbox", Object.fromEntries(outbox));
  }

  function saveConversations() {
    save(localStorage, "dshim.conversations", conversations);
  }

  window.addEventListener("storage", (event) => {
    if (event.key === "dshim.conversations") {
      conversations = load(localStorage, "dshim.conversations", conversations);
      renderSidebar();
    }
  });

  // --- conversation state -----------------------------------------------------------

  const messages = new Map(); // id -> message frame (plus pending/failed for our own)
  const pendingByClient = new Map(); // client_id -> element id of a bubble not accepted yet
  const interactions = new Map(); // id -> interaction frame
  const closedInteractions = new Set();
  let replyTo = null;
  let staged = []; // files chosen for the next message: {name, mime, size, file}
  let typingTimer = null;

  function conversation(id) {
    return conversations.find((c) => c.id === id) || null;
  }

  function addConversation(kind, id, title) {
    let conv = conversation(id);
    if (!conv) {
      conv = { id: id, kind: kind, title: title };
      conversations.unshift(conv);
      saveConversations();
    }
    switchTo(conv.id);
  }

  function newChat() {
    const n = conversations.filter((c) => c.kind === "direct").length + 1;
    addConversation("direct", randomId("c-"), "Chat " + n);
  }

  function roomSlug(name) {
    return name
      .toLowerCase()
      .normalize("NFKD")
      .replace(/[^a-z0-9]+/g, "-")
      .replace(/^-+|-+$/g, "")
      .slice(0, 60);
  }

  function joinRoom(name) {
    const slug = roomSlug(name);
    if (!slug) return showNotice("A room name needs at least one letter or digit.");
    addConversation("room", "room-" + slug, "# " + slug);
  }

  function switchTo(id) {
    if (current !== null && current !== id) send({ type: "leave", conversation: current });
    current = id;
    save(sessionStorage, "dshim.current", id);
    messages.clear();
    pendingByClient.clear();
    interactions.clear();
    closedInteractions.clear();
    setReply(null);
    hideTyping();
    renderSidebar();
    renderHeader();
    renderMessages();
    const conv = conversation(id);
    if (conv) send(joinFrame(conv));
  }

  // --- the socket ---------------------------------------------------------------------

  let ws = null;
  let attempts = 0;

  function socketUrl() {
    // Relative to the page: /ws for the page at /, /hooks/<bot>/ws for /hooks/<bot>/.
    const url = new URL("ws", location.href);
    url.protocol = url.protocol === "https:" ? "wss:" : "ws:";
    url.search = "";
    url.hash = "";
    return url.toString();
  }

  function connect() {
    setStatus("connecting…", false);
    const socket = new WebSocket(socketUrl());
    ws = socket;
    socket.addEventListener("open", () => {
      attempts = 0;
      setStatus("connected", true);
      // Join at once: dshim closes a socket that has not joined within 10 s.
      const conv = conversation(current);
      if (conv) socket.send(JSON.stringify(joinFrame(conv)));
      resendOutbox(socket);
    });
    socket.addEventListener("message", (event) => {
      let frame;
      try {
        frame = JSON.parse(event.data);
      } catch (e) {
        return;
      }
      onFrame(frame);
    });
    // Whatever closed it (dshim restarting, too many open tabs, a socket that had not
    // joined within 10 s: the page joins on "open", so never this one), try again.
    socket.addEventListener("close", (event) => {
      if (ws !== socket) return;
      ws = null;
      attempts += 1;
      const delay = Math.min(RECONNECT_MAX_MS, RECONNECT_MIN_MS * 2 ** (attempts - 1));
      const jittered = delay / 2 + Math.random() * (delay / 2);
      // 1013 "try again later" says why (too many open tabs): show it while retrying.
      const why = event.code === 1013 && event.reason ? event.reason + ": " : "";
      setStatus(why + "reconnecting…", false);
      setTimeout(connect, jittered);
    });
  }

  function send(frame) {
    if (ws && ws.readyState === WebSocket.OPEN) {
      ws.send(JSON.stringify(frame));
      return true;
    }
    return false;
  }

  function joinFrame(conv) {
    return { type: "join", conversation: conv.id, kind: conv.kind, user: identity };
  }

  function resendOutbox(socket) {
    const joined = new Set([current]);
    for (const entry of outbox.values()) {
      const conv = conversation(entry.frame.conversation);
      if (!conv) continue;
      if (!joined.has(conv.id)) {
        socket.send(JSON.stringify(joinFrame(conv)));
        joined.add(conv.id);
      }
      socket.send(JSON.stringify(entry.frame));
    }
  }

  // --- frames from dshim --------------------------------------------------------------

  function onFrame(frame) {
    switch (frame.type) {
      case "history":
        if (frame.conversation !== current) return;
        for (const m of frame.messages) messages.set(m.id, m);
        renderMessages();
        return;
      case "message":
        onMessage(frame);
        return;
      case "accepted":
        onAccepted(frame);
        return;
      case "interaction":
        if (frame.conversation !== current) return;
        interactions.set(frame.id, frame);
        rerender(frame.id);
        return;
      case "interaction_closed":
        closedInteractions.add(frame.id);
        rerender(frame.id);
        return;
      case "typing":
        if (frame.conversation === current) showTyping(frame.name);
        return;
      case "error":
        onError(frame);
        return;
      default:
        return;
    }
  }

  function onMessage(frame) {
    if (frame.author && frame.author.bot && frame.conversation === current) hideTyping();
    if (frame.client_id && outbox.has(frame.client_id) && frame.author.id === identity.id) {
      const entry = outbox.get(frame.client_id);
      entry.id = frame.id;
    }
    if (frame.conversation !== current) return;
    const pending = frame.client_id ? pendingByClient.get(frame.client_id) : undefined;
    if (pending !== undefined && frame.author.id === identity.id) {
      messages.delete(pending);
      pendingByClient.delete(frame.client_id);
    }
    messages.set(frame.id, frame);
    renderMessages();
  }

  function onAccepted(frame) {
    outbox.delete(frame.client_id);
    saveOutbox();
    const pending = pendingByClient.get(frame.client_id);
    if (pending !== undefined) {
      const m = messages.get(pending);
      pendingByClient.delete(frame.client_id);
      messages.delete(pending);
      if (m && !messages.has(frame.id)) {
        m.id = frame.id;
        m.pending = false;
        messages.set(frame.id, m);
      }
      renderMessages();
    }
  }

  function onError(frame) {
    const cid = frame.client_id;
    // dshim is restarting: the message stays in the outbox and goes again on reconnect.
    if (cid && frame.code === "unavailable") return;
    if (cid) {
      outbox.delete(cid);
      saveOutbox();
      const pending = pendingByClient.get(cid);
      if (pending !== undefined) markFailed(pending, "not sent: " + frame.message);
    }
    showNotice(frame.message);
  }

  // --- sending ------------------------------------------------------------------------

  function checkFiles(files) {
    if (files.length > MAX_ATTACHMENTS) {
      return `${files.length} attachments: at most ${MAX_ATTACHMENTS} per message.`;
    }
    let total = 0;
    for (const f of files) {
      const image = IMAGE_TYPES.includes(f.mime);
      const limit = image ? IMAGE_MAX : FILE_MAX;
      if (f.size > limit) {
        return `${f.name} is ${size(f.size)}: ${image ? "an image" : "a file"} can be at most ${size(limit)}.`;
      }
      total += f.size;
    }
    if (total > TOTAL_MAX) {
      return `The attachments add up to ${size(total)}: one message can carry at most ${size(TOTAL_MAX)}.`;
    }
    return null;
  }

  function size(n) {
    return n >= MIB ? (n / MIB).toFixed(1) + " MiB" : n + " bytes";
  }

  function readBase64(file) {
    return new Promise((resolve, reject) => {
      const reader = new FileReader();
      reader.onload = () => resolve(String(reader.result).replace(/^data:[^,]*,/, ""));
      reader.onerror = () => reject(reader.error);
      reader.readAsDataURL(file);
    });
  }

  async function submit() {
    const conv = conversation(current);
    if (!conv) return;
    const text = ui.input.value;
    if (!text.trim() && staged.length === 0 && replyTo === null) return;
    if (text.length > MAX_TEXT) return showNotice(`The message is longer than ${MAX_TEXT} characters.`);
    const problem = checkFiles(staged);
    if (problem) return showNotice(problem);
    hideNotice();
    let files;
    try {
      files = await Promise.all(
        staged.map(async (f) => ({ name: f.name, mime: f.mime, data_b64: await readBase64(f.file) })),
      );
    } catch (e) {
      return showNotice("A file could not be read: " + e);
    }
    const clientId = randomId("k-");
    const frame = {
      type: "send",
      client_id: clientId,
      conversation: conv.id,
      text: text,
      reply_to: replyTo,
      files: files,
    };
    if (conv.kind === "direct" && text.trim() && /^Chat \d+$/.test(conv.title)) {
      conv.title = text.trim().slice(0, 40);
      saveConversations();
      renderSidebar();
      renderHeader();
    }
    const localId = "local:" + clientId;
    messages.set(localId, {
      id: localId,
      conversation: conv.id,
      author: { id: identity.id, name: identity.name, bot: false },
      text: text,
      reply_to: replyTo,
      at: new Date().toISOString(),
      final: true,
      files: staged.map((f) => ({ kind: IMAGE_TYPES.includes(f.mime) ? "image" : "file", name: f.name })),
      client_id: clientId,
      pending: true,
    });
    pendingByClient.set(clientId, localId);
    // Large uploads are not kept for a resend after a reload (storage is small).
    const keep = files.reduce((n, f) => n + f.data_b64.length, 0) < 2 * MIB;
    if (keep) {
      outbox.set(clientId, { frame: frame });
      saveOutbox();
    }
    ui.input.value = "";
    staged = [];
    ui.files.value = "";
    renderStaged();
    setReply(null);
    renderMessages();
    if (!send(frame) && !keep) {
      markFailed(localId, "not sent: dshim is not reachable");
    }
  }

  function markFailed(localId, why) {
    const m = messages.get(localId);
    if (m) {
      m.pending = false;
      m.failed = why;
      rerender(localId);
    }
  }

  function answer(interaction, option, buttons) {
    const clientId = randomId("k-");
    const sent = send({
      type: "answer",
      client_id: clientId,
      conversation: interaction.conversation,
      interaction: interaction.id,
      option: option.id,
    });
    if (!sent) return showNotice("Not connected: answer again in a moment, or type the answer.");
    for (const b of buttons.querySelectorAll("button")) b.disabled = true;
  }

  // --- rendering ----------------------------------------------------------------------

  function setStatus(text, online) {
    ui.status.textContent = text;
    ui.status.classList.toggle("offline", !online);
  }

  function showNotice(text) {
    ui.notice.textContent = text;
    ui.notice.hidden = false;
  }

  function hideNotice() {
    ui.notice.hidden = true;
  }

  function showTyping(name) {
    ui.typing.textContent = `${name} is writing…`;
    ui.typing.hidden = false;
    clearTimeout(typingTimer);
    typingTimer = setTimeout(hideTyping, TYPING_MS);
  }

  function hideTyping() {
    ui.typing.hidden = true;
    clearTimeout(typingTimer);
  }

  function renderSidebar() {
    ui.conversations.replaceChildren(
      ...conversations.map((c) => {
        const b = document.createElement("button");
        b.type = "button";
        b.textContent = c.title || c.id;
        b.title = c.kind === "room" ? `room ${c.id}` : c.id;
        b.dataset.conversation = c.id;
        if (c.id === current) b.classList.add("current");
        b.addEventListener("click", () => switchTo(c.id));
        return b;
      }),
    );
  }

  function renderHeader() {
    const conv = conversation(current);
    ui.title.textContent = conv ? conv.title : "dshim";
    ui.kind.textContent = conv
      ? conv.kind === "room"
        ? "room — the bot answers when you write @ and its name"
        : "direct chat"
      : "";
  }

  function ordered() {
    return Array.from(messages.values()).sort((a, b) => (a.at < b.at ? -1 : a.at > b.at ? 1 : 0));
  }

  function renderMessages() {
    const stick = ui.messages.scrollHeight - ui.messages.scrollTop - ui.messages.clientHeight < 80;
    // An answer right under the message it answers needs no quote shown above it.
    ui.messages.replaceChildren(...ordered().map((m, i, all) => messageElement(m, all[i - 1])));
    if (stick) ui.messages.scrollTop = ui.messages.scrollHeight;
  }

  function rerender(id) {
    const old = ui.messages.querySelector(`li[data-id="${CSS.escape(id)}"]`);
    const m = messages.get(id);
    if (old && m) {
      const before = old.previousElementSibling;
      old.replaceWith(messageElement(m, before ? messages.get(before.dataset.id) : undefined));
    }
  }

  function messageElement(m, previous) {
    const li = document.createElement("li");
    li.className = "msg";
    li.dataset.id = m.id;
    const mine = !m.author.bot && m.author.id === identity.id;
    li.classList.add(m.author.bot ? "bot" : mine ? "mine" : "other");
    if (m.pending) li.classList.add("pending");
    if (m.failed) li.classList.add("failed");
    if (!m.final) li.classList.add("streaming");

    const meta = document.createElement("div");
    meta.className = "meta";
    const author = document.createElement("span");
    author.className = "author";
    author.textContent = m.author.name || m.author.id;
    const time = document.createElement("time");
    time.dateTime = m.at;
    time.textContent = new Date(m.at).toLocaleTimeString([], { hour: "2-digit", minute: "2-digit" });
    meta.append(author, time);
    const state = m.failed ? m.failed : m.pending ? "sending…" : !m.final ? "writing…" : "";
    if (state) {
      const s = document.createElement("span");
      s.className = "state";
      s.textContent = state;
      meta.append(s);
    }
    if (!m.pending && !m.failed && !m.id.startsWith("local:")) {
      const reply = document.createElement("button");
      reply.type = "button";
      reply.className = "reply";
      reply.textContent = "Reply";
      reply.addEventListener("click", () => setReply(m.id));
      meta.append(reply);
    }
    li.append(meta);

    const adjacent = m.author.bot && previous && previous.id === m.reply_to;
    if (m.reply_to && !adjacent) li.append(quoteElement(m.reply_to));
    const body = document.createElement("div");
    body.className = "body";
    body.append(renderText(m.text));
    li.append(body);

    if (m.files && m.files.length) {
      const ul = document.createElement("ul");
      ul.className = "files";
      for (const f of m.files) {
        const item = document.createElement("li");
        item.textContent = (f.kind === "image" ? "🖼 " : "📄 ") + (f.name || f.kind);
        ul.append(item);
      }
      li.append(ul);
    }

    const interaction = interactions.get(m.id);
    if (interaction && !closedInteractions.has(m.id)) {
      const buttons = document.createElement("div");
      buttons.className = "buttons";
      for (const option of interaction.options) {
        const b = document.createElement("button");
        b.type = "button";
        b.textContent = option.label;
        b.dataset.option = option.id;
        b.addEventListener("click", () => answer(interaction, option, buttons));
        buttons.append(b);
      }
      li.append(buttons);
    }
    return li;
  }

  function quoteElement(id) {
    const q = document.createElement("blockquote");
    q.className = "quote";
    const quoted = messages.get(id);
    if (quoted) {
      const who = quoted.author.name || quoted.author.id;
      q.textContent = `${who}: ${summary(quoted)}`;
    } else {
      q.textContent = "↪ an earlier message";
    }
    return q;
  }

  function summary(m) {
    const text = m.text.replace(/\s+/g, " ").trim();
    if (text) return text.length > 140 ? text.slice(0, 139) + "…" : text;
    return (m.files || []).map((f) => f.name || f.kind).join(", ") || "(empty)";
  }

  function setReply(id) {
    replyTo = id;
    const quoted = id ? messages.get(id) : null;
    if (!quoted) {
      replyTo = null;
      ui.replyPreview.hidden = true;
      return;
    }
    ui.replyPreview.querySelector(".label").textContent =
      `Replying to ${quoted.author.name || quoted.author.id}: ${summary(quoted)}`;
    ui.replyPreview.hidden = false;
    ui.input.focus();
  }

  function renderStaged() {
    ui.attachments.replaceChildren(
      ...staged.map((f) => {
        const li = document.createElement("li");
        li.textContent = `${IMAGE_TYPES.includes(f.mime) ? "🖼" : "📄"} ${f.name} (${size(f.size)})`;
        return li;
      }),
    );
  }

  // The Markdown subset: paragraphs, ``` code blocks, `inline code`, [text](url) and bare
  // http(s) links.  Everything else is text.  Only DOM nodes and text nodes are made; a
  // link gets an href only when it parses as http: or https:.
  function renderText(text) {
    const out = document.createDocumentFragment();
    const lines = String(text).replace(/\r\n?/g, "\n").split("\n");
    let para = [];
    let code = null;
    const flush = () => {
      if (para.length) {
        const p = document.createElement("p");
        para.forEach((line, i) => {
          if (i) p.append(document.createElement("br"));
          inline(p, line);
        });
        out.append(p);
        para = [];
      }
    };
    for (const line of lines) {
      if (code !== null) {
        if (/^\s*```\s*$/.test(line)) {
          const pre = document.createElement("pre");
          const c = document.createElement("code");
          c.textContent = code.join("\n");
          pre.append(c);
          out.append(pre);
          code = null;
        } else {
          code.push(line);
        }
      } else if (/^\s*```/.test(line)) {
        flush();
        code = [];
      } else if (!line.trim()) {
        flush();
      } else {
        para.push(line);
      }
    }
    if (code !== null) {
      const pre = document.createElement("pre");
      const c = document.createElement("code");
      c.textContent = code.join("\n");
      pre.append(c);
      out.append(pre);
    }
    flush();
    return out;
  }

  const INLINE = /`([^`\n]+)`|\[([^\]\n]+)\]\(([^)\s]+)\)|(https?:\/\/[^\s<>()]+[^\s<>().,;:!?'"])/g;

  function inline(parent, line) {
    let last = 0;
    for (const match of line.matchAll(INLINE)) {
      if (match.index > last) parent.append(document.createTextNode(line.slice(last, match.index)));
      if (match[1] !== undefined) {
        const c = document.createElement("code");
        c.textContent = match[1];
        parent.append(c);
      } else if (match[2] !== undefined) {
        parent.append(link(match[2], match[3]) || document.createTextNode(match[0]));
      } else {
        parent.append(link(match[4], match[4]) || document.createTextNode(match[0]));
      }
      last = match.index + match[0].length;
    }
    if (last < line.length) parent.append(document.createTextNode(line.slice(last)));
  }

  function link(label, href) {
    let url;
    try {
      url = new URL(href);
    } catch (e) {
      return null;
    }
    if (url.protocol !== "http:" && url.protocol !== "https:") return null;
    const a = document.createElement("a");
    a.href = url.href;
    a.textContent = label;
    a.rel = "noopener noreferrer nofollow";
    a.target = "_blank";
    return a;
  }

  // --- events -------------------------------------------------------------------------

  ui.name.value = identity.name;
  ui.name.addEventListener("change", () => setName(ui.name.value));
  ui.newChat.addEventListener("click", newChat);
  ui.newRoom.addEventListener("click", () => {
    ui.roomForm.hidden = !ui.roomForm.hidden;
    if (!ui.roomForm.hidden) ui.roomName.focus();
  });
  ui.roomForm.addEventListener("submit", (event) => {
    event.preventDefault();
    joinRoom(ui.roomName.value);
    ui.roomName.value = "";
    ui.roomForm.hidden = true;
  });
  ui.composer.addEventListener("submit", (event) => {
    event.preventDefault();
    submit();
  });
  ui.input.addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      submit();
    }
  });
  ui.replyCancel.addEventListener("click", () => setReply(null));
  ui.files.addEventListener("change", () => {
    staged = Array.from(ui.files.files, (f) => ({
      name: f.name,
      mime: f.type || "application/octet-stream",
      size: f.size,
      file: f,
    }));
    renderStaged();
    const problem = checkFiles(staged);
    if (problem) showNotice(problem);
    else hideNotice();
  });

  if (!conversation(current)) current = conversations.length ? conversations[0].id : null;
  if (current === null) {
    newChat();
  } else {
    switchTo(current);
  }
  connect();
})();

// The chat playground: a conversation streamed through /v1/chat/completions, like any OpenAI client would.
// URLs are relative, so the page also works behind a proxy that serves Ferry under a path prefix.
//
// Everything the model says reaches the page through FerryMarkdown.render or textContent, never innerHTML.
// The model picker lists the base model and its LoRA adapters (the cards of /v1/models with a `parent`), read
// again whenever it is opened, so adapters loaded while serving show up.
// With `ferry serve --api-key`, /v1/* answers 401 until the page sends the key: the page asks for it once,
// keeps it in sessionStorage (this tab only) and sends it as `Authorization: Bearer`.
"use strict";

const FerryChat = (() => {
  const KEY_STORAGE = "ferry.apiKey";
  const $ = (id) => document.getElementById(id);

  const state = {
    model: null, // what requests send as `model`: the base model's name or an adapter's
    history: [], // {role, content, node}: what the next request sends (node: its <article>)
    attachments: [], // data: URLs of the images attached to the next message
    controller: null, // the AbortController of the answer being streamed, if any
  };

  // ------------------------------------------------------------------------------------------ API access

  function authHeaders() {
    const key = sessionStorage.getItem(KEY_STORAGE);
    return key ? { Authorization: `Bearer ${key}` } : {};
  }

  class APIError extends Error {
    constructor(message, status) {
      super(message);
      this.status = status;
    }
  }

  // An error response (OpenAI's {"error": {"message": ...}}) as an APIError.
  async function responseError(response) {
    let message = `${response.status} ${response.statusText}`;
    try {
      const body = await response.json();
      if (body && body.error && body.error.message) message = body.error.message;
    } catch {
      // not JSON: keep the status line
    }
    return new APIError(message, response.status);
  }

  // The events of an OpenAI stream (`data: {json}` ... `data: [DONE]`), yielded as one array per network read,
  // so that the page redraws once per read rather than once per token.
  async function* sseEvents(body) {
    const reader = body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buffer += decoder.decode(value, { stream: true });
      const events = [];
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const frame = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        for (const line of frame.split("\n")) {
          if (!line.startsWith("data:")) continue;
          const data = line.slice(5).trim();
          if (data === "[DONE]") {
            if (events.length) yield events;
            return;
          }
          events.push(JSON.parse(data));
        }
      }
      if (events.length) yield events;
    }
  }

  // Fold tool-call deltas into `calls` (by index), the way the OpenAI SDKs accumulate a stream: strings
  // (name, arguments) arrive in pieces and are concatenated. A whole `message.tool_calls` array (no index)
  // folds the same way. Tools are not in Ferry's API yet; this is ready for when they are.
  function mergeToolCalls(calls, deltas) {
    deltas.forEach((delta, position) => {
      const index = Number.isInteger(delta.index) ? delta.index : position;
      const call = calls[index] || (calls[index] = { id: "", name: "", arguments: "" });
      if (delta.id) call.id = delta.id;
      const fn = delta.function || {};
      if (typeof fn.name === "string") call.name += fn.name;
      if (typeof fn.arguments === "string") call.arguments += fn.arguments;
    });
    return calls;
  }

  // ------------------------------------------------------------------------------------------ connecting

  function setStatus(text, kind) {
    const status = $("server-status");
    status.textContent = text;
    status.dataset.kind = kind;
  }

  function setReady(ready) {
    $("send").disabled = !ready;
    $("prompt").disabled = !ready;
    updateRegenerate();
  }

  // /v1/models gives the served model's name and its context length, and is the one call that tells whether a
  // key is needed (401). While the model loads it says 503: try again shortly.
  async function connect() {
    let response;
    try {
      response = await fetch("v1/models", { headers: authHeaders() });
    } catch {
      setStatus("server unreachable", "error");
      setTimeout(connect, 2000);
      return;
    }
    if (response.status === 401) {
      setStatus("API key required", "error");
      $("key-button").hidden = false;
      askForKey(sessionStorage.getItem(KEY_STORAGE) ? "The server refused that key." : "");
      return;
    }
    if (!response.ok) {
      const error = await responseError(response);
      setStatus(response.status === 503 ? "loading model…" : error.message, "waiting");
      setTimeout(connect, 1000);
      return;
    }
    const models = await response.json();
    const card = models.data[0];
    showModels(models.data);
    if (card.max_model_len) {
      $("max-tokens").max = card.max_model_len;
      $("model-name").title = `Served model · context ${card.max_model_len} tokens`;
    }
    setStatus("ready", "ok");
    showTask(card);
    if (card.pooling && !card.pooling.generates) {
      // An embedding model or a cross-encoder: nothing to chat with (the server would refuse every message).
      const task = POOLING_TASKS[card.pooling.kind];
      $("empty-hint").textContent = `${card.id} is a pooling model (${task.name.toLowerCase()}) and does not ` +
        `chat: call ${task.endpoints} from any OpenAI-compatible client.`;
      setReady(false);
      return;
    }
    setReady(true);
    $("prompt").focus();
  }

  // The picker's choices: the base model under its first name (the others are aliases) and every LoRA adapter,
  // keeping the current choice while it is still served; shown only when there is a choice.
  function showModels(cards) {
    const select = $("model-select");
    const choices = [cards[0], ...cards.filter((card) => card.parent)];
    const current = state.model;
    select.replaceChildren(
      ...choices.map((card) => {
        const option = document.createElement("option");
        option.value = card.id;
        option.textContent = card.parent ? `${card.id} (LoRA adapter of ${card.parent})` : card.id;
        return option;
      }),
    );
    if (choices.some((card) => card.id === current)) select.value = current;
    $("model-picker").hidden = choices.length < 2;
    chooseModel();
  }

  function chooseModel() {
    state.model = $("model-select").value;
    $("model-name").textContent = state.model;
  }

  // Adapters come and go while serving: the list is read again as the picker opens.
  async function refreshModels() {
    try {
      const response = await fetch("v1/models", { headers: authHeaders() });
      if (response.ok) showModels((await response.json()).data);
    } catch {
      // unreachable for now: keep the list as it is
    }
  }

  const POOLING_TASKS = {
    embed: { name: "Embedding model", endpoints: "/v1/embeddings, /v1/score, /v1/rerank" },
    classify: { name: "Cross-encoder", endpoints: "/v1/score, /v1/rerank" },
    yes_no: { name: "Yes/no reranker", endpoints: "/v1/score, /v1/rerank" },
  };

  // What the model serves besides chat, from its card's `pooling` (absent for a model that only generates).
  function showTask(card) {
    const caption = $("model-task");
    const pooling = card.pooling;
    caption.hidden = !pooling;
    if (!pooling) return;
    const task = POOLING_TASKS[pooling.kind];
    const size = pooling.kind === "embed" ? ` of ${pooling.dimensions} dimensions` : "";
    caption.textContent = `${task.name}${size}: ${task.endpoints}${pooling.generates ? ", and chat" : ""}`;
    caption.dataset.kind = pooling.kind;
  }

  function askForKey(error) {
    const dialog = $("key-dialog");
    $("key-error").textContent = error;
    $("key-error").hidden = !error;
    $("key-input").value = "";
    if (!dialog.open) dialog.showModal();
    $("key-input").focus();
  }

  function onKeySubmit(event) {
    event.preventDefault();
    const key = $("key-input").value.trim();
    if (!key) return;
    sessionStorage.setItem(KEY_STORAGE, key);
    $("key-dialog").close();
    setReady(false);
    connect();
  }

  // -------------------------------------------------------------------------------------------- messages

  function addMessage(role, text, images = []) {
    $("empty-hint").hidden = true;
    const article = document.createElement("article");
    article.className = `msg ${role}`;
    const label = document.createElement("div");
    label.className = "role";
    label.textContent = role;
    const body = document.createElement("div");
    body.className = role === "assistant" ? "body md" : "body plain";
    body.textContent = text; // user text is shown exactly as typed
    if (images.length) {
      const strip = document.createElement("div");
      strip.className = "msg-images";
      for (const url of images) {
        const img = document.createElement("img");
        img.src = url;
        img.alt = "attached image";
        strip.append(img);
      }
      body.prepend(strip);
    }
    if (role === "assistant") {
      // The model's reasoning (`reasoning_content`), apart from the answer and folded once the answer starts.
      const reasoning = document.createElement("details");
      reasoning.className = "reasoning";
      reasoning.hidden = true;
      reasoning.open = true;
      const summary = document.createElement("summary");
      summary.textContent = "Reasoning";
      const thoughts = document.createElement("div");
      thoughts.className = "reasoning-body";
      reasoning.append(summary, thoughts);
      article.append(label, reasoning, body);
    } else {
      article.append(label, body);
    }
    if (role === "assistant") {
      const tools = document.createElement("div");
      tools.className = "tool-calls";
      const meta = document.createElement("div");
      meta.className = "meta";
      article.append(tools, meta);
    }
    $("messages").append(article);
    scrollToEnd();
    return article;
  }

  function scrollToEnd() {
    const messages = $("messages");
    messages.scrollTop = messages.scrollHeight;
  }

  function renderToolCalls(container, calls) {
    container.replaceChildren(
      ...calls.filter(Boolean).map((call) => {
        const box = document.createElement("div");
        box.className = "tool-call";
        const name = document.createElement("div");
        name.className = "tool-name";
        name.textContent = `tool call · ${call.name || "?"}`;
        const args = document.createElement("pre");
        args.className = "tool-arguments";
        let text = call.arguments;
        try {
          text = JSON.stringify(JSON.parse(call.arguments), null, 2); // pretty once the arguments are complete
        } catch {
          // still streaming, or not JSON: show as received
        }
        args.textContent = text;
        box.append(name, args);
        return box;
      }),
    );
  }

  function formatMs(ms) {
    return ms < 1000 ? `${Math.round(ms)} ms` : `${(ms / 1000).toFixed(2)} s`;
  }

  // The line under an answer: tokens, time to first token, decode speed, how it ended.
  function describe(result) {
    const parts = [];
    if (result.usage) {
      parts.push(`${result.usage.completion_tokens} tokens`, `prompt ${result.usage.prompt_tokens}`);
    }
    if (result.ttft !== null) parts.push(`TTFT ${formatMs(result.ttft)}`);
    if (result.usage && result.usage.completion_tokens > 1 && result.ttft !== null) {
      const seconds = (result.elapsed - result.ttft) / 1000;
      if (seconds > 0) parts.push(`${((result.usage.completion_tokens - 1) / seconds).toFixed(1)} tok/s`);
    }
    if (result.finish) parts.push(`finish: ${result.finish}`);
    if (result.outcome === "stopped") parts.push("stopped");
    return parts.join(" · ");
  }

  // ---------------------------------------------------------------------------------------------- asking

  function settings() {
    const temperature = parseFloat($("temperature").value);
    const maxTokens = parseInt($("max-tokens").value, 10);
    return {
      system: $("system-prompt").value.trim(),
      temperature: Number.isFinite(temperature) ? temperature : 0.7,
      maxTokens: Number.isFinite(maxTokens) && maxTokens > 0 ? maxTokens : null,
      jsonMode: $("json-mode").checked,
    };
  }

  function requestBody() {
    const { system, temperature, maxTokens, jsonMode } = settings();
    const messages = [];
    if (system) messages.push({ role: "system", content: system });
    for (const entry of state.history) {
      if (entry.content) messages.push({ role: entry.role, content: entry.content });
    }
    const body = {
      model: state.model,
      messages,
      stream: true,
      stream_options: { include_usage: true },
      temperature,
    };
    if (maxTokens) body.max_tokens = maxTokens;
    if (jsonMode) body.response_format = { type: "json_object" };
    return body;
  }

  // Reasoning streams open; it folds once the answer itself starts (a click opens it again).
  function showReasoning(box, thoughts, reasoning, content) {
    if (!reasoning) return;
    box.hidden = false;
    if (thoughts.textContent !== reasoning) thoughts.textContent = reasoning;
    if (content && !box.dataset.folded) {
      box.open = false;
      box.dataset.folded = "1";
    }
  }

  // A JSON-mode answer is shown as the JSON it is: indented once it parses, as written while it streams.
  function renderAnswer(content, jsonMode) {
    if (!jsonMode) return FerryMarkdown.render(content);
    const pre = document.createElement("pre");
    pre.className = "json-answer";
    try {
      pre.textContent = JSON.stringify(JSON.parse(content), null, 2);
      pre.dataset.valid = "true";
    } catch {
      pre.textContent = content;
    }
    return pre;
  }

  function setBusy(busy) {
    $("send").hidden = busy;
    $("stop").hidden = !busy; // the prompt stays editable: the next question can be typed meanwhile
    updateRegenerate();
    if (!busy) $("prompt").focus();
  }

  function updateRegenerate() {
    const last = state.history[state.history.length - 1];
    $("regenerate").disabled = state.controller !== null || !state.model || !last || last.role !== "assistant";
  }

  // Stream one answer to the conversation so far into a new assistant message.
  async function answer() {
    const article = addMessage("assistant", "");
    const body = article.querySelector(".body");
    const meta = article.querySelector(".meta");
    const toolBox = article.querySelector(".tool-calls");
    const reasoningBox = article.querySelector(".reasoning");
    const thoughts = reasoningBox.querySelector(".reasoning-body");
    const jsonMode = settings().jsonMode;
    const entry = { role: "assistant", content: "", node: article };
    const controller = new AbortController();
    state.controller = controller;
    setBusy(true);
    article.dataset.state = "streaming";
    meta.textContent = "waiting for the first token…";

    const started = performance.now();
    const result = { ttft: null, usage: null, finish: null, elapsed: 0, outcome: "done" };
    const toolCalls = [];
    let content = "";
    let reasoning = "";
    try {
      const response = await fetch("v1/chat/completions", {
        method: "POST",
        headers: { "Content-Type": "application/json", ...authHeaders() },
        body: JSON.stringify(requestBody()),
        signal: controller.signal,
      });
      if (!response.ok) throw await responseError(response);
      for await (const events of sseEvents(response.body)) {
        for (const event of events) {
          if (event.error) throw new APIError(event.error.message, 500);
          if (event.usage) result.usage = event.usage;
          for (const choice of event.choices || []) {
            const delta = choice.delta || choice.message || {};
            if (typeof delta.content === "string" && delta.content) content += delta.content;
            if (typeof delta.reasoning_content === "string") reasoning += delta.reasoning_content;
            if (Array.isArray(delta.tool_calls)) mergeToolCalls(toolCalls, delta.tool_calls);
            if (result.ttft === null && (delta.content || delta.reasoning_content || delta.tool_calls)) {
              result.ttft = performance.now() - started;
            }
            if (choice.finish_reason) result.finish = choice.finish_reason;
          }
        }
        showReasoning(reasoningBox, thoughts, reasoning, content);
        body.replaceChildren(renderAnswer(content, jsonMode));
        renderToolCalls(toolBox, toolCalls);
        if (result.ttft !== null) meta.textContent = `streaming… TTFT ${formatMs(result.ttft)}`;
        scrollToEnd();
      }
    } catch (error) {
      if (error.name === "AbortError") {
        result.outcome = "stopped";
      } else {
        result.outcome = "error";
        const problem = document.createElement("div");
        problem.className = "error";
        problem.textContent = error.message || String(error);
        article.append(problem);
        if (error.status === 401) askForKey("The server refused the key.");
      }
    }
    result.elapsed = performance.now() - started;
    showReasoning(reasoningBox, thoughts, reasoning, content);
    body.replaceChildren(renderAnswer(content, jsonMode));
    renderToolCalls(toolBox, toolCalls);
    entry.content = content;
    if (article.isConnected) state.history.push(entry); // not when Clear removed it mid-stream
    article.dataset.state = result.outcome;
    if (result.usage) article.dataset.completionTokens = result.usage.completion_tokens;
    if (result.ttft !== null) article.dataset.ttftMs = result.ttft.toFixed(1);
    meta.textContent = describe(result);
    state.controller = null;
    setBusy(false);
    scrollToEnd();
  }

  // Images go with the next message as image_url parts (data: URLs): what an OpenAI client sends.
  function showAttachments() {
    const box = $("attachments");
    box.replaceChildren(
      ...state.attachments.map((url, index) => {
        const item = document.createElement("button");
        item.type = "button";
        item.className = "attachment";
        item.title = "Remove";
        const img = document.createElement("img");
        img.src = url;
        img.alt = `attachment ${index + 1}`;
        item.append(img);
        item.addEventListener("click", () => {
          state.attachments.splice(index, 1);
          showAttachments();
        });
        return item;
      }),
    );
    box.hidden = state.attachments.length === 0;
  }

  function attach(files) {
    for (const file of files) {
      if (!file.type.startsWith("image/")) continue;
      const reader = new FileReader();
      reader.onload = () => {
        state.attachments.push(reader.result);
        showAttachments();
      };
      reader.readAsDataURL(file);
    }
  }

  function onSend(event) {
    event.preventDefault();
    const text = $("prompt").value.trim();
    if ((!text && !state.attachments.length) || state.controller || !state.model) return;
    $("prompt").value = "";
    const images = state.attachments;
    state.attachments = [];
    showAttachments();
    const content = images.length
      ? [...images.map((url) => ({ type: "image_url", image_url: { url } })), { type: "text", text }]
      : text;
    state.history.push({ role: "user", content, node: addMessage("user", text, images) });
    answer();
  }

  function onStop() {
    if (state.controller) state.controller.abort();
  }

  // Ask again for the last answer: drop it and stream a new one to the same conversation.
  function onRegenerate() {
    const last = state.history[state.history.length - 1];
    if (state.controller || !last || last.role !== "assistant") return;
    state.history.pop();
    last.node.remove();
    answer();
  }

  function onClear() {
    onStop();
    state.history = [];
    state.attachments = [];
    showAttachments();
    for (const node of $("messages").querySelectorAll(".msg")) node.remove();
    $("empty-hint").hidden = false;
    updateRegenerate();
  }

  function start() {
    $("composer").addEventListener("submit", onSend);
    $("prompt").addEventListener("keydown", (event) => {
      // Enter sends, Shift+Enter is a new line; not while an input method is composing a character.
      if (event.key === "Enter" && !event.shiftKey && !event.isComposing) onSend(event);
    });
    $("stop").addEventListener("click", onStop);
    $("regenerate").addEventListener("click", onRegenerate);
    $("clear").addEventListener("click", onClear);
    $("image-input").addEventListener("change", (event) => {
      attach(event.target.files);
      event.target.value = ""; // the same file may be attached again
    });
    const composer = $("composer");
    composer.addEventListener("dragover", (event) => event.preventDefault());
    composer.addEventListener("drop", (event) => {
      event.preventDefault();
      attach(event.dataTransfer.files);
    });
    $("key-form").addEventListener("submit", onKeySubmit);
    $("key-button").addEventListener("click", () => askForKey(""));
    $("model-select").addEventListener("change", chooseModel);
    $("model-select").addEventListener("focus", refreshModels);
    const temperature = $("temperature");
    const shown = () => ($("temperature-value").textContent = parseFloat(temperature.value).toFixed(2));
    temperature.addEventListener("input", shown);
    shown();
    setReady(false);
    connect();
  }

  return { start, mergeToolCalls, sseEvents };
})();

window.FerryChat = FerryChat;
document.addEventListener("DOMContentLoaded", FerryChat.start);

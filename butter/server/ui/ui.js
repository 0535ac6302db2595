// butter's chat page: streams answers through /v1/chat/completions, shows the engine from
// /v1/server. Plain DOM, no build step, nothing fetched from elsewhere. Model output is
// shown as text (textContent), never parsed as HTML.
"use strict";

const $ = (id) => document.getElementById(id);
const ENGINE_POLL_MS = 1000;
const state = { messages: [], controller: null, lastSteps: null, lastPoll: null };

function apiKey() {
  return $("api-key").value.trim();
}

function headers() {
  const result = { "Content-Type": "application/json" };
  if (apiKey()) result.Authorization = `Bearer ${apiKey()}`;
  return result;
}

// The API's own message for a failed request (OpenAI or Anthropic shape), or the status.
async function errorOf(response) {
  let message = `${response.status} ${response.statusText}`;
  try {
    const body = await response.json();
    if (body && body.error && body.error.message) message = `${response.status}: ${body.error.message}`;
  } catch (_) { /* not JSON */ }
  if (response.status === 401) message += " (enter the server's API key under Settings)";
  return message;
}

function element(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

// ---------------------------------------------------------------- models

async function loadModels(selected) {
  const picker = $("model");
  try {
    const response = await fetch("/v1/models", { headers: headers() });
    if (!response.ok) throw new Error(await errorOf(response));
    const cards = (await response.json()).data;
    picker.replaceChildren(...cards.map((card) => {
      const option = element("option", "", card.loaded === false ? card.id : `${card.id} (loaded)`);
      option.value = card.id;
      return option;
    }));
    picker.value = selected && cards.some((card) => card.id === selected) ? selected : cards[0].id;
  } catch (error) {
    const unavailable = element("option", "", `models unavailable: ${error.message}`);
    unavailable.value = "";  // requests then name no model: the resident one
    picker.replaceChildren(unavailable);
  }
}

// ---------------------------------------------------------------- the conversation

function addTurn(role, text) {
  const item = element("li", role);
  item.dataset.role = role;
  if (text !== undefined) item.append(element("p", "text", text));
  $("log").append(item);
  $("log").scrollTop = $("log").scrollHeight;
  return item;
}

// The message list follows what is added to it, unless the reader scrolled up to read.
function follow(update) {
  const log = $("log");
  const atEnd = log.scrollHeight - log.scrollTop - log.clientHeight < 24;
  update();
  if (atEnd) log.scrollTop = log.scrollHeight;
}

// One assistant answer as it streams: reasoning apart, text, tool calls, stats, errors.
class Answer {
  constructor() {
    this.item = addTurn("assistant");
    this.item.setAttribute("aria-busy", "true");
    this.reasoning = null;
    this.text = element("p", "text");
    this.item.append(this.text);
    this.toolCalls = [];
    this.started = performance.now();
    this.firstToken = null;
  }

  seeToken() {
    if (this.firstToken === null) this.firstToken = performance.now();
  }

  addReasoning(piece) {
    this.seeToken();
    follow(() => {
      if (!this.reasoning) {
        const details = element("details", "reasoning");
        details.append(element("summary", "", "Reasoning"), element("pre"));
        this.item.insertBefore(details, this.text);
        this.reasoning = details.querySelector("pre");
      }
      this.reasoning.textContent += piece;
    });
  }

  addText(piece) {
    this.seeToken();
    follow(() => { this.text.textContent += piece; });
  }

  addToolCall(delta) {
    this.seeToken();
    follow(() => {
      let call = this.toolCalls[delta.index ?? 0];
      if (!call) {
        const block = element("div", "tool-call");
        const title = element("strong");
        const args = element("pre");
        block.append(title, args);
        this.item.append(block);
        call = { id: "", name: "", arguments: "", title, args };
        this.toolCalls[delta.index ?? 0] = call;
      }
      if (delta.id) call.id = delta.id;
      if (delta.function && delta.function.name) call.name += delta.function.name;
      if (delta.function && delta.function.arguments) call.arguments += delta.function.arguments;
      call.title.textContent = `tool call: ${call.name}`;
      call.args.textContent = call.arguments;
    });
  }

  fail(message) {
    follow(() => this.item.append(element("p", "error", message)));
  }

  finish(usage, finishReason) {
    this.item.removeAttribute("aria-busy");
    const parts = [];
    if (usage) {
      const tokens = usage.completion_tokens;
      const seconds = this.firstToken === null ? 0 : (performance.now() - this.firstToken) / 1000;
      parts.push(`${tokens} tokens`);
      if (tokens > 1 && seconds > 0) parts.push(`${((tokens - 1) / seconds).toFixed(1)} tokens/s`);
      const cached = (usage.prompt_tokens_details || {}).cached_tokens || 0;
      parts.push(`${cached} of ${usage.prompt_tokens} prompt tokens cached`);
    }
    if (this.firstToken !== null) {
      parts.push(`first token ${((this.firstToken - this.started) / 1000).toFixed(2)} s`);
    }
    if (finishReason) parts.push(`finish: ${finishReason}`);
    const stats = element("p", "stats", parts.join(" · "));
    stats.dataset.finish = finishReason || "";
    follow(() => this.item.append(stats));
  }

  message() {
    const message = { role: "assistant", content: this.text.textContent };
    if (this.toolCalls.length) {
      message.tool_calls = this.toolCalls.map((call) => ({
        id: call.id, type: "function", function: { name: call.name, arguments: call.arguments },
      }));
    }
    return message;
  }
}

// Server-sent events from a fetch body: yields each `data:` payload until [DONE].
async function* events(body) {
  const reader = body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const frame = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of frame.split("\n")) {
        if (!line.startsWith("data: ")) continue;
        const data = line.slice(6);
        if (data === "[DONE]") return;
        yield JSON.parse(data);
      }
    }
  }
}

function requestBody() {
  const system = $("system").value.trim();
  const messages = system ? [{ role: "system", content: system }, ...state.messages] : state.messages;
  return {
    model: $("model").value || undefined, messages, stream: true, stream_options: { include_usage: true },
    temperature: Number($("temperature").value), max_tokens: Number($("max-tokens").value),
  };
}

async function send(text) {
  state.messages.push({ role: "user", content: text });
  addTurn("user", text);
  const answer = new Answer();
  const controller = new AbortController();
  setStreaming(controller);
  let usage = null;
  let finishReason = null;
  try {
    const response = await fetch("/v1/chat/completions", {
      method: "POST", headers: headers(), body: JSON.stringify(requestBody()),
      signal: controller.signal,
    });
    if (!response.ok) throw new Error(await errorOf(response));
    for await (const chunk of events(response.body)) {
      if (chunk.error) throw new Error(chunk.error.message);
      if (chunk.usage) usage = chunk.usage;
      for (const choice of chunk.choices || []) {
        const delta = choice.delta || {};
        const reasoning = delta.reasoning_content || delta.reasoning;
        if (reasoning) answer.addReasoning(reasoning);
        if (delta.content) answer.addText(delta.content);
        for (const call of delta.tool_calls || []) answer.addToolCall(call);
        if (choice.finish_reason) finishReason = choice.finish_reason;
      }
    }
  } catch (error) {
    if (error.name === "AbortError") finishReason = "stopped";
    else answer.fail(error.message);
  } finally {
    setStreaming(null);
    answer.finish(usage, finishReason);
    state.messages.push(answer.message());
    loadModels($("model").value);  // a request may have swapped the model
  }
}

function setStreaming(controller) {
  state.controller = controller;
  $("send").hidden = controller !== null;
  $("stop").hidden = controller === null;
  if (controller === null) $("prompt").focus();
}

function stop() {
  if (state.controller) state.controller.abort();  // the server cancels at the next token
}

// ---------------------------------------------------------------- the engine view

function showEngine(info) {
  const engine = info.engine;
  const cache = info.prefix_cache;
  const now = performance.now();
  let stepsPerSecond = "–";
  if (engine && state.lastSteps !== null && now > state.lastPoll) {
    stepsPerSecond = ((engine.steps - state.lastSteps) / ((now - state.lastPoll) / 1000)).toFixed(1);
  }
  state.lastSteps = engine ? engine.steps : null;
  state.lastPoll = now;
  $("engine-status").textContent = info.swapping ? "swapping models…"
    : info.model ? info.model.id : "no model loaded";
  const rows = engine ? [
    ["active requests", `${engine.active} of ${engine.slots}`],
    ["queued", engine.queued],
    ["KV cells reserved", `${engine.reserved_cells} of ${engine.total_cells}`],
    ["KV cells cached", engine.idle_cached_cells],
    ["cached prompts", cache ? `${cache.kv_entries} of ${cache.kv_entry_capacity}` : "–"],
    ["prefix-cache hits", cache ? `${cache.hits} (misses ${cache.misses})` : "–"],
    ["prompt tokens cached", cache ? `${cache.cached_tokens} of ${cache.prompt_tokens}` : "–"],
    ["host-RAM prompts", cache && cache.host_ram ? cache.host_ram.entries : "off"],
    ["steps/s", stepsPerSecond],
    ["requests done", engine.requests_done],
  ] : [];
  $("engine-stats").replaceChildren(...rows.flatMap(([name, value]) => {
    const term = element("dt", "", name);
    const detail = element("dd", "", String(value));
    detail.dataset.stat = name;
    return [term, detail];
  }));
}

async function pollEngine() {
  if (!$("main").classList.contains("engine-hidden")) {
    try {
      const response = await fetch("/v1/server", { headers: headers() });
      if (!response.ok) throw new Error(await errorOf(response));
      showEngine(await response.json());
    } catch (error) {
      $("engine-status").textContent = error.message;
    }
  }
  setTimeout(pollEngine, ENGINE_POLL_MS);
}

// ---------------------------------------------------------------- wiring

function start() {
  $("api-key").value = localStorage.getItem("butter.apiKey") || "";
  $("api-key").addEventListener("input", () => {
    localStorage.setItem("butter.apiKey", apiKey());
    loadModels($("model").value);
  });
  if (window.matchMedia("(max-width: 700px)").matches) toggleEngine();
  $("toggle-engine").addEventListener("click", toggleEngine);
  $("settings-form").addEventListener("submit", (event) => event.preventDefault());
  $("composer").addEventListener("submit", (event) => {
    event.preventDefault();
    const text = $("prompt").value.trim();
    if (!text || state.controller) return;
    $("prompt").value = "";
    send(text);
  });
  $("prompt").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      $("composer").requestSubmit();
    }
  });
  document.addEventListener("keydown", (event) => {
    if (event.key === "Escape") stop();
  });
  $("stop").addEventListener("click", stop);
  $("new-chat").addEventListener("click", () => {
    stop();
    state.messages = [];
    $("log").replaceChildren();
    $("prompt").focus();
  });
  loadModels();
  pollEngine();
  $("prompt").focus();
}

function toggleEngine() {
  const hidden = $("main").classList.toggle("engine-hidden");
  $("toggle-engine").setAttribute("aria-expanded", String(!hidden));
}

start();

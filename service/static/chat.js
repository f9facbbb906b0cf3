// The playground's chat mode: a conversation sent through POST v1/chat/completions (streamed), so the server
// renders it with the model's own chat template. Each answer shows its reasoning (a collapsible block), its
// text and its tool calls as the deltas arrive; the answer joins the conversation for the next turn.
import { postJson, sseData } from "./sse.js";

const $ = (id) => document.getElementById(id);
const ui = {
  promptMode: $("prompt-mode"), chatMode: $("chat-mode"), modePrompt: $("mode-prompt"), modeChat: $("mode-chat"),
  system: $("chat-system"), maxTokens: $("chat-max-tokens"), temperature: $("chat-temperature"),
  extra: $("chat-extra"), extraField: $("chat-extra-field"), conversation: $("conversation"),
  compose: $("chat-compose"), input: $("chat-input"), role: $("chat-role"), send: $("chat-send"),
  stop: $("chat-stop"), clear: $("chat-clear"), error: $("chat-error"), requestBody: $("chat-request-body"),
};
const chat = { history: [], running: null, model: null };

// --- modes -------------------------------------------------------------------------------------------

function showMode(mode) {
  const inChat = mode === "chat";
  ui.promptMode.hidden = inChat;
  ui.chatMode.hidden = !inChat;
  ui.modePrompt.setAttribute("aria-pressed", String(!inChat));
  ui.modeChat.setAttribute("aria-pressed", String(inChat));
  if (location.hash !== (inChat ? "#chat" : "") && (inChat || location.hash)) {
    history.replaceState(null, "", inChat ? "#chat" : location.pathname + location.search);
  }
  if (inChat) ui.input.focus();
}

// --- the request ---------------------------------------------------------------------------------------

async function modelName() {
  if (chat.model) return chat.model;
  const reply = await fetch("v1/models", { headers: { Accept: "application/json" } });
  const models = reply.ok ? (await reply.json()).data ?? [] : [];
  const base = models.find((m) => !m.parent) ?? models[0];
  if (!base) throw new Error("GET v1/models lists no model");
  chat.model = base.id;
  return chat.model;
}

/** The fields beside the messages: max_tokens, temperature, and the "more fields" JSON object. */
function otherFields() {
  const fields = {};
  if (ui.maxTokens.value !== "") fields.max_tokens = Number(ui.maxTokens.value);
  if (ui.temperature.value !== "") fields.temperature = Number(ui.temperature.value);
  const text = ui.extra.value.trim();
  if (!text) return fields;
  let extra;
  try { extra = JSON.parse(text); } catch (err) { throw new FieldError(`not JSON: ${err.message}`); }
  if (extra === null || typeof extra !== "object" || Array.isArray(extra)) {
    throw new FieldError("must be a JSON object, e.g. {\"tools\": [...], \"seed\": 1}");
  }
  return { ...fields, ...extra };
}

class FieldError extends Error {}

/** The message the composer adds: a user message, or a tool message answering the last unanswered call. */
function composedMessage() {
  const content = ui.input.value;
  if (ui.role.value !== "tool") return { role: "user", content };
  const call = pendingCall();
  if (!call) throw new Error("no tool call is waiting for its result");
  return { role: "tool", tool_call_id: call.id, content };
}

function pendingCall() {
  const answered = new Set(chat.history.filter((m) => m.role === "tool").map((m) => m.tool_call_id));
  for (const message of [...chat.history].reverse()) {
    for (const call of message.tool_calls ?? []) if (!answered.has(call.id)) return call;
  }
  return null;
}

// --- one turn --------------------------------------------------------------------------------------------

async function send(event) {
  event?.preventDefault();
  if (chat.running || !ui.input.value.trim()) return;
  hideError();
  ui.extraField.classList.remove("invalid");
  let fields, message;
  try {
    fields = otherFields();
    message = composedMessage();
  } catch (err) {
    if (err instanceof FieldError) {
      ui.extraField.classList.add("invalid");
      ui.extraField.querySelector(".field-error").textContent = err.message;
    }
    return showError(`Not sent: ${err.message}`);
  }
  const system = ui.system.value.trim() ? [{ role: "system", content: ui.system.value }] : [];
  const controller = new AbortController();
  chat.running = { controller };
  setRunning(true);
  let answer = null;
  try {
    const body = { model: await modelName(), messages: [...system, ...chat.history, message], ...fields, stream: true };
    const text = JSON.stringify(body, null, 2);
    ui.requestBody.textContent = text;
    chat.history.push(message);
    addMessage(message);
    ui.input.value = "";
    answer = newAnswer();
    const reply = await postJson("v1/chat/completions", text, controller.signal);
    if (!reply.ok) {
      chat.history.pop();  // refused: the message is not part of the conversation
      answer.element.remove();
      ui.conversation.lastElementChild?.remove();
      ui.input.value = message.content;
      return await showReplyError(reply);
    }
    await readAnswer(reply, answer);
  } catch (err) {
    if (err.name === "AbortError") finish(answer, "stopped");
    else { finish(answer, "failed"); showError(`The request failed: ${err.message}`); }
  } finally {
    controller.abort();
    chat.running = null;
    setRunning(false);
  }
}

async function readAnswer(reply, answer) {
  for await (const data of sseData(reply.body)) {
    if (data === "[DONE]") return finish(answer, "done");
    let chunk;
    try { chunk = JSON.parse(data); } catch { return showError(`Not JSON from the server: ${data.slice(0, 200)}`); }
    if (chunk.error) {
      finish(answer, "failed");
      return showError(`${chunk.error.type ?? "error"}: ${chunk.error.message}`);
    }
    const choice = chunk.choices?.[0];
    if (!choice) continue;
    applyDelta(answer, choice.delta ?? {});
    if (choice.finish_reason) answer.finish = choice.finish_reason;
  }
  finish(answer, "ended");
}

// --- the conversation on the page --------------------------------------------------------------------------

function addMessage(message) {
  const element = bubble(message.role === "tool" ? `tool (${message.tool_call_id})` : message.role, message.role);
  element.querySelector(".content").textContent = message.content;
  ui.conversation.append(element);
  return element;
}

function bubble(label, role) {
  const element = document.createElement("div");
  element.className = `msg ${role}`;
  element.append(Object.assign(document.createElement("div"), { className: "role", textContent: label }),
    Object.assign(document.createElement("div"), { className: "content" }));
  return element;
}

/** An assistant message being written: its reasoning block (shown once reasoning arrives), text and calls. */
function newAnswer() {
  const element = bubble("assistant", "assistant");
  element.dataset.state = "running";
  const reasoning = document.createElement("details");
  reasoning.className = "reasoning";
  reasoning.hidden = true;
  reasoning.append(Object.assign(document.createElement("summary"), { textContent: "Reasoning" }),
    Object.assign(document.createElement("div"), { className: "reasoning-text" }));
  const calls = Object.assign(document.createElement("div"), { className: "tool-calls" });
  element.insertBefore(reasoning, element.querySelector(".content"));
  element.append(calls);
  ui.conversation.append(element);
  return { element, reasoning, content: "", thought: "", calls: [], callList: calls, finish: null };
}

function applyDelta(answer, delta) {
  if (delta.reasoning_content) {
    answer.thought += delta.reasoning_content;
    answer.reasoning.hidden = false;
    answer.reasoning.querySelector(".reasoning-text").textContent = answer.thought;
  }
  if (delta.content) {
    answer.content += delta.content;
    answer.element.querySelector(".content").textContent = answer.content;
  }
  for (const piece of delta.tool_calls ?? []) {
    let call = answer.calls[piece.index];
    if (!call) {
      call = { id: piece.id, type: "function", function: { name: piece.function?.name ?? "", arguments: "" } };
      answer.calls[piece.index] = call;
      const row = document.createElement("div");
      row.className = "tool-call";
      row.append(Object.assign(document.createElement("span"), { className: "name", textContent: call.function.name }),
        Object.assign(document.createElement("code"), { className: "arguments" }));
      answer.callList.append(row);
      call.row = row;
    }
    call.function.arguments += piece.function?.arguments ?? "";
    call.row.querySelector(".arguments").textContent = call.function.arguments;
  }
  ui.conversation.scrollTop = ui.conversation.scrollHeight;
}

function finish(answer, state) {
  if (!answer) return;
  answer.element.dataset.state = state;
  answer.element.dataset.finish = answer.finish ?? "";
  answer.reasoning.querySelector("summary").textContent =
    answer.thought ? `Reasoning (${answer.thought.length} characters)` : "Reasoning";
  if (state !== "done" && !answer.content && !answer.calls.length && !answer.thought) return;
  const message = { role: "assistant", content: answer.content || null };
  const calls = answer.calls.filter(Boolean).map(({ id, type, function: f }) => ({ id, type, function: f }));
  if (calls.length) message.tool_calls = calls;
  else message.content = answer.content;
  chat.history.push(message);
  ui.role.querySelector('option[value="tool"]').disabled = !pendingCall();
}

// --- errors and state ----------------------------------------------------------------------------------------

async function showReplyError(reply) {
  let body = null;
  try { body = await reply.json(); } catch { /* not JSON */ }
  const error = body?.error;
  const message = typeof error === "object" && error ? error.message : error ?? `HTTP ${reply.status}`;
  const param = typeof error === "object" && error ? error.param : null;
  showError(`${reply.status}${param ? ` (${param})` : ""}: ${message}`);
}

function showError(message) {
  ui.error.textContent = message;
  ui.error.hidden = false;
}

function hideError() {
  ui.error.hidden = true;
  ui.error.textContent = "";
  ui.extraField.querySelector(".field-error").textContent = "";
}

function setRunning(running) {
  ui.send.disabled = running;
  ui.stop.disabled = !running;
  ui.conversation.dataset.state = running ? "running" : "idle";
}

function clearConversation() {
  chat.running?.controller.abort();
  chat.history = [];
  ui.conversation.replaceChildren();
  ui.role.value = "user";
  ui.role.querySelector('option[value="tool"]').disabled = true;
  hideError();
}

ui.modePrompt.addEventListener("click", () => showMode("prompt"));
ui.modeChat.addEventListener("click", () => showMode("chat"));
ui.compose.addEventListener("submit", send);
$("chat-settings").addEventListener("submit", (e) => e.preventDefault());  // Enter in a setting sends nothing
ui.stop.addEventListener("click", () => chat.running?.controller.abort());
ui.clear.addEventListener("click", clearConversation);
ui.input.addEventListener("keydown", (e) => {
  if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) send(e);
});
ui.conversation.dataset.state = "idle";
showMode(location.hash === "#chat" ? "chat" : "prompt");

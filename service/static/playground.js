// The playground: the form (built from the server's schema), a run of POST / (streamed or not), its output,
// per-token details, TTFT and tokens/s, the server's validation errors beside their field, and Stop.
import { acceptsValue, buildParameterForm, grammarKinds, loadSchemas, readParameters, toJson } from "./schema_form.js";
import { postGenerate, sseData } from "./sse.js";

const $ = (id) => document.getElementById(id);
const ui = {
  form: $("form"), inputs: $("inputs"), generate: $("generate"), stop: $("stop"), stream: $("stream"),
  reset: $("reset"), params: $("params"), status: $("status"), model: $("model"), error: $("error"),
  output: $("output"), runState: $("run-state"), rows: $("token-rows"), requestBody: $("request-body"),
  adapterField: $("adapter-field"), adapter: $("adapter"),
  grammarField: $("grammar-field"), grammarType: $("grammar-type"), grammarValue: $("grammar-value"),
};
const page = { controls: [], grammar: null, running: null };

// --- start-up: the schema, the model, the optional sections ------------------------------------------

async function start() {
  try {
    const { request, parameters, resolve } = await loadSchemas();
    page.controls = buildParameterForm(ui.params, parameters);
    const inputs = resolve(request.properties.inputs);
    if (inputs?.maxLength) {
      ui.inputs.maxLength = inputs.maxLength;
      $("inputs-hint").textContent = `1..${inputs.maxLength.toLocaleString("en")} characters`;
    }
    setUpGrammar(resolve(parameters.properties?.grammar), resolve);
    await setUpAdapters(parameters.properties?.adapter_id);
    ui.generate.disabled = false;
    setStatus("ready");
  } catch (err) {
    setStatus(`cannot build the form: ${err.message}`, "bad");
  }
}

function setUpGrammar(grammar, resolve) {
  if (!acceptsValue(grammar)) return;  // the server accepts only null: no structured output here
  const kinds = grammarKinds(grammar, resolve);
  ui.grammarType.replaceChildren(new Option("none", ""), ...kinds.map((k) => new Option(k, k)));
  if (!kinds.length) ui.grammarType.append(new Option("as JSON", "raw"));
  page.grammar = { kinds };
  ui.grammarField.hidden = false;
  const showValue = () => { ui.grammarValue.hidden = ui.grammarType.value === ""; };
  ui.grammarType.addEventListener("change", showValue);
  showValue();
}

async function setUpAdapters(adapterProp) {
  let models = [];
  try {
    const reply = await fetch("v1/models", { headers: { Accept: "application/json" } });
    if (reply.ok) models = (await reply.json()).data ?? [];
  } catch { /* the model name is a nicety */ }
  const base = models.find((m) => !m.parent) ?? models[0];
  ui.model.textContent = base ? base.id : "model unknown";
  const adapters = models.filter((m) => m.parent);
  if (!adapterProp || !acceptsValue(adapterProp) || !adapters.length) return;
  ui.adapter.replaceChildren(new Option(`base model (${base?.id ?? "none"})`, ""),
    ...adapters.map((a) => new Option(a.id, a.id)));
  ui.adapterField.hidden = false;
}

// --- one run ---------------------------------------------------------------------------------------

function requestBody() {
  const { parameters, errors } = readParameters(page.controls);
  if (!ui.adapterField.hidden && ui.adapter.value) parameters.adapter_id = ui.adapter.value;
  if (page.grammar && ui.grammarType.value) {
    const text = ui.grammarValue.value;
    let value = text;
    try { if (ui.grammarType.value !== "regex") value = JSON.parse(text); } catch { /* the server says why */ }
    parameters.grammar = ui.grammarType.value === "raw" ? value : { type: ui.grammarType.value, value };
  }
  const body = { inputs: ui.inputs.value, parameters, stream: ui.stream.checked };
  return { body, errors };
}

async function run(event) {
  event?.preventDefault();
  if (page.running) return;
  clearResult();
  const { body, errors } = requestBody();
  if (Object.keys(errors).length) {
    for (const [name, message] of Object.entries(errors)) showFieldError(name, message);
    return showError(`Not sent: ${Object.entries(errors).map(([n, m]) => `${n}: ${m}`).join("; ")}`);
  }
  const text = toJson(body);
  ui.requestBody.textContent = text;
  const controller = new AbortController();
  const stats = { started: performance.now(), first: null, last: null, count: 0 };
  page.running = { controller, stats };
  setRunning(true);
  try {
    const reply = await postGenerate(text, controller.signal);
    if (!reply.ok) return await showReplyError(reply);
    if (reply.headers.get("Content-Type")?.startsWith("text/event-stream")) await readStream(reply, stats);
    else await readWhole(reply, stats);
  } catch (err) {
    if (err.name === "AbortError") finishRun("stopped", `stopped after ${stats.count} tokens`);
    else showError(`The request failed: ${err.message}`);
  } finally {
    controller.abort();  // a reply left unread (a garbled event) is dropped, and the server frees the request
    page.running = null;
    setRunning(false);
  }
}

async function readStream(reply, stats) {
  for await (const data of sseData(reply.body)) {
    let event;
    try { event = JSON.parse(data); } catch { return showError(`Not JSON from the server: ${data.slice(0, 200)}`); }
    if (event.error !== undefined) {  // the stream failed after it started
      finishRun("failed", event.error_type ?? "error");
      return showError(`${event.error_type ?? "Error"}: ${event.error}`);
    }
    addToken(event.token, stats);
    if (event.generated_text !== null && event.generated_text !== undefined) {
      settleText(event.generated_text);
      showDetails(event.details, stats);
      return finishRun("done", event.details?.finish_reason ?? "done");
    }
  }
  finishRun("ended", "the stream ended without its last event");
}

async function readWhole(reply, stats) {
  const json = await reply.json();
  const result = Array.isArray(json) ? json[0] : json;
  stats.first = stats.last = performance.now();
  for (const token of result.details?.prefill ?? []) addTokenRow(token, "prompt");
  if (result.details?.tokens) for (const token of result.details.tokens) addToken(token, stats, false);
  settleText(result.generated_text);
  showDetails(result.details, stats);
  finishRun("done", result.details?.finish_reason ?? "done");
}

// --- output ----------------------------------------------------------------------------------------

function addToken(token, stats, timed = true) {
  if (timed) {
    const now = performance.now();
    if (stats.first === null) {
      stats.first = now;
      $("stat-ttft").textContent = `${(now - stats.started).toFixed(0)} ms`;
    }
    stats.last = now;
  }
  stats.count += 1;
  const id = Array.isArray(token.id) ? token.id.join(",") : String(token.id);
  const p = token.logprob === null || token.logprob === undefined ? null : Math.exp(token.logprob);
  if (!token.special) {
    const span = document.createElement("span");
    span.className = `tok${p === null ? "" : p < 0.2 ? " p-low" : p < 0.5 ? " p-mid" : ""}`;
    span.textContent = token.text;
    span.title = `#${stats.count}  id ${id}  logprob ${token.logprob?.toFixed(4) ?? "–"}`;
    ui.output.append(span);
  }
  addTokenRow(token, stats.count);
  ui.output.dataset.tokens = String(stats.count);
  $("stat-tokens").textContent = String(stats.count);
  updateRate(stats);
}

/** Show the server's generated_text once it is known: the tokens stay when they spell it. */
function settleText(generated) {
  ui.output.dataset.generatedText = generated;
  const shown = ui.output.textContent;
  if (shown === generated) return;
  if (shown && generated.endsWith(shown)) {  // return_full_text: the prompt comes first
    ui.output.prepend(Object.assign(document.createElement("span"), { className: "echo", textContent: generated.slice(0, -shown.length) }));
  } else {  // a stop string cut off, or fullTextEnabled (each token.text is the whole text so far)
    ui.output.textContent = generated;
  }
}

function addTokenRow(token, index) {
  const p = token.logprob === null || token.logprob === undefined ? null : Math.exp(token.logprob);
  const row = document.createElement("tr");
  if (index === "prompt") row.className = "prompt-row";
  for (const value of [index, Array.isArray(token.id) ? token.id.join(",") : token.id, JSON.stringify(token.text),
    token.logprob?.toFixed(4) ?? "–", p === null ? "–" : p.toFixed(3)]) {
    row.append(Object.assign(document.createElement("td"), { textContent: String(value) }));
  }
  ui.rows.append(row);
}

function updateRate(stats) {
  // Decode speed: tokens after the first over the time since the first (TTFT is shown apart).
  if (stats.count > 1 && stats.last > stats.first) {
    $("stat-rate").textContent = ((stats.count - 1) / ((stats.last - stats.first) / 1000)).toFixed(1);
  }
  $("stat-elapsed").textContent = `${((performance.now() - stats.started) / 1000).toFixed(2)} s`;
}

function showDetails(details, stats) {
  updateRate(stats);
  if (!details) return;
  $("stat-finish").textContent = details.finish_reason ?? "–";
  $("stat-prompt").textContent = details.prompt_tokens ?? "–";
  $("stat-seed").textContent = details.seed ?? "–";
}

// --- errors ----------------------------------------------------------------------------------------

async function showReplyError(reply) {
  let body = null;
  try { body = await reply.json(); } catch { /* not JSON */ }
  const message = body?.error ?? `HTTP ${reply.status}`;
  const field = fieldOf(message);
  if (field) showFieldError(field, message);
  finishRun("refused", `${reply.status}`);
  showError(`${reply.status} ${body?.error_type ?? reply.statusText}: ${message}`);
}

/** The form field a server message names first ("parameters.top_p must be < 1.0, got 1.0" -> top_p). */
function fieldOf(message) {
  const m = /^(?:parameters\.([A-Za-z_]+)|(inputs|stream|parameters))\b/.exec(message);
  return m ? m[1] ?? m[2] : null;
}

function showFieldError(name, message) {
  const field = document.querySelector(`[data-field="${name}"]`);
  if (!field) return;
  field.classList.add("invalid");
  const slot = field.querySelector(".field-error");
  if (slot) slot.textContent = message;
  field.closest("details")?.setAttribute("open", "");
}

function showError(message) {
  ui.error.textContent = message;
  ui.error.hidden = false;
}

// --- state -----------------------------------------------------------------------------------------

function clearResult() {
  ui.error.hidden = true;
  ui.error.textContent = "";
  ui.output.replaceChildren();
  delete ui.output.dataset.generatedText;
  ui.output.dataset.tokens = "0";
  ui.rows.replaceChildren();
  for (const field of document.querySelectorAll(".field.invalid")) {
    field.classList.remove("invalid");
    field.querySelector(".field-error").textContent = "";
  }
  for (const id of ["ttft", "rate", "tokens", "finish", "prompt", "seed", "elapsed"]) $(`stat-${id}`).textContent = "–";
  ui.runState.textContent = "";
  ui.runState.className = "run-state";
}

function finishRun(state, text) {
  ui.runState.textContent = text;
  ui.runState.className = `run-state ${state}`;
  ui.output.dataset.state = state;
}

function setRunning(running) {
  ui.generate.disabled = running;
  ui.stop.disabled = !running;
  ui.form.classList.toggle("busy", running);
  if (running) {
    ui.output.dataset.state = "running";
    ui.runState.textContent = "generating…";
    ui.runState.className = "run-state running";
  }
  setStatus(running ? "generating" : "ready");
}

function setStatus(text, kind = "") {
  ui.status.textContent = text;
  ui.status.className = `status ${kind}`;
}

ui.form.addEventListener("submit", run);
ui.stop.addEventListener("click", () => page.running?.controller.abort());
ui.reset.addEventListener("click", () => page.controls.forEach((c) => c.reset()));
ui.inputs.addEventListener("keydown", (e) => {
  if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) run(e);
});
start();

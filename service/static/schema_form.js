// The parameter controls of POST /, built from the JSON Schema the server validates with (read from
// openapi.json at run time, never copied here): one control per property of `parameters`, its range, default
// and description taken from the schema. Values go out as typed; the server judges them (its 422 message is
// shown beside the field).

const GROUPS = [
  ["Sampling", ["do_sample", "temperature", "top_k", "top_p", "typical_p", "repetition_penalty", "seed", "watermark"]],
  ["Length and stopping", ["max_new_tokens", "stop", "truncate"]],
  ["Response", ["details", "decoder_input_details", "return_full_text"]],
];
const OTHER_GROUP = "Client compatibility";  // any property not placed above (the HF client's fields, new ones)
const OWN_SECTIONS = new Set(["adapter_id", "grammar"]);  // their own controls above the groups
const PAGE_DEFAULTS = { details: "true" };  // the page asks for details so that the finish reason shows

export class RawNumber {
  // A number exactly as typed (a seed up to 2^64 - 1 would lose digits as a JS number).
  constructor(text) { this.text = text; }
}

export async function loadSchemas() {
  const reply = await fetch("openapi.json", { headers: { Accept: "application/json" } });
  if (!reply.ok) throw new Error(`GET openapi.json answered HTTP ${reply.status}`);
  const doc = await reply.json();
  const resolve = (node) => {
    for (let hops = 0; node && typeof node.$ref === "string" && hops < 32; hops++) node = pointer(doc, node.$ref);
    return node;
  };
  const request = resolve(doc.components.schemas.generate_request);
  return { request, parameters: resolve(request.properties.parameters), resolve };
}

function pointer(doc, ref) {
  if (!ref.startsWith("#/")) throw new Error(`unsupported $ref ${ref}`);
  return ref.slice(2).split("/").reduce(
    (node, part) => node?.[part.replaceAll("~1", "/").replaceAll("~0", "~")], doc);
}

export function types(prop) {
  const t = prop.type;
  return (Array.isArray(t) ? t : t ? [t] : []).filter((name) => name !== "null");
}

/** Whether a property accepts anything but null (e.g. `grammar` before structured output exists: [null]). */
export function acceptsValue(prop) {
  if (!prop) return false;
  if (Array.isArray(prop.enum)) return prop.enum.some((v) => v !== null);
  if ("const" in prop) return prop.const !== null;
  return prop.type === undefined || types(prop).length > 0;
}

function fmt(n) {
  if (!Number.isInteger(n) || Math.abs(n) < 1e6) return String(n);
  if (!Number.isSafeInteger(n + 1)) return n.toExponential(2);  // beyond 2^53 the parsed value is rounded
  const exp = Math.round(Math.log2(n + 1));
  return 2 ** exp === n + 1 ? `2^${exp}−1` : 2 ** exp === n ? `2^${exp}` : n.toExponential(2);
}

/** "(1e-6, 1)" / "[1, 2^31−1]" / "> 0": the range the schema allows, as text. */
export function rangeText(prop) {
  const lo = prop.exclusiveMinimum ?? prop.minimum, hi = prop.exclusiveMaximum ?? prop.maximum;
  if (lo === undefined && hi === undefined) return "";
  if (hi === undefined) return `${prop.exclusiveMinimum !== undefined ? ">" : "≥"} ${fmt(lo)}`;
  if (lo === undefined) return `${prop.exclusiveMaximum !== undefined ? "<" : "≤"} ${fmt(hi)}`;
  return `${prop.exclusiveMinimum !== undefined ? "(" : "["}${fmt(lo)}, ${fmt(hi)}${prop.exclusiveMaximum !== undefined ? ")" : "]"}`;
}

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (value === undefined || value === null || value === false) continue;
    if (key === "text") node.textContent = value;
    else node.setAttribute(key, value === true ? "" : String(value));
  }
  node.append(...children);
  return node;
}

function notSet(prop) {  // what an empty control means: the server's default applies
  return prop.default === undefined ? "not set" : `default ${JSON.stringify(prop.default)}`;
}

/** One control for one schema property: { name, node, read() -> {value?, error?}, reset() }. */
function control(name, prop) {
  const id = `param-${name}`;
  const kinds = types(prop);
  let input, read, initial = PAGE_DEFAULTS[name] ?? "";
  let hint = rangeText(prop);
  if (Array.isArray(prop.enum)) {
    input = el("select", { id, name });
    input.append(el("option", { value: "", text: prop.enum.includes(null) ? "not set" : "choose" }));
    prop.enum.forEach((v, i) => v !== null && input.append(el("option", { value: String(i), text: JSON.stringify(v) })));
    input.disabled = !acceptsValue(prop);
    hint = input.disabled ? "only null" : `one of ${prop.enum.map((v) => JSON.stringify(v)).join(", ")}`;
    read = () => (input.value === "" ? {} : { value: prop.enum[Number(input.value)] });
  } else if (kinds.length === 1 && kinds[0] === "boolean") {
    input = el("select", { id, name });
    input.append(el("option", { value: "", text: notSet(prop) }), el("option", { value: "true", text: "true" }),
      el("option", { value: "false", text: "false" }));
    read = () => (input.value === "" ? {} : { value: input.value === "true" });
  } else if (kinds.length === 1 && (kinds[0] === "integer" || kinds[0] === "number")) {
    const integer = kinds[0] === "integer";
    input = el("input", {
      id, name, type: "number", inputmode: integer ? "numeric" : "decimal", step: integer ? "1" : "any",
      min: Number.isSafeInteger(prop.minimum) || (!integer && prop.minimum !== undefined) ? prop.minimum : undefined,
      max: Number.isSafeInteger(prop.maximum) || (!integer && prop.maximum !== undefined) ? prop.maximum : undefined,
      placeholder: notSet(prop),
    });
    read = () => readNumber(input);
  } else if (kinds.includes("array") && kinds.includes("string")) {  // stop: one string or a list
    input = el("textarea", { id, name, rows: 2, spellcheck: "false", placeholder: "not set · one per line, \\n for a newline" });
    hint = [prop.maxItems !== undefined && `≤ ${prop.maxItems} strings`, prop.maxLength !== undefined && `each ≤ ${prop.maxLength} chars`]
      .filter(Boolean).join(", ");
    read = () => {
      const lines = input.value.split("\n").filter((line) => line !== "").map((line) => line.replaceAll("\\n", "\n"));
      return lines.length ? { value: lines } : {};
    };
  } else {  // a string, or anything else: sent as typed (JSON if it parses as JSON and the schema is not a string)
    input = el("input", { id, name, type: "text", placeholder: notSet(prop), maxlength: prop.maxLength });
    read = () => {
      if (input.value === "") return {};
      if (kinds.length === 1 && kinds[0] === "string") return { value: input.value };
      try { return { value: JSON.parse(input.value) }; } catch { return { value: input.value }; }
    };
  }
  input.value = initial;
  input.dataset.schemaMin = prop.minimum ?? prop.exclusiveMinimum ?? "";
  input.dataset.schemaMax = prop.maximum ?? prop.exclusiveMaximum ?? "";
  const node = el("div", { class: "field", "data-field": name },
    el("label", { for: id, title: prop.description ?? "" }, name, " ", el("small", { class: "hint", text: hint })),
    input, el("p", { class: "field-error", "aria-live": "polite" }));
  return { name, node, read, reset: () => { input.value = initial; } };
}

const JSON_NUMBER = /^-?(0|[1-9]\d*)(\.\d+)?([eE][+-]?\d+)?$/;

function readNumber(input) {
  const text = input.value.trim();
  if (text === "") return input.validity.badInput ? { error: "not a number" } : {};
  if (JSON_NUMBER.test(text)) return { value: new RawNumber(text) };  // as typed: 1.0 stays 1.0
  const n = Number(text);  // e.g. ".5" or "01": valid in a number input, not JSON
  return Number.isFinite(n) ? { value: n } : { error: `${text} is not a number` };
}

/** Build the groups of controls into `container`; returns the controls. */
export function buildParameterForm(container, parameters) {
  const props = parameters.properties ?? {};
  const placed = new Set(GROUPS.flatMap(([, names]) => names));
  const other = Object.keys(props).filter((name) => !placed.has(name) && !OWN_SECTIONS.has(name));
  const controls = [];
  container.replaceChildren();
  for (const [title, names] of [...GROUPS, [OTHER_GROUP, other]]) {
    const present = names.filter((name) => props[name]);
    if (!present.length) continue;
    const fieldset = el("fieldset", { class: "group" }, el("legend", { text: title }));
    const grid = el("div", { class: "grid" });
    for (const name of present) {
      const c = control(name, props[name]);
      controls.push(c);
      grid.append(c.node);
    }
    fieldset.append(grid);
    if (title === OTHER_GROUP) {
      const details = el("details", { class: "group-fold" }, el("summary", { text: `${title} (${present.length})` }), grid);
      container.append(details);
    } else {
      container.append(fieldset);
    }
  }
  return controls;
}

/** The `parameters` object of the form, or the local errors ({name: message}) that keep it from being sent. */
export function readParameters(controls) {
  const parameters = {}, errors = {};
  for (const c of controls) {
    const { value, error } = c.read();
    if (error) errors[c.name] = error;
    else if (value !== undefined) parameters[c.name] = value;
  }
  return { parameters, errors };
}

/** JSON text of `body`, RawNumbers written as typed. */
export function toJson(body) {
  const tag = `raw${Math.random().toString(36).slice(2)}:`;
  const text = JSON.stringify(body, (key, value) => (value instanceof RawNumber ? tag + value.text : value), 2);
  return text.replace(new RegExp(`"${tag}([-+.eE0-9]+)"`, "g"), "$1");
}

/** The grammar's kinds as the schema names them ({"type": "json" | "regex", ...}), [] if it names none. */
export function grammarKinds(grammar, resolve) {
  const kinds = new Set();
  const walk = (node, depth) => {
    node = resolve(node);
    if (!node || typeof node !== "object" || depth > 8) return;
    const type = resolve(node.properties?.type);
    if (type) {
      if ("const" in type) kinds.add(type.const);
      (type.enum ?? []).forEach((v) => kinds.add(v));
    }
    for (const key of ["oneOf", "anyOf", "allOf"]) (node[key] ?? []).forEach((n) => walk(n, depth + 1));
    for (const key of ["then", "else"]) if (node[key]) walk(node[key], depth + 1);
  };
  walk(grammar, 0);
  return [...kinds].filter((k) => typeof k === "string");
}

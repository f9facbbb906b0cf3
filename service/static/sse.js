// POST / (and the chat route) and their server-sent events, read as they arrive (fetch + ReadableStream), abortable.

/** POST `bodyText` to the page's own origin's `/` (a relative URL: same scheme, host, port and prefix). */
export function postGenerate(bodyText, signal) {
  return postJson("./", bodyText, signal);
}

/** POST a JSON body to `path`, relative to the page (e.g. "v1/chat/completions"). */
export function postJson(path, bodyText, signal) {
  return fetch(path, {
    method: "POST",
    headers: { "Content-Type": "application/json", Accept: "application/json, text/event-stream" },
    body: bodyText,
    signal,
  });
}

/** The `data` of each event of an SSE body, as text, one at a time as the bytes arrive. */
export async function* sseData(body) {
  const reader = body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += value;
      // A lone "\r" at the end may be the first half of "\r\n": keep it for the next chunk.
      const held = buffer.endsWith("\r") ? "\r" : "";
      buffer = buffer.slice(0, buffer.length - held.length).replace(/\r\n?/g, "\n");
      let cut;
      while ((cut = buffer.indexOf("\n\n")) >= 0) {
        const data = eventData(buffer.slice(0, cut));
        buffer = buffer.slice(cut + 2);
        if (data !== null) yield data;
      }
      buffer += held;
    }
    const last = eventData(buffer.replace(/\r\n?/g, "\n"));
    if (last !== null) yield last;
  } finally {
    reader.releaseLock();
  }
}

/** The joined `data:` lines of one event block (null when it has none: a comment or a keep-alive). */
function eventData(block) {
  const lines = block.split("\n").filter((line) => line.startsWith("data:"));
  if (!lines.length) return null;
  return lines.map((line) => line.slice(line.startsWith("data: ") ? 6 : 5)).join("\n");
}

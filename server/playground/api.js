// The page's only way to the server: JSON and server-sent events, with the API key if one is set.
// The key lives in this module's memory only: never in storage or cookies, gone on reload.

let apiKey = null;

export function setKey(key) {
  apiKey = key;
}

// An error answer of the API: `message` is the server's own words.
export class ApiError extends Error {
  constructor(status, message, code) {
    super(message);
    this.status = status;
    this.code = code;
  }
}

function headers(json) {
  const h = json ? { "Content-Type": "application/json" } : {};
  if (apiKey) h.Authorization = `Bearer ${apiKey}`;
  return h;
}

async function check(response) {
  if (response.ok) return response;
  let message = `${response.status} ${response.statusText}`;
  let code = null;
  try {
    const body = await response.json();
    message = body.error?.message ?? message;
    code = body.error?.code ?? null;
  } catch {
    // not the API's JSON error shape: keep the status line
  }
  throw new ApiError(response.status, message, code);
}

export async function getJSON(path) {
  const response = await check(await fetch(path, { headers: headers(false) }));
  return response.json();
}

export async function postJSON(path, body, signal) {
  const init = { method: "POST", headers: headers(true), body: JSON.stringify(body), signal };
  return (await check(await fetch(path, init))).json();
}

// POST with `stream: true`; yields each event's JSON until `data: [DONE]`.
// An error sent in-band after the stream started is thrown as an ApiError.
export async function* postStream(path, body, signal) {
  const init = { method: "POST", headers: headers(true), body: JSON.stringify({ ...body, stream: true }), signal };
  const response = await check(await fetch(path, init));
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const data = buffer.slice(0, end).replace(/^data: /, "");
      buffer = buffer.slice(end + 2);
      if (data === "[DONE]") return;
      const event = JSON.parse(data);
      if (event.error) throw new ApiError(null, event.error.message, event.error.code);
      yield event;
    }
  }
}

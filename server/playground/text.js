// The text tab: stream a completion token by token, stop it, colour text by log-probability; or, with a model
// that has a chat template, chat: each message sent with the conversation so far, the reply streamed in.

import { postJSON, postStream } from "./api.js";

const utf8 = new TextEncoder();
const $ = (id) => document.getElementById(id);

// Background for a character whose bytes have mean log-probability `logprob`: red unlikely, green likely.
function colour(logprob) {
  const p = Math.exp(logprob);
  return `hsl(${Math.round(120 * p)}, 75%, 82%)`;
}

// One span per character, from echo scoring's tokens. Tokens that share a text offset are one character's bytes
// (a byte model's, or a tokenizer's pieces of one character); a token of several characters colours each of them.
function scoredSpans(choice, unit) {
  const { token_logprobs: logprobs, text_offset: offsets } = choice.logprobs;
  const sums = new Map();
  offsets.forEach((offset, i) => {
    const [sum, count] = sums.get(offset) ?? [0, 0];
    sums.set(offset, [sum + (logprobs[i] ?? 0), count + 1]);
  });
  let current = [null, 0];
  return Array.from(choice.text, (char, offset) => {
    current = sums.get(offset) ?? current; // the token that began at or before this character
    const span = document.createElement("span");
    span.textContent = char;
    const [sum, count] = current;
    if (count > 0) {
      span.style.background = colour(sum / count);
      span.title = `log p = ${sum.toFixed(2)} over ${count} ${unit}${count > 1 ? "s" : ""}`;
    }
    return span;
  });
}

export class TextTab {
  constructor(onError) {
    this.onError = onError;
    this.button = $("generate");
    this.output = $("output");
    this.stats = $("text-stats");
    this.controller = null; // set while generating: the second press stops
    this.tokenizers = new Map(); // model id -> "bytes" or its tokenizer
    this.chatModels = new Set(); // ids of the models that have a chat template
    this.messages = []; // the chat so far: {role, content}
    this.button.addEventListener("click", () => (this.controller ? this.controller.abort() : this.generate()));
    $("score").addEventListener("click", () => this.score());
    $("text-model").addEventListener("change", () => this.setChat());
    $("text-chat").addEventListener("change", () => this.setChat());
    $("new-chat").addEventListener("click", () => this.setChat());
  }

  setModels(models) {
    this.tokenizers = new Map(models.map((model) => [model.id, model.tokenizer]));
    this.chatModels = new Set(models.filter((model) => model.chat_template).map((model) => model.id));
    $("text-model").replaceChildren(...models.map((model) => new Option(`${model.id} (${model.attention})`, model.id)));
    this.setChat();
  }

  get chatting() {
    return $("text-chat").checked;
  }

  // Chat mode on or off: only for a model with a chat template.
  setChat() {
    const chat = $("text-chat");
    chat.disabled = !this.chatModels.has($("text-model").value);
    chat.checked &&= !chat.disabled;
    if (this.chatting || this.messages.length) this.output.replaceChildren(); // a chat on or off starts anew
    this.messages = [];
    $("score").hidden = this.chatting;
    $("new-chat").hidden = !this.chatting;
    $("prompt").setAttribute("aria-label", this.chatting ? "your message" : "prompt");
    this.button.textContent = this.idleLabel;
  }

  get idleLabel() {
    return this.chatting ? "Send" : "Generate";
  }

  request() {
    const body = { model: $("text-model").value, temperature: Number($("text-temperature").value),
                   stream_options: { include_usage: true } };
    if (this.chatting) body.messages = this.messages.slice();
    else body.prompt = $("prompt").value;
    if ($("text-max").value !== "") body.max_tokens = Number($("text-max").value); // else the server's default
    if ($("text-seed").value !== "") body.seed = Number($("text-seed").value);
    return body;
  }

  // The conversation so far, each message on lines of its own, then the reply to come.
  showChat(reply) {
    const lines = this.messages.map((message) => `${message.role}: ${message.content}\n\n`);
    this.output.replaceChildren(...lines, "assistant: ", reply);
  }

  async generate() {
    this.onError(null);
    const chatting = this.chatting;
    const generated = document.createElement("span");
    generated.className = "generated";
    if (chatting) this.messages.push({ role: "user", content: $("prompt").value });
    const body = this.request();
    if (chatting) this.showChat(generated);
    else this.output.replaceChildren(body.prompt, generated);
    const state = await this.stream(chatting ? "v1/chat/completions" : "v1/completions", body, generated);
    if (!chatting) return;
    if (state === "failed") this.messages.pop(); // refused: the message may be sent again
    else {
      this.messages.push({ role: "assistant", content: generated.textContent });
      $("prompt").value = "";
    }
  }

  // Stream one request's first choice into `generated`; returns how it ended.
  async stream(path, body, generated) {
    this.controller = new AbortController();
    this.button.textContent = "Stop";
    const started = performance.now();
    let tokens = 0;
    const bytes = this.tokenizers.get(body.model) === "bytes";
    let state = "finished";
    const show = (what) => {
      const seconds = (performance.now() - started) / 1000;
      this.output.dataset.state = what;
      this.stats.textContent = `${tokens} tokens · ${(tokens / seconds).toFixed(1)} tokens/s · ${what}`;
    };
    try {
      const signal = this.controller.signal;
      for await (const event of postStream(path, body, signal)) {
        // Stop pressed while events were already buffered: show none of them (leaving the loop closes the stream)
        if (signal.aborted) throw new DOMException("stopped", "AbortError");
        if (!event.choices.length) { // the usage event, last: the exact count of the model's tokens
          tokens = event.usage?.completion_tokens ?? tokens;
          continue;
        }
        const choice = event.choices[0];
        const text = choice.text ?? choice.delta?.content ?? ""; // a completion's, or a chat's delta
        generated.append(text);
        // Until the usage event: a byte model's tokens are the text's bytes; a tokenizer's, at least one a chunk
        tokens += bytes ? utf8.encode(text).length : Number(text !== "");
        state = choice.finish_reason ? `finished (${choice.finish_reason})` : "streaming";
        show(state);
      }
    } catch (error) {
      state = error.name === "AbortError" ? "stopped" : "failed";
      if (state === "failed") this.onError(error);
    }
    show(state);
    this.controller = null;
    this.button.textContent = this.idleLabel;
    return state;
  }

  async score() {
    this.onError(null);
    const text = this.output.textContent || $("prompt").value;
    const body = { model: $("text-model").value, prompt: text, max_tokens: 0, echo: true, logprobs: 1 };
    try {
      const answer = await postJSON("v1/completions", body);
      const unit = this.tokenizers.get(body.model) === "bytes" ? "byte" : "token";
      this.output.replaceChildren(...scoredSpans(answer.choices[0], unit));
      this.output.dataset.state = "scored";
      this.stats.textContent = "each character coloured by its probability: red unlikely, green likely (hover for log p)";
    } catch (error) {
      this.onError(error);
    }
  }
}

// The text tab: stream a completion token by token, stop it, colour text by log-probability.

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
    this.button.addEventListener("click", () => (this.controller ? this.controller.abort() : this.generate()));
    $("score").addEventListener("click", () => this.score());
  }

  setModels(models) {
    this.tokenizers = new Map(models.map((model) => [model.id, model.tokenizer]));
    $("text-model").replaceChildren(...models.map((model) => new Option(`${model.id} (${model.attention})`, model.id)));
  }

  request() {
    const body = { model: $("text-model").value, prompt: $("prompt").value, max_tokens: Number($("text-max").value),
                   temperature: Number($("text-temperature").value), stream_options: { include_usage: true } };
    if ($("text-seed").value !== "") body.seed = Number($("text-seed").value);
    return body;
  }

  async generate() {
    this.onError(null);
    const body = this.request();
    const generated = document.createElement("span");
    generated.className = "generated";
    this.output.replaceChildren(body.prompt, generated);
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
      for await (const event of postStream("v1/completions", body, signal)) {
        // Stop pressed while events were already buffered: show none of them (leaving the loop closes the stream)
        if (signal.aborted) throw new DOMException("stopped", "AbortError");
        if (!event.choices.length) { // the usage event, last: the exact count of the model's tokens
          tokens = event.usage?.completion_tokens ?? tokens;
          continue;
        }
        const choice = event.choices[0];
        generated.append(choice.text);
        // Until the usage event: a byte model's tokens are the text's bytes; a tokenizer's, at least one a chunk
        tokens += bytes ? utf8.encode(choice.text).length : Number(choice.text !== "");
        state = choice.finish_reason ? `finished (${choice.finish_reason})` : "streaming";
        show(state);
      }
    } catch (error) {
      state = error.name === "AbortError" ? "stopped" : "failed";
      if (state === "failed") this.onError(error);
    }
    show(state);
    this.controller = null;
    this.button.textContent = "Generate";
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

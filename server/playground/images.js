// The image tab: every chosen model completes the editor's digit side by side, row by row.

import { postStream } from "./api.js";
import { drawDigit, SIDE } from "./editor.js";
import { PARTICLES_DONE, progressText, sampleText, usageText } from "./particles.js";

function formatBytes(bytes) {
  if (bytes >= 1 << 20) return `${(bytes / (1 << 20)).toFixed(1)} MiB`;
  return `${Math.round(bytes / 1024)} KiB`;
}

function element(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text) node.textContent = text;
  return node;
}

// One model's completions: n canvases that start as the input and fill in as rows arrive.
class ModelPanel {
  constructor(model, n, editor) {
    this.model = model;
    this.n = n;
    this.node = element("article", "panel card");
    this.node.dataset.model = model.id;
    this.node.append(element("h2", null, `${model.id}`), element("p", "attention", model.attention));
    this.stats = this.node.appendChild(element("p", "stats"));
    this.particles = this.node.appendChild(element("p", "particles"));
    this.bar = this.node.appendChild(Object.assign(element("progress"), { max: SIDE, value: 0, hidden: true }));
    const grid = this.node.appendChild(element("div", "completions"));
    this.canvases = Array.from({ length: n }, () => {
      const canvas = grid.appendChild(element("canvas", "digit"));
      canvas.width = canvas.height = SIDE;
      drawDigit(canvas, editor.pixels, editor.unknown);
      return canvas;
    });
    this.done = 0;
    this.started = performance.now();
    this.setState("running");
  }

  handle(event) {
    if (event.object === "image.completion.progress") this.progress(event.rows_drawn);
    else if (event.object === "image.completion.row") this.row(event.index, event.row, event.pixels);
    else if (event.object === "image.completion") this.finished(event);
    else if (event.object === "image.completion.usage") return this.finish(event.usage);
    this.setState("running");
  }

  // Particles are running: their rows may still be replaced, so only the count is shown.
  progress(rowsDrawn) {
    this.bar.hidden = false;
    this.bar.value = rowsDrawn;
    this.particles.textContent = progressText(rowsDrawn);
  }

  particlesDone() {
    this.bar.value = SIDE;
    this.particles.textContent = PARTICLES_DONE;
  }

  finished(event) {
    this.done += 1;
    if (event.particles) this.canvases[event.index].title = sampleText(event.index, event.particles);
  }

  finish(usage) {
    this.bar.hidden = true;
    this.particles.textContent = usageText(usage.particles);
    if (usage.particles.note) this.particles.append(element("span", "note", usage.particles.note));
    this.setState("done", usage.seconds);
  }

  row(index, row, pixels) {
    if (!this.bar.hidden && this.bar.value < SIDE) this.particlesDone(); // the first fixed row
    const context = this.canvases[index].getContext("2d");
    const line = context.createImageData(SIDE, 1);
    pixels.forEach((grey, col) => line.data.set([grey, grey, grey, 255], 4 * col));
    context.putImageData(line, 0, row);
  }

  setState(state, seconds = (performance.now() - this.started) / 1000) {
    this.node.dataset.state = state;
    const rate = this.done > 0 ? (this.done / seconds).toFixed(2) : "–";
    const when = state === "done" ? `finished in ${seconds.toFixed(2)} s` : `${state} ${seconds.toFixed(1)} s`;
    this.stats.textContent = `${rate} images/s · ${when} · ${formatBytes(this.model.state_bytes_per_sequence)} state/sequence`;
  }

  fail(message) {
    this.setState("failed");
    this.node.append(element("p", "error", message));
  }
}

export class ImageTab {
  constructor(editor, onError) {
    this.editor = editor;
    this.onError = onError;
    this.button = document.getElementById("complete");
    this.picker = document.getElementById("image-models");
    this.panels = document.getElementById("panels");
    this.models = [];
    this.controller = null; // set while a completion runs: the second press aborts it
    this.button.addEventListener("click", () => (this.controller ? this.controller.abort() : this.run()));
  }

  setModels(models) {
    this.models = models;
    this.picker.querySelectorAll("label").forEach((label) => label.remove());
    for (const model of models) {
      const label = this.picker.appendChild(element("label"));
      const box = label.appendChild(element("input"));
      Object.assign(box, { type: "checkbox", value: model.id, checked: true });
      label.append(` ${model.id} `, element("span", "attention", model.attention)); // the attention kind, as the panel shows it
    }
  }

  request() {
    const number = (id) => document.getElementById(id).value;
    const body = {
      pixels: this.editor.grid(this.editor.pixels),
      mask: this.editor.grid(this.editor.unknown),
      n: Number(number("image-n")),
      temperature: Number(number("image-temperature")),
    };
    if (number("image-seed") !== "") body.seed = Number(number("image-seed"));
    if (number("image-particles") !== "") body.particles = Number(number("image-particles")); // empty: the server's default
    return body;
  }

  async run() {
    this.onError(null);
    const chosen = new Set([...this.picker.querySelectorAll("input:checked")].map((box) => box.value));
    const models = this.models.filter((model) => chosen.has(model.id));
    if (models.length === 0) return this.onError(new Error("choose at least one model"));
    const body = this.request();
    const panels = models.map((model) => new ModelPanel(model, body.n, this.editor));
    this.panels.replaceChildren(...panels.map((panel) => panel.node));
    this.controller = new AbortController();
    this.button.textContent = "Cancel";
    await Promise.all(panels.map((panel) => this.complete(panel, { ...body, model: panel.model.id })));
    this.controller = null;
    this.button.textContent = "Complete";
  }

  async complete(panel, body) {
    try {
      for await (const event of postStream("v1/images/completions", body, this.controller.signal)) panel.handle(event);
    } catch (error) {
      if (error.name === "AbortError") return panel.setState("cancelled");
      panel.fail(error.message);
      if (error.status === 401) this.onError(error);
    }
  }
}

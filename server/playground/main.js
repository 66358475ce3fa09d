// Wires the page: tabs, the API key form, the model lists, the example digits.

import { ApiError, getJSON, setKey } from "./api.js";
import { DigitEditor, drawDigit, PIXELS, SIDE } from "./editor.js";
import { ImageTab } from "./images.js";
import { TextTab } from "./text.js";

// The first digit of each class 0-9 in the MNIST test set (t10k indices 3, 2, 1, 18, 4, 8, 11, 0, 61, 7).
const EXAMPLES_URL = "playground/static/digits.png";
const $ = (id) => document.getElementById(id);

function showError(error) {
  const box = $("error");
  box.textContent = error ? error.message : "";
  box.hidden = !error;
  if (error instanceof ApiError && error.status === 401) {
    $("key-form").hidden = false;
    $("key-input").focus();
  }
}

function selectTab(name) {
  for (const tab of document.querySelectorAll("[role=tab]")) {
    const selected = tab.getAttribute("aria-controls") === name;
    tab.setAttribute("aria-selected", String(selected));
    $(tab.getAttribute("aria-controls")).hidden = !selected;
  }
}

async function loadModels(imageTab, textTab) {
  try {
    const models = (await getJSON("v1/models")).data;
    imageTab.setModels(models.filter((model) => model.task === "mnist"));
    textTab.setModels(models.filter((model) => model.task === "text"));
    $("key-form").hidden = true;
    showError(null);
  } catch (error) {
    showError(error);
  }
}

// The examples are one strip of 28x28 digits side by side; each becomes a button.
async function loadExamples(editor) {
  const image = new Image();
  image.src = EXAMPLES_URL;
  await image.decode();
  const canvas = Object.assign(document.createElement("canvas"), { width: image.width, height: SIDE });
  const context = canvas.getContext("2d", { willReadFrequently: true });
  context.drawImage(image, 0, 0);
  const digits = [];
  for (let x = 0; x < image.width; x += SIDE) {
    const rgba = context.getImageData(x, 0, SIDE, SIDE).data;
    digits.push(Uint8ClampedArray.from({ length: PIXELS }, (_, i) => rgba[4 * i]));
  }
  $("examples").replaceChildren(...digits.map((pixels, label) => exampleButton(editor, pixels, label)));
  return digits;
}

function exampleButton(editor, pixels, label) {
  const button = Object.assign(document.createElement("button"), { type: "button", title: `example ${label}` });
  const canvas = button.appendChild(Object.assign(document.createElement("canvas"), { width: SIDE, height: SIDE }));
  drawDigit(canvas, pixels);
  button.addEventListener("click", () => editor.load(pixels));
  return button;
}

async function main() {
  const editor = new DigitEditor($("editor"));
  const imageTab = new ImageTab(editor, showError);
  const textTab = new TextTab(showError);
  for (const tab of document.querySelectorAll("[role=tab]")) {
    tab.addEventListener("click", () => selectTab(tab.getAttribute("aria-controls")));
  }
  for (const input of document.querySelectorAll("[name=tool]")) {
    input.addEventListener("change", () => (editor.tool = input.value));
  }
  for (const button of document.querySelectorAll("[data-preset]")) {
    button.addEventListener("click", () => editor.preset(button.dataset.preset));
  }
  $("clear").addEventListener("click", () => editor.clear());
  $("key-form").addEventListener("submit", (event) => {
    event.preventDefault();
    setKey($("key-input").value);
    $("key-input").value = ""; // the key is kept in api.js only
    loadModels(imageTab, textTab);
  });
  const [digits] = await Promise.all([loadExamples(editor), loadModels(imageTab, textTab)]);
  editor.load(digits[2]);
  editor.preset("bottom");
  document.body.dataset.ready = "true"; // for tests and scripts: models and examples are in
}

main().catch(showError);

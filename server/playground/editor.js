// A 28x28 digit to draw on, and which of its pixels are unknown (to be completed).

export const SIDE = 28;
export const PIXELS = SIDE * SIDE;
const BRUSH_RADIUS = 1.6; // in pixels: strokes about as thick as MNIST's pen
const HIDE_RADIUS = 1.5;
const PRESETS = {
  bottom: (row, col) => row >= SIDE / 2,
  right: (row, col) => col >= SIDE / 2,
  centre: (row, col) => row >= 7 && row < 21 && col >= 7 && col < 21,
  none: () => false,
};

// Writes one pixel into RGBA data: known pixels as pure grey, unknown ones darker and tinted
// blue, so the two never look alike (and a test can tell them apart: blue > red only if unknown).
export function paintPixel(data, index, grey, unknown) {
  const o = 4 * index;
  const shade = unknown ? Math.round(grey * 0.4) : grey;
  data[o] = shade;
  data[o + 1] = shade;
  data[o + 2] = unknown ? shade + 90 : shade;
  data[o + 3] = 255;
}

export function drawDigit(canvas, pixels, unknown) {
  const context = canvas.getContext("2d");
  const image = context.createImageData(SIDE, SIDE);
  for (let i = 0; i < PIXELS; i++) paintPixel(image.data, i, pixels[i], unknown ? unknown[i] : 0);
  context.putImageData(image, 0, 0);
}

export class DigitEditor {
  constructor(canvas) {
    this.canvas = canvas;
    this.pixels = new Uint8ClampedArray(PIXELS); // grey levels 0-255
    this.unknown = new Uint8Array(PIXELS); // 1 = to be completed
    this.tool = "draw";
    this.last = null; // the previous pointer position of a stroke, in pixels
    canvas.addEventListener("pointerdown", (e) => {
      canvas.setPointerCapture(e.pointerId);
      this.last = null;
      this.stroke(e);
    });
    canvas.addEventListener("pointermove", (e) => e.buttons && this.stroke(e));
    canvas.addEventListener("pointerup", () => (this.last = null));
    this.render();
  }

  load(pixels) {
    this.pixels.set(pixels);
    this.render();
  }

  clear() {
    this.pixels.fill(0);
    this.render();
  }

  preset(name) {
    for (let i = 0; i < PIXELS; i++) this.unknown[i] = PRESETS[name](Math.floor(i / SIDE), i % SIDE) ? 1 : 0;
    this.render();
  }

  // 28 rows of 28 values, as the API takes `pixels` and `mask`.
  grid(values) {
    return Array.from({ length: SIDE }, (_, row) => Array.from(values.subarray(row * SIDE, (row + 1) * SIDE)));
  }

  stroke(event) {
    const box = this.canvas.getBoundingClientRect();
    const point = { x: ((event.clientX - box.left) / box.width) * SIDE, y: ((event.clientY - box.top) / box.height) * SIDE };
    const from = this.last ?? point;
    const steps = Math.max(1, Math.ceil(Math.hypot(point.x - from.x, point.y - from.y) * 4));
    for (let s = 1; s <= steps; s++) {
      const t = s / steps; // fill the gap between pointer events
      this.brush(from.x + (point.x - from.x) * t, from.y + (point.y - from.y) * t);
    }
    this.last = point;
    this.render();
  }

  brush(x, y) {
    for (let row = Math.floor(y - 2); row <= y + 2; row++) {
      for (let col = Math.floor(x - 2); col <= x + 2; col++) {
        if (row < 0 || row >= SIDE || col < 0 || col >= SIDE) continue;
        const distance = Math.hypot(col + 0.5 - x, row + 0.5 - y);
        this.touch(row * SIDE + col, distance);
      }
    }
  }

  touch(index, distance) {
    const ink = 255 * Math.min(1, Math.max(0, BRUSH_RADIUS - distance)); // soft edge, like a scanned pen
    if (this.tool === "draw") this.pixels[index] = Math.max(this.pixels[index], ink);
    else if (this.tool === "erase") this.pixels[index] = Math.min(this.pixels[index], 255 - ink);
    else if (distance < HIDE_RADIUS) this.unknown[index] = this.tool === "hide" ? 1 : 0;
  }

  render() {
    drawDigit(this.canvas, this.pixels, this.unknown);
  }
}

// Sequential Monte Carlo figures of an image completion, worded for a panel.
// With particles > 1 the server streams progress while they run (rows may still be replaced),
// then each completion's rows once its particles have finished.

import { SIDE } from "./editor.js";

// log p(known pixels) in nats; null when the known pixels got probability 0 (top-k/top-p cut them).
function logLikelihood(nats) {
  return nats === null ? "-∞" : nats.toFixed(2);
}

function plural(count, word) {
  return `${count} ${word}${count === 1 ? "" : "s"}`;
}

export const PARTICLES_DONE = "particles finished: rows arriving";

export function progressText(rowsDrawn) {
  return `particles running: ${rowsDrawn} of ${SIDE} rows drawn`;
}

// The answer's usage.particles: the effective sample size is the samples' lowest final one,
// log p(known pixels) their estimates averaged in probability.
export function usageText(usage) {
  const count = `${plural(usage.per_sample, "particle")}/sample`;
  if (usage.resamplings === undefined) return count;
  return `${count} · ${plural(usage.resamplings, "resampling")} · final ESS ≥ ${usage.effective_sample_size.toFixed(2)}`
    + ` · log p(known pixels) = ${logLikelihood(usage.known_log_likelihood)} nats`;
}

// One completion's own figures (its data entry's `particles`), for its canvas's tooltip.
export function sampleText(index, particles) {
  return `sample ${index}: ${plural(particles.resamplings, "resampling")} · final ESS ${particles.effective_sample_size.toFixed(2)}`
    + ` · log p(known pixels) = ${logLikelihood(particles.known_log_likelihood)} nats`;
}

"""Named architecture + optimiser presets for `rnnserve train --preset`."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Preset:
    n_layers: int
    d_model: int
    n_heads: int
    d_ff: int
    batch_size: int
    lr: float

    def architecture(self) -> dict[str, int]:
        """The ModelConfig fields this preset sets."""
        return {"n_layers": self.n_layers, "d_model": self.d_model, "n_heads": self.n_heads, "d_ff": self.d_ff}


PRESETS: dict[str, Preset] = {
    # Tests and smoke runs: trains in seconds.
    "tiny": Preset(n_layers=2, d_model=32, n_heads=2, d_ff=64, batch_size=8, lr=3e-3),
    # Learns fastest per minute on a 2-core CPU (throughput in benchmarks/results/NOTES.md, "Measurements behind design choices").
    "cpu": Preset(n_layers=4, d_model=128, n_heads=4, d_ff=512, batch_size=16, lr=1e-3),
    # The MNIST model size of "Transformers are RNNs" (Katharopoulos et al. 2020).
    "paper": Preset(n_layers=8, d_model=256, n_heads=8, d_ff=1024, batch_size=32, lr=5e-4),
}

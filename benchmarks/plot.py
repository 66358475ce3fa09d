"""Figures for the decode benchmark, drawn from its JSON-shaped result dict."""

from __future__ import annotations

from pathlib import Path

COLORS = {"softmax": "tab:red", "linear": "tab:blue", "linformer": "tab:green", "reformer": "tab:purple"}


def plot_decode(result: dict, path: str | Path) -> None:
    """Three panels: step time vs position, state bytes vs position, images/s vs batch size."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    fig, (ax_time, ax_state, ax_images) = plt.subplots(1, 3, figsize=(19, 4.8))
    for kind, points in result["positions"].items():
        pos = [p["position"] for p in points]
        ax_time.plot(pos, [p["step_seconds_min"] * 1e3 for p in points], "o-", label=kind, color=COLORS.get(kind))
        ax_state.plot(
            pos, [p["state_bytes_per_sequence"] / 2**20 for p in points], "o-", label=kind, color=COLORS.get(kind)
        )
    batch = result["settings"]["position_batch"]
    _labels(ax_time, "position (tokens already decoded)", "ms per decoding step", f"one step, batch {batch}")
    ax_state.set_yscale("log")  # flat KiB states and growing MiB caches on one axis
    _labels(ax_state, "position (tokens already decoded)", "MiB of decode state per sequence", "decode state")
    _images_panel(ax_images, result)
    env = result["environment"]
    fig.suptitle(
        f"rnnserve bench: {env['processor']}, {env['torch_threads']} threads, device {env['device']}, "
        f"{result['settings']['dtype']}",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


PEER_COLORS = ["tab:orange", "tab:brown", "tab:pink", "tab:gray", "tab:olive", "tab:cyan"]


def _line_style(name: str, peers_seen: int) -> tuple[str, str | None]:
    """An rnnserve kind in its colour (its eager path dashed), a peer in a colour of its own, as squares."""
    if name.startswith("peer:"):
        return "s:", PEER_COLORS[peers_seen % len(PEER_COLORS)]
    return ("o--" if name.endswith("(eager)") else "o-"), COLORS.get(name.split(" ")[0])


def _images_panel(ax, result: dict) -> None:
    kinds = list(dict.fromkeys(r["kind"] for r in result["images"]))
    for kind in kinds:
        rows = [r for r in result["images"] if r["kind"] == kind]
        style, color = _line_style(kind, sum(k.startswith("peer:") for k in kinds[: kinds.index(kind)]))
        ax.plot([r["batch"] for r in rows], [r["images_per_s"] for r in rows], style, label=kind, color=color)
    if result["no_cache"]:
        rows = result["no_cache"]
        ax.plot(
            [r["batch"] for r in rows],
            [r["images_per_s"] for r in rows],
            "x--",
            color="black",
            label="softmax no cache (extrapolated)",
        )
    batches = sorted({r["batch"] for r in result["images"]})
    ax.set_xscale("log", base=2)
    ax.set_xticks(batches, [str(b) for b in batches])
    ax.set_yscale("log")
    tokens = result["settings"]["image_tokens"]
    _labels(ax, "batch size", f"generations of {tokens} tokens per second", "throughput")
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.02, 0.5))  # a dozen lines: beside the panel


def _labels(ax, xlabel: str, ylabel: str, title: str) -> None:
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)

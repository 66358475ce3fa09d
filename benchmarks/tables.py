"""Plain-text tables for the decode benchmark report: what `rnnserve bench` prints."""

from __future__ import annotations

from .decode_images import layout
from .decode_report import DecodeReport
from .docs_tables import cache_dtype, fma_peak_clause


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:,.1f}x"


def _rate(value: float) -> str:
    return f"{value:,.2f}" if value >= 1 else f"{value:.4f}"


def images_table(report: DecodeReport) -> str:
    tokens = report.settings["image_tokens"]
    head = (
        "| kind | batch | images/s | tokens/s | vs softmax+cache | vs softmax no-cache | images per CPU-s | "
        f"vs softmax+cache by CPU time | state bytes/seq @{tokens} |"
    )
    lines = [head, "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in report.images:
        model = report.models.get(r.kind if r.group == "rnnserve" else r.rival)
        state = f"{model.state_bytes_per_sequence:,}" if r.group != "peer" and model else "-"
        kind = f"{r.kind} (CUDA graphs)" if r.cuda_graphs else f"{r.kind} (compiled)" if r.compiled else r.kind
        kind += f", {layout(r)}" if r.threads_per_worker is not None else ""
        lines.append(
            f"| {kind} | {r.batch} | {_rate(r.images_per_s)} | {r.tokens_per_s:,.0f} | "
            f"{_ratio(r.vs_softmax_cache)} | {_ratio(r.vs_no_cache)} | {_rate(r.images_per_cpu_s)} | "
            f"{_ratio(r.vs_softmax_cache_cpu)} | {state} |"
        )
    for n in report.no_cache:
        lines.append(
            f"| softmax, no cache (extrapolated from {n.measured_pixels} px + "
            f"{len(n.sampled_steps)} sampled steps) | {n.batch} | {_rate(n.images_per_s)} | "
            f"{n.tokens_per_s:,.1f} | - | 1.0x | - | - | 0 |"
        )
    return "\n".join(lines)


def positions_table(report: DecodeReport) -> str:
    kinds = list(report.positions)
    if not kinds:
        return ""
    head = "| position | " + " | ".join(f"{k} ms/step | {k} state KiB/seq" for k in kinds) + " |"
    lines = [head, "|---:|" + "---:|---:|" * len(kinds)]
    by_kind = {k: {p.position: p for p in pts} for k, pts in report.positions.items()}
    for pos in sorted({p for pts in by_kind.values() for p in pts}):
        cells = []
        for k in kinds:
            p = by_kind[k].get(pos)
            cells += (
                ["-", "-"]
                if p is None
                else [f"{p.step_seconds_min * 1e3:.3f}", f"{p.state_bytes_per_sequence / 1024:,.1f}"]
            )
        lines.append(f"| {pos:,} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def comparisons_table(report: DecodeReport) -> str:
    """rnnserve's kinds against their eager path and their peers, same run."""
    if not report.comparisons:
        return ""
    lines = [
        "| batch | rnnserve | images/s | against | images/s | ratio | ratio by CPU time |",
        "|---:|---|---:|---|---:|---:|---:|",
    ]
    for c in report.comparisons:
        ours, theirs = _with_layout(c, "rnnserve"), _with_layout(c, "against")
        lines.append(
            f"| {c['batch']} | {ours} | {_rate(c['rnnserve_images_per_s'])} | {theirs} | "
            f"{_rate(c['against_images_per_s'])} | **{c['ratio']:.2f}x** | {c['ratio_cpu_time']:.2f}x |"
        )
    return "\n".join(lines)


def _with_layout(comparison: dict, side: str) -> str:
    """A comparison's side, with its process layout when either side ran in worker processes."""
    layouts = (comparison.get("rnnserve_layout", "in-process"), comparison.get("against_layout", "in-process"))
    name = comparison[side]
    return name if layouts == ("in-process", "in-process") else f"{name} ({comparison[side + '_layout']})"


def peers_table(report: DecodeReport) -> str:
    if not report.peers:
        return ""
    lines = ["| peer | compared with | kept between steps | sampling |", "|---|---|---|---|"]
    lines += [f"| {p['name']} | {p['rival']} | {p['cache']} | {p['sampling']} |" for p in report.peers]
    return "\n".join(lines)


def compile_line(report: DecodeReport) -> str:
    if not report.compile_seconds:
        return ""
    parts = [
        f"{name}: " + ", ".join(f"{cls} {s:.1f} s" for cls, s in classes.items())
        for name, classes in report.compile_seconds.items()
        if classes
    ]
    return "Compile times (torch.compile, and the C++ kernels' build or load; outside the timings): " + (
        "; ".join(parts) or "all cached"
    )


def load_line(report: DecodeReport) -> str:
    before, after = report.load.get("before", {}), report.load.get("after", {})
    if not before or not after:
        return ""
    return (
        f"Machine load (1-minute average, {report.environment['cpu_count']} CPUs): {before['load_1min']:.2f} at "
        f"the start, {after['load_1min']:.2f} at the end; 15-minute average {after['load_15min']:.2f}."
    )


def targets_table(report: DecodeReport) -> str:
    lines = ["| target | measured | threshold | met |", "|---|---:|---|---|"]
    for t in report.targets:
        measured = t["measured"]
        if isinstance(measured, float):
            measured = f"{measured:,.2f}"
        lines.append(f"| {t['name']} | {measured} | {t['threshold']} | {'yes' if t['met'] else 'NO'} |")
    return "\n".join(lines)


def _bound(value: float | None) -> str:
    return "-" if value is None else f"{value:,.1f}"


def roofline_table(report: DecodeReport) -> str:
    if not report.roofline:
        return ""
    m = report.machine
    measured_here = (
        (
            f"this machine measured: {m['copy_bytes_per_s'] / 1e9:.1f} GB/s copy, "
            f"{m['matmul_flops'] / 1e9:.0f} GFLOP/s {m['matmul_dtype']} matmul ({m.get('matmul_route', 'torch.mm')}), "
            f"{m['threads']} threads{fma_peak_clause(m)}"
        )
        if m
        else "no bound for this device: its rates were not measured"
    )
    lines = [
        f"Per generated token at the mean position of a generation, batch "
        f"{next(iter(report.roofline.values()))['batch']} ({measured_here}):",
        "| kind | MFLOP/token | attention kFLOP/token | state KB moved/token | bound here images/s | "
        "measured images/s | bound H100 images/s (datasheet, not measured) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    measured = {(r.kind, r.batch): r.images_per_s for r in report.images}
    for kind, c in report.roofline.items():
        lines.append(
            f"| {kind} | {c['flops'] / 1e6:.2f} | {c['attention_flops'] / 1e3:,.1f} | "
            f"{c['state_bytes_moved'] / 1e3:,.1f} | {_bound(c['bound_images_per_s_here'])} | "
            f"{_rate(measured.get((kind, c['batch']), float('nan')))} | {c['bound_images_per_s_h100']:,.0f} |"
        )
    return "\n".join(lines)


def one_call_text(env: dict) -> str:
    """Which kinds' steps ran as one C++ call each (not recorded before that call existed)."""
    kinds = env.get("one_call_steps")
    return "" if not kinds else f"; {', '.join(kinds)} steps as one C++ call"


def full_report(report: DecodeReport) -> str:
    env = report.environment
    s = report.settings
    parts = [
        f"Machine: {env['processor']} ({env.get('cpu_class', 'CPU class not recorded')}: "
        f"{', '.join(env.get('vector_features', [])) or 'no vector features recorded'}; kernels' route "
        f"{env.get('cpu_route', 'not recorded')}, linear layers on "
        f"{'the packed kernel' if env.get('packed_linear') else 'PyTorch'}{one_call_text(env)}), "
        f"{env['cpu_count']} CPUs, "
        f"torch {env['torch']} "
        f"({env['torch_threads']} threads), device {env['device']}, {s['dtype']} weights, keys and values "
        f"cached in {cache_dtype(s)}. Times: best of {s['repeats']} run(s), "
        "kinds taking turns.",
        load_line(report),
        compile_line(report),
        "",
        f"Generations of {s['image_tokens']} tokens from BOS, batch at a time (model.decode.generate.generate):",
        images_table(report),
        "",
        f"One decoding step (model forward of 1 token, batch {s['position_batch']}, best of "
        f"{s['steps_per_position']} steps) and decode state per sequence, against position:",
        positions_table(report),
        "",
        roofline_table(report),
        "",
        "Against the eager path and the peers (same run, ratio of images/s):",
        comparisons_table(report),
        "",
        peers_table(report),
        "",
        "Targets (issues 5 and 16):",
        targets_table(report),
    ]
    return "\n".join(parts)

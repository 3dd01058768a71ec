"""`eagleserve bench`'s runs as a table on the terminal and a plot of throughput by batch size."""

from pathlib import Path

TABLE = {  # column: width
    "mode": 6, "K": 4, "M": 2, "graphs": 6, "ovl": 4, "batch": 5, "tok/s": 9, "req/s": 7,
    "acc len": 7, "tok/step": 8, "auto K": 6, "ttft p50": 9, "itl p50": 8, "gpu busy": 8,
    "nvml": 5, "extra": 6,
}  # fmt: skip


def print_table(runs: list[dict]) -> None:
    def percent(x):
        return f"{x:.0%}" if x is not None else "-"

    def ms(x, digits):
        return f"{x:.{digits}f}m" if x is not None else "-"

    print(" ".join(f"{name:>{width}}" for name, width in TABLE.items()))
    for r in runs:
        cells = [
            r["mode"], r["k"], r.get("siblings", 0), str(r["cuda_graphs"]), str(r["overlap"]),
            r["batch"], f"{r['output_tokens_per_s']:.1f}", f"{r['requests_per_s']:.2f}",
            f"{r['mean_acceptance_length']:.2f}", f"{r.get('tokens_per_step', 0):.2f}",
            _mean_k(r.get("auto_steps_by_k")), ms(r["ttft_ms"]["p50"], 1),
            ms(r["itl_ms"]["p50"], 2), percent(r["gpu_busy_fraction"]),
            percent(r["nvml_busy_fraction"]), f"{r['extra_pass_share']:.1%}",
        ]  # fmt: skip
        print(" ".join(f"{cell:>{width}}" for cell, width in zip(cells, TABLE.values())))
    print("each load timed after an untimed run of its batch (graphs, kernels and grammars warm)")


def _mean_k(steps_by_k: list[int] | None) -> str:
    """The mean K that num_draft_tokens auto chose over a run's steps ("-": not auto)."""
    if not steps_by_k or not sum(steps_by_k):
        return "-"
    return f"{sum(k * n for k, n in enumerate(steps_by_k)) / sum(steps_by_k):.2f}"


def plot(runs: list[dict], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return False
    fig, ax = plt.subplots(figsize=(7, 4.5))
    keys = sorted(  # K may be "auto", after the numbers
        {(r["mode"], r["k"], r.get("siblings", 0), r["cuda_graphs"], r["overlap"]) for r in runs},
        key=lambda key: (key[0], str(key[1]).rjust(4), *key[2:]),
    )
    for mode, k, m, g, o in keys:
        pts = sorted(
            (r["batch"], r["output_tokens_per_s"])
            for r in runs
            if (r["mode"], r["k"], r.get("siblings", 0), r["cuda_graphs"], r["overlap"])
            == (mode, k, m, g, o)
        )
        label = (
            f"{mode}{f' K={k}' if k else ''}{f' M={m}' if m else ''}{' graphs' if g else ''}"
            f"{' overlap' if o and mode != 'plain' else ''}"
        )
        ax.plot(*zip(*pts), marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size (concurrent requests)")
    ax.set_ylabel("output tokens/s")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True

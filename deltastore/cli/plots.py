"""PNG pictures for ``deltastore inspect --plot`` (matplotlib: the ``plot`` extra)."""

from __future__ import annotations

from collections.abc import Sequence


def _pyplot():  # type: ignore[no-untyped-def]
    import matplotlib  # ImportError → the CLI's one-line hint to install the 'plot' extra

    matplotlib.use("Agg")  # files only, never a window
    import matplotlib.pyplot as plt

    return plt


def plot_version(info: dict[str, object], path: str, *, title: str) -> None:
    """Per tensor of one version: density (%) and wire bytes, as two bar charts."""
    plt = _pyplot()
    names, density, wire = [], [], []
    for tensors in dict(info["shards"]).values():  # type: ignore[call-overload]
        for name, entry in tensors.items():
            names.append(name)
            density.append(100 * (entry["density"] or 0.0))
            wire.append(entry["bytes"])
    height = max(4.0, 0.25 * len(names) + 2)
    fig, (ax_density, ax_wire) = plt.subplots(1, 2, figsize=(12, height), sharey=True)
    ax_density.barh(names, density, color="tab:blue")
    ax_density.set_xlabel("density (% of the tensor's bytes changed)")
    ax_density.invert_yaxis()
    ax_wire.barh(names, wire, color="tab:orange")
    ax_wire.set_xlabel("wire bytes (compressed payload)")
    fig.suptitle(f"{title}: {info['kind']}, {info['encoding']}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_history(rows: Sequence[dict[str, object]], path: str, *, title: str) -> None:
    """Per version: wire bytes (bars; full versions marked) and density (line)."""
    fig = history_figure(rows, title=title)
    fig.savefig(path, dpi=100)
    _pyplot().close(fig)


def history_figure(rows: Sequence[dict[str, object]], *, title: str):  # type: ignore[no-untyped-def]
    """The figure :func:`plot_history` saves."""
    plt = _pyplot()
    from matplotlib.ticker import MaxNLocator

    healthy = [r for r in rows if r["kind"] != "corrupt"]
    versions = [int(r["version"]) for r in healthy]  # type: ignore[call-overload]
    wire_mb = [int(r["wire_bytes"]) / 1e6 for r in healthy]  # type: ignore[call-overload]
    colors = ["tab:red" if r["kind"] == "full" else "tab:blue" for r in healthy]
    fig, ax_wire = plt.subplots(figsize=(10, 4.5))
    ax_wire.bar(versions, wire_mb, color=colors)
    ax_wire.set_xlabel("version")
    ax_wire.xaxis.set_major_locator(MaxNLocator(integer=True))  # versions are whole numbers
    ax_wire.set_ylabel("wire MB (bars; red = full version)")
    ax_density = ax_wire.twinx()
    points = [
        (v, 100 * float(r["density"]))  # type: ignore[arg-type]
        for v, r in zip(versions, healthy)
        if r["density"] is not None
    ]
    if points:
        xs, ys = zip(*points)
        ax_density.plot(xs, ys, color="black", marker="o")
    ax_density.set_ylabel("density % (line)")
    ax_density.set_ylim(0, 2.2 * max((y for _, y in points), default=1.0))  # below the labels
    positive = [w for w in wire_mb if w > 0]
    if positive and max(positive) > 20 * min(positive):  # a full version next to deltas
        ax_wire.set_yscale("log")
        ax_wire.set_ylabel("wire MB, log scale (bars; red = full version)")
        ax_wire.set_ylim(top=4 * max(positive))  # room for the labels
    elif positive:
        ax_wire.set_ylim(0, 1.2 * max(positive))
    for row, version, wire in zip(healthy, versions, wire_mb):
        label = f"full\n{wire:.3g}" if row["kind"] == "full" else f"{wire:.3g}"
        ax_wire.annotate(
            label,
            (version, wire),
            textcoords="offset points",
            xytext=(0, 2),
            ha="center",
            va="bottom",
            fontsize=8,
        )
    ax_wire.set_title(f"{title}: {len(healthy)} version(s)")
    fig.tight_layout()
    return fig

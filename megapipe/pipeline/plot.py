"""Timeline pictures of simulated (and later measured) schedules, like the papers' figures.

One row per rank, one cell per action from its start to its end, coloured by kind (F blue,
B teal, W grey, BW orange; later chunks darker) and labelled with the microbatch.
"""

from __future__ import annotations

from megapipe.plan.actions import Action

Timeline = list[tuple[int, Action, float, float]]  # (rank, action, start, end)

KIND_COLOURS = {
    "F": ("#9ecae1", "#3182bd", "#08519c"),
    "B": ("#a1d99b", "#31a354", "#006d2c"),
    "W": ("#d9d9d9", "#969696", "#525252"),
    "BW": ("#fdae6b", "#e6550d", "#a63603"),
}


def _colour(action: Action) -> str:
    shades = KIND_COLOURS[action.kind]
    return shades[min(action.chunk, len(shades) - 1)]


def draw_timeline(ax, timeline: Timeline, pp: int, title: str = "") -> None:
    """Draw one schedule's timeline on ``ax``: rank 0 at the top."""
    makespan = max((end for *_, end in timeline), default=1.0)
    for rank, action, start, end in timeline:
        ax.barh(
            rank,
            end - start,
            left=start,
            height=0.9,
            color=_colour(action),
            edgecolor="white",
            linewidth=0.5,
        )
        if (end - start) / makespan > 0.012:  # label only cells wide enough to read
            label = (
                str(action.microbatch)
                if action.segment is None
                else f"{action.microbatch}.{action.segment}"
            )
            ax.text((start + end) / 2, rank, label, ha="center", va="center", fontsize=6)
    ax.set_yticks(range(pp), [f"rank {r}" for r in range(pp)])
    ax.set_ylim(pp - 0.5, -0.5)
    ax.set_xlim(0, makespan)
    ax.set_xlabel("time")
    if title:
        ax.set_title(title, fontsize=9, loc="left")


def save_timelines(panels: list[tuple[str, Timeline, int]], path: str) -> None:
    """Stack one subplot per (title, timeline, pp) on a shared time axis and write a PNG."""
    # matplotlib (~1 s to import) only when a picture is asked for: the schedule tool's text
    # and JSON output, the timeline and study code import this module without drawing
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    height = sum(0.35 * pp + 0.8 for _, _, pp in panels)
    fig, axes = plt.subplots(
        len(panels), 1, figsize=(12, max(2.0, height)), sharex=True, squeeze=False
    )
    for ax, (title, timeline, pp) in zip(axes[:, 0], panels):
        draw_timeline(ax, timeline, pp, title)
    longest = max(max((end for *_, end in tl), default=1.0) for _, tl, _ in panels)
    for ax in axes[:, 0]:
        ax.set_xlim(0, longest)
    handles = [
        Patch(color=KIND_COLOURS[k][1], label=name)
        for k, name in [
            ("F", "F forward"),
            ("B", "B input-grad"),
            ("W", "W weight-grad"),
            ("BW", "BW full backward"),
        ]
    ]
    fig.legend(handles=handles, loc="upper center", fontsize=7, ncol=4, frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.35 / max(2.0, height)))
    fig.savefig(path, dpi=120)
    plt.close(fig)

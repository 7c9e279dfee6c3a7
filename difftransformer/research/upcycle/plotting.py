"""The training-curves PNG of an upcycling run: losses on the training batches, held-out perplexity."""

from __future__ import annotations

import math
import os
from pathlib import Path


def _series(log_history: list[dict], key: str) -> list[tuple[int, float]]:
    return [(e["step"], e[key]) for e in log_history if key in e and "step" in e]


def _loss_panel(ax, log_history: list[dict]) -> None:
    """Cross-entropies on the left axis; the KL (much smaller once the student is close) on its own right axis."""
    handles = []
    for key, label, color, style in (
        ("lm_loss", "student LM loss", "tab:orange", "-"),
        ("teacher_lm_loss", "teacher LM loss, same batches", "tab:gray", "--"),
    ):
        points = _series(log_history, key) or (_series(log_history, "loss") if key == "lm_loss" else [])
        if points:
            handles += ax.plot(*zip(*points), style, label=label, color=color, linewidth=1.2)
    kd = _series(log_history, "distill_loss")
    if kd:
        ax_kd = ax.twinx()
        handles += ax_kd.plot(
            *zip(*kd), "-", color="tab:green", linewidth=1.2, label="KL(teacher ‖ student), right axis"
        )
        ax_kd.set_ylabel("KL (nats / token)", color="tab:green")
        ax_kd.set_ylim(bottom=0)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy (nats / token)")
    ax.set_title("training batches (embedded corpus, train split)", fontsize=9)
    ax.grid(alpha=0.3)
    if handles:
        ax.legend(handles=handles, fontsize=8)


def _perplexity_panel(
    ax, log_history: list[dict], before: dict | None, teacher: dict | None, after: tuple[int, dict] | None
) -> None:
    """The student's held-out perplexity per text (step 0, evaluations during training, the final measurement) and
    the teacher's as dashed lines."""
    names = sorted(
        {
            k[len("eval_") : -len("_loss")]
            for e in log_history
            for k in e
            if k.startswith("eval_") and k.endswith("_loss")
        }
        | set(before or {})
        | set(teacher or {})
    )
    for color, name in zip(("tab:purple", "tab:red", "tab:cyan", "tab:olive"), names):
        points = [(0, before[name])] if before and name in before else []
        points += [(s, math.exp(v)) for s, v in _series(log_history, f"eval_{name}_loss")]
        if after is not None and name in after[1] and (not points or points[-1][0] != after[0]):
            points.append((after[0], after[1][name]))
        if points:
            ax.plot(*zip(*points), "o-", color=color, label=f"student: {name}")
        if teacher and name in teacher:
            ax.axhline(teacher[name], color=color, linestyle="--", linewidth=1, label=f"teacher: {name}")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("perplexity")
    ax.set_title("held-out perplexity (never trained on)", fontsize=9)
    ax.grid(alpha=0.3)
    if names:
        ax.legend(fontsize=8)


def plot_training(
    log_history: list[dict],
    path: str | os.PathLike,
    before: dict | None = None,
    teacher: dict | None = None,
    title: str = "",
    after: tuple[int, dict] | None = None,
) -> Path:
    """PNG with two panels: the training losses per logged step (student LM and teacher LM on the same batches, KL
    on its own axis) and the student's held-out perplexity (step 0: ``before``; the evaluations logged during
    training; ``after = (step, perplexities)``: the final measurement), with the teacher's as dashed lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5), dpi=100)
    _loss_panel(ax1, log_history)
    _perplexity_panel(ax2, log_history, before, teacher, after)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")
    plt.close(fig)
    return path

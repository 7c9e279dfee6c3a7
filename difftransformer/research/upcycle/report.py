"""What an upcycling run writes and prints: provenance, the Markdown report, one-line summaries."""

from __future__ import annotations

import datetime
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path

from .training import DEFAULT_LEARNING_RATES


def _git(*args: str) -> str | None:
    root = Path(__file__).resolve().parents[3]  # the checkout: research/upcycle/report.py is three below it
    try:
        proc = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return proc.stdout if proc.returncode == 0 else None


def _cpu() -> dict:
    model = platform.processor() or platform.machine()
    try:
        model = next(
            (
                line.split(":", 1)[1].strip()
                for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")
            ),
            model,
        )
    except OSError:
        pass
    return {"cpu": model, "logical_cpus": os.cpu_count()}


def provenance(script: str = "upcycle", command: str | None = None) -> dict:
    """Where a result comes from, in the schema of ``benchmarks/harness.py``'s results: the git commit of this
    checkout, whether tracked files differed from it and which (a copy without ``.git``: ``GIT_COMMIT`` /
    ``GIT_DIRTY`` from the environment), the command line (default: this process's), the machine (CPU, torch
    threads), the versions and the UTC time."""
    import torch
    import transformers

    head, status = _git("rev-parse", "HEAD"), _git("status", "--porcelain", "--untracked-files=no")
    if head is not None and status is not None:
        commit, files = head.strip(), sorted(line[3:] for line in status.splitlines() if line.strip())
        dirty = bool(files)
    else:
        commit, dirty, files = os.environ.get("GIT_COMMIT", "unknown"), os.environ.get("GIT_DIRTY", "unknown"), []
    try:
        import peft

        peft_version = peft.__version__
    except ImportError:
        peft_version = None
    return {
        "script": script,
        "commit": commit,
        "dirty": dirty,
        "dirty_files": files,
        "command": command or shlex.join(["python", *sys.argv]),
        "machine": _cpu() | {"torch_threads": torch.get_num_threads(), "platform": platform.platform()},
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "peft": peft_version,
        },
        "utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def lambda_summary(lam: dict) -> str:
    """One line: λ per layer (V1) or the range of V2's per-layer means of ``sigmoid(x W_λ)``."""
    if lam["diff_version"] == 1:
        values = lam["per_layer"]
        return f"per layer (V1): mean {sum(values) / len(values):.4f}, min {min(values):.4f}, max {max(values):.4f}"
    means, stds = lam["mean"], lam["std"]
    return (
        f"sigmoid(x W_λ) (V2) over held-out tokens: layer means {min(means):.4f}–{max(means):.4f}, "
        f"per-layer std up to {max(stds):.4f}"
    )


def print_measure(log, who: str, measured: dict) -> None:
    """Held-out perplexity, λ and the chat answers of one measurement, through ``log``."""
    ppl = ", ".join(f"{name} {value:.3f}" for name, value in measured["perplexity"].items())
    log(f"{who}: held-out perplexity {ppl}")
    if measured.get("lambda"):
        log(f"{who}: λ " + lambda_summary(measured["lambda"]))
    for item in measured.get("chat", []):
        log(f"{who} | user: {item['prompt']}\n{who} | model: {item['answer']}")


def report_markdown(report: dict) -> str:
    """The report as Markdown: perplexity table, λ per layer, the telemetry, chat samples, conversion notes."""
    s, t = report["settings"], report["training"]
    lines = [
        f"# Upcycling {Path(report['source']).name} to DIFF V{s['diff_version']}",
        "",
        f"{s['method']} fine-tuning, distillation weight {s['distill_weight']} (temperature {s['temperature']}), "
        f"learning rate {s['learning_rate'] or DEFAULT_LEARNING_RATES[s['method']]}, {t['global_step']} of "
        f"{t['max_steps']} steps × {s['batch_size'] * s['grad_accum']} "
        f"× {s['block_size']} tokens ({t['tokens']:,} tokens, {t['train_runtime_s'] or 0:.0f}s of training); "
        f"{report['student']['trainable_parameters']:,} of {report['student']['parameters']:,} parameters trainable.",
        "",
    ]
    if report.get("provenance"):
        p = report["provenance"]
        lines += [
            f"Command: `{p['command']}` at commit {p['commit']} (uncommitted changes: {p['dirty']}); "
            f"{p['machine']['cpu']}, {p['machine']['torch_threads']} torch threads.",
            "",
        ]
    lines += _perplexity_section(report) + _lambda_section(report) + _telemetry_section(report) + _chat_section(report)
    if report.get("conversion"):
        lines += ["## Conversion", ""] + [f"- {note}" for note in report["conversion"]["notes"]] + [""]
    lines += [f"Hub-ready model folder: `{report['model_dir']}`; curves: `{Path(report['plot']).name}`.", ""]
    return "\n".join(lines)


def _perplexity_section(report: dict) -> list[str]:
    names = list(report["teacher"]["perplexity"])
    lines = [
        "## Held-out perplexity",
        "",
        "| model | " + " | ".join(f"{n} (ratio to teacher)" for n in names) + " |",
        "|---" * (len(names) + 1) + "|",
        "| teacher | " + " | ".join(f"{report['teacher']['perplexity'][n]:.3f}" for n in names) + " |",
    ]
    for when in ("before", "after"):
        ppl, ratio = report[when]["perplexity"], report["ratio_to_teacher"][when]
        lines.append(f"| student {when} | " + " | ".join(f"{ppl[n]:.3f} ({ratio[n]:.3f})" for n in names) + " |")
    lines += [
        "",
        "Held-out texts, first "
        + ", ".join(
            f"{h['blocks']}×{h['length']} tokens of {n} ({h['description']})" for n, h in report["heldout"].items()
        )
        + ".",
        "",
    ]
    return lines


def _lambda_section(report: dict) -> list[str]:
    lb, la = report["before"]["lambda"], report["after"]["lambda"]
    lines = ["## λ", ""]
    if lb["diff_version"] == 1:
        lines += ["| layer | λ before | λ after |", "|---|---|---|"]
        lines += [f"| {i} | {b:.4f} | {a:.4f} |" for i, (b, a) in enumerate(zip(lb["per_layer"], la["per_layer"]))]
    else:
        lines += [
            f"sigmoid(x W_λ) over {la['tokens']:,} held-out tokens (validation) and every head.",
            "",
            "| layer | mean before | std before | mean after | std after | spread of head means after |",
            "|---|---|---|---|---|---|",
        ]
        lines += [
            f"| {i} | {lb['mean'][i]:.4f} | {lb['std'][i]:.4f} | {la['mean'][i]:.4f} | {la['std'][i]:.4f} | "
            f"{la['head_mean_spread'][i]:.4f} |"
            for i in range(len(la["mean"]))
        ]
    return lines + [""]


def _telemetry_section(report: dict) -> list[str]:
    tel = report.get("telemetry")
    if not tel or not tel.get("before") or not tel.get("after"):
        return []
    b, a = tel["before"], tel["after"]
    lines = [
        "## Differential attention on the probe batch (telemetry)",
        "",
        f"Probe: {tel['probe']}; step {tel['before_step']} and step {tel['after_step']}. Map separation: "
        "½·Σ_k|A1 − A2| per query, mean over heads and queries (0: the two maps of every head are equal); "
        "negative share: entries of A1 − λA2 below zero among those a query may attend to; first-token mass: "
        f"weight of A1 − λA2 on token 0. Gradient-norm spikes: {tel['grad_norm_spikes']}.",
        "",
        "| layer | separation before | separation after | negative share before | after | first-token mass before | "
        "after |",
        "|---|---|---|---|---|---|---|",
    ]
    for i in range(len(a["map_separation"])):
        lines.append(
            f"| {i} | {b['map_separation'][i]:.4f} | {a['map_separation'][i]:.4f} | {b['negative_share'][i]:.4f} | "
            f"{a['negative_share'][i]:.4f} | {b['first_token_mass'][i]:.4f} | {a['first_token_mass'][i]:.4f} |"
        )
    return lines + [""]


def _chat_section(report: dict) -> list[str]:
    lines = ["## Chat (greedy, chat template)", ""]
    for i, item in enumerate(report["teacher"]["chat"]):
        lines += [f"**User:** {item['prompt']}", ""]
        for who, key in (("teacher", "teacher"), ("student before", "before"), ("student after", "after")):
            lines += [f"- *{who}:* " + report[key]["chat"][i]["answer"].replace("\n", " ")]
        lines += [""]
    return lines

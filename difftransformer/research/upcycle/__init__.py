"""Upcycling a pretrained Llama-family model into a Differential Transformer, and fine-tuning it back to quality.

The converter (:mod:`difftransformer.convert`) turns a Llama / Mistral / Qwen2 model (a folder or a ``.gguf`` file)
into DIFF V2 exactly (same logits) or into DIFF V1 approximately (``duplicate`` initialisation, calibrated
``o_proj`` scales). This package is what comes next, the recipe that axolotl's diff-transformer plugin and the DEX
paper (arXiv 2505.16333) also follow: continue training the converted *student* with the source model as *teacher*.
One module per job, each read top-down:

* :mod:`.source`: load the teacher (:func:`load_source`, :func:`smoke_source`), convert it
  (:func:`convert_student`), load the student (:func:`load_student`);
* :mod:`.data`: the corpus's train split packed into blocks with the source's tokenizer (:func:`training_blocks`),
  and the two held-out texts (:func:`heldout_blocks`);
* :mod:`.metrics`: held-out :func:`perplexity`, :func:`lambda_statistics`, greedy :func:`chat` answers;
* :mod:`.training`: what trains (:func:`prepare_student`: full, or LoRA with λ trainable) and the
  :class:`DistillationTrainer` (loss ``(1 − w)·LM + w·KL(teacher ‖ student)``);
* :mod:`.plotting`: the training-curves PNG; :mod:`.report`: provenance and the Markdown report;
* :mod:`.job`: :func:`run_upcycle`, the resumable job behind ``examples/upcycle.py``, and its
  :class:`UpcycleSettings`. It also logs :mod:`difftransformer.research.telemetry` (λ, map separation, negative share,
  first-token mass, gradient-norm spikes) and plots it.

Why distillation first (the default ``w``; docs/upcycling.md shows the measurements): V1 starts as a different
function near the source's, and the teacher's full next-token distribution tells it at every position how far it
is, which a one-hot label does not. V2 starts as the teacher's exact function, where the KL and its gradient vanish;
it needs the LM term to move at all, and the KL term keeps it near the teacher on text unlike the corpus.
"""

from .data import HELDOUT_TEXTS, document_separator_id, heldout_blocks, heldout_texts, pack_documents, training_blocks
from .job import DEFAULT_PROMPTS, RESUME_KEYS, StopControl, UpcycleSettings, run_upcycle
from .metrics import chat, lambda_statistics, perplexity
from .plotting import plot_training
from .report import provenance, report_markdown
from .source import SMOKE, Source, convert_student, load_source, load_student, smoke_source
from .training import (
    DEFAULT_LEARNING_RATES,
    METHODS,
    DistillationTrainer,
    count_parameters,
    distillation_loss,
    prepare_student,
)

__all__ = [
    "DEFAULT_LEARNING_RATES",
    "DEFAULT_PROMPTS",
    "DistillationTrainer",
    "HELDOUT_TEXTS",
    "METHODS",
    "RESUME_KEYS",
    "SMOKE",
    "Source",
    "StopControl",
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
    "provenance",
    "report_markdown",
    "run_upcycle",
    "smoke_source",
    "training_blocks",
]

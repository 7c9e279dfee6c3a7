"""The research tools: what the experiments, reports and examples around the model use, not the model.

* :mod:`.analysis`: attention maps, the attention lens and its plots (docs/analysis.md);
* :mod:`.probes` and :mod:`.retrieval_tasks`: synthetic retrieval examples (needle, multi-query recall) and their
  scoring;
* :mod:`.telemetry`: differential-attention statistics logged during training (a Trainer callback);
* :mod:`.lowbit`: attention with its products rounded to a low-bit format, through the model's own functions;
* :mod:`.data`: the embedded corpus (the standard library's sources), its tokenizer and packed blocks;
* :mod:`.upcycle`: the upcycling recipe, a converted Llama fine-tuned back with distillation (docs/upcycling.md).

The model does not import them: ``import difftransformer`` and a saved folder's remote code load the configuration,
the model, its kernels and the registration only. This package imports none of its modules either; import the one
you use (``from difftransformer.research.analysis import attention_maps``).
"""

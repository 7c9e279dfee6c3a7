"""Training telemetry for differential attention: what users training DIFF models ask about (how λ behaves per
layer, microsoft/unilm#1699; loss spikes that come with gradient-norm spikes, microsoft/unilm#1718).

:class:`DiffAttentionTelemetryCallback` is a ``transformers.TrainerCallback``. Every ``every`` optimizer steps (and
at step 0 and the last step) it runs one forward of the model on a fixed *probe batch* (eager attention, eval mode,
no gradients) and logs through ``Trainer.log``, so every reporting integration (TensorBoard, W&B, ...) and
``trainer_state.json``'s ``log_history`` receive the values, per layer ``l`` (``{prefix}/{name}/layer_{l:02d}``) and
averaged over layers (``{prefix}/{name}``):

* ``lambda`` (V1: the layer's λ) or ``lambda_mean`` and ``lambda_std`` (V2: ``sigmoid(x W_λ)`` over every token and
  head of the probe batch);
* ``negative_share``: the fraction of the differential maps' entries ``A1 − λ·A2`` below zero, over the entries a
  query may attend to (causal: key ≤ query), every head;
* ``first_token_mass``: the differential maps' weight on the first token, averaged over heads and query positions
  1 … T−1 (position 0 can attend to nothing else). A row of a differential map sums to ``1 − λ``;
* ``map_separation``: how far apart the two softmax maps of a head are, the total-variation distance
  ``½·Σ_k |A1[q, k] − A2[q, k]|`` averaged over heads and query positions. 0 when the maps are equal (as right
  after the ``duplicate`` V1 and the exact V2 conversions, where every head's two maps are its source head's map), 1
  when they attend to disjoint keys;
* ``max_logit_map1``, ``max_logit_map2``: the largest attention logit ``q·k/√d`` (before the softmax) of each map,
  over the probe batch, the layer's heads and the entries a query may attend to: what QK-clip (Kimi K2's MuonClip)
  watches, and what precedes the loss spikes of attention-logit growth. Over layers they are summarised by their
  maximum (``{prefix}/max_logit_map1`` is the largest logit of any layer), every other metric by its mean;

and ``grad_norm_spikes``: how many of the gradient norms the Trainer has logged so far exceed ``spike_factor`` × the
median of the ``spike_window`` logged before them (:func:`grad_norm_spikes`; the Trainer logs the pre-clipping norm
every ``logging_steps``, so ``logging_steps=1`` checks every step). It is logged with each probe, and at once when a
logged norm is a spike (with ``{prefix}/grad_norm_spike_ratio``, the norm over that median).

The maps come from :func:`difftransformer.research.analysis.attention_maps` (the model's own differential maps through
``output_attentions``, and ``A1``, ``A2`` recomputed from each layer's q/k projections, tested to reproduce
``A1 − λ·A2``). A model without differential attention (the source Llama of a comparison) gets the spike count only.

The callback logs through the Trainer, which callbacks are not given: attach it with ``callback.attach(trainer)``
(which also adds it to the trainer's callbacks). The Trainer hands every logged value to its reporting integrations
(TensorBoard, W&B, ...) and ``log_history``; its progress bar (or, with ``disable_tqdm``, its printer) would print
each record whole, about 10 values per layer: ``attach`` replaces the Trainer's printing callback by one that prints a
probe record as one line of layer summaries (:func:`summary_line`) and leaves the per-layer keys to the integrations.
:func:`plot_telemetry` draws a ``log_history`` as one PNG, a grid of panels (:func:`telemetry_panels`).
"""

from __future__ import annotations

import math
import os
import statistics
from pathlib import Path

import torch
from transformers import TrainerCallback
from transformers.trainer_callback import PrinterCallback, ProgressCallback

PREFIX = "diffattn"
MAP_METRICS = ("negative_share", "first_token_mass", "map_separation")
# Summarised over layers by their maximum (the others by their mean).
MAX_METRICS = ("max_logit_map1", "max_logit_map2")


def unwrap_model(model):
    """The model a PEFT wrapper holds (``PeftModel.get_base_model()``), or ``model`` itself. Not transformers'
    ``unwrap_model``, which takes off distributed containers (``model.module``) and leaves a PEFT wrapper on."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def is_differential(model) -> bool:
    return getattr(getattr(unwrap_model(model), "config", None), "model_type", None) == "difftransformer"


@torch.no_grad()
def probe_metrics(model, probe_input_ids: torch.Tensor) -> dict[str, list[float]]:
    """The per-layer telemetry of a difftransformer model (plain or PEFT-wrapped) on ``probe_input_ids``
    ``(B, T)`` (unpadded, no cache): ``{"lambda": [...]}`` (V1) or ``{"lambda_mean": [...], "lambda_std": [...]}``
    (V2), and ``negative_share``, ``first_token_mass``, ``map_separation`` (module docstring), one float per layer."""
    from .analysis import attention_maps, diff_attention_modules, split_pairs

    base = unwrap_model(model)
    modules = diff_attention_modules(base)
    inputs: dict[int, tuple] = {}

    def keep_inputs(module, args, kwargs):  # what attention_maps' forward hands each attention layer
        inputs[module.layer_idx] = (
            kwargs["hidden_states"] if "hidden_states" in kwargs else args[0],
            kwargs["position_embeddings"],
        )

    handles = [m.register_forward_pre_hook(keep_inputs, with_kwargs=True) for m in modules]
    was_training = base.training
    base.eval()
    try:
        layers = attention_maps(base, probe_input_ids.to(base.device))
    finally:
        base.train(was_training)
        for handle in handles:
            handle.remove()
    out: dict[str, list[float]] = {}
    for module, layer in zip(modules, layers):
        metrics = _layer_metrics(layer)
        logits = split_pairs(
            attention_logits(module, *inputs[module.layer_idx]), module.pair_stride, noise_ratio=module.noise_ratio
        )
        metrics.update({name: float(map_logits.max()) for name, map_logits in zip(MAX_METRICS, logits)})
        for name, value in metrics.items():
            out.setdefault(name, []).append(value)
    return out


def attention_logits(module, hidden_states: torch.Tensor, position_embeddings) -> torch.Tensor:
    """The pre-softmax scores ``q·kᵀ/√d`` of every query head of one differential attention layer, float32
    ``(B, 2H, T, T)`` in q_proj row order, ``-inf`` where a query may not attend (a later key): recomputed from the
    layer's input with its q/k projections and RoPE, as :func:`difftransformer.research.analysis.softmax_maps`
    recomputes the maps (unpadded input, no cache)."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb, repeat_kv

    bsz, length, _ = hidden_states.shape
    query = module.q_proj(hidden_states).view(bsz, length, -1, module.head_dim)
    key = module.k_proj(hidden_states).view(bsz, length, -1, module.head_dim)
    query, key = apply_rotary_pos_emb(query, key, *position_embeddings, unsqueeze_dim=2)
    query, key = query.transpose(1, 2).float(), key.transpose(1, 2).float()
    scores = query @ repeat_kv(key, query.shape[1] // key.shape[1]).transpose(2, 3) * module.scaling
    later = torch.ones(length, length, dtype=torch.bool, device=scores.device).triu(1)
    return scores.masked_fill(later, float("-inf"))


def _layer_metrics(layer) -> dict[str, float]:
    diff, a1, a2 = (layer.maps[k].double() for k in ("diff", "softmax1", "softmax2"))  # (B, H, T, S)
    t, s = diff.shape[-2:]
    allowed = torch.ones(t, s, dtype=torch.bool, device=diff.device).tril(s - t)  # key ≤ query
    lam = layer.lam.double()
    metrics = (
        {"lambda": float(lam)}
        if lam.dim() == 0
        else {"lambda_mean": float(lam.mean()), "lambda_std": float(lam.std(unbiased=False))}
    )
    metrics["negative_share"] = float(((diff < 0) & allowed).sum() / (allowed.sum() * diff.shape[0] * diff.shape[1]))
    metrics["first_token_mass"] = float(diff[..., 1:, 0].mean()) if t > 1 else float("nan")
    metrics["map_separation"] = float(0.5 * (a1 - a2).abs().sum(-1).mean())
    return metrics


def grad_norm_spikes(
    log_history: list[dict], factor: float = 3.0, window: int = 20, min_history: int = 5
) -> list[dict]:
    """The logged gradient norms that are spikes: ``norm > factor × median`` of the up to ``window`` norms logged
    before it, once at least ``min_history`` precede it. Returns ``[{"step", "grad_norm", "median", "ratio"}]`` in
    log order (one entry per ``log_history`` record that holds ``grad_norm``)."""
    norms = [(e.get("step"), float(e["grad_norm"])) for e in log_history if e.get("grad_norm") is not None]
    spikes = []
    for i, (step, norm) in enumerate(norms):
        previous = [n for _, n in norms[max(0, i - window) : i]]
        if len(previous) >= min_history:
            median = statistics.median(previous)
            if norm > factor * median:
                spikes.append({"step": step, "grad_norm": norm, "median": median, "ratio": norm / median})
    return spikes


def flatten(metrics: dict[str, list[float]], prefix: str = PREFIX, per_layer: bool = True) -> dict[str, float]:
    """``{name: per-layer list}`` → the logged keys: ``{prefix}/{name}`` (over layers: the maximum for
    ``MAX_METRICS``, the mean for the others) and, with ``per_layer``, ``{prefix}/{name}/layer_{l:02d}``."""
    flat = {}
    for name, values in metrics.items():
        flat[f"{prefix}/{name}"] = max(values) if name in MAX_METRICS else sum(values) / len(values)
        if per_layer:
            flat.update({f"{prefix}/{name}/layer_{i:02d}": v for i, v in enumerate(values)})
    return flat


def unflatten(entry: dict, prefix: str = PREFIX) -> dict[str, list[float]]:
    """The per-layer lists of one logged record (the inverse of :func:`flatten` with ``per_layer``)."""
    out: dict[str, dict[int, float]] = {}
    for key, value in entry.items():
        parts = key.split("/")
        if len(parts) == 3 and parts[0] == prefix and parts[2].startswith("layer_"):
            out.setdefault(parts[1], {})[int(parts[2][len("layer_") :])] = value
    return {name: [by_layer[i] for i in sorted(by_layer)] for name, by_layer in out.items()}


class DiffAttentionTelemetryCallback(TrainerCallback):
    """Logs differential-attention telemetry on a fixed probe batch every ``every`` steps (module docstring).

    ``probe_input_ids``: ``(B, T)`` token ids, unpadded (e.g. two held-out blocks of 128 tokens: one eager forward
    with every map of that batch in memory). Attach with ``callback.attach(trainer)``."""

    def __init__(
        self,
        probe_input_ids: torch.Tensor,
        every: int = 10,
        spike_factor: float = 3.0,
        spike_window: int = 20,
        spike_min_history: int = 5,
        per_layer: bool = True,
        prefix: str = PREFIX,
    ):
        if probe_input_ids.dim() != 2 or probe_input_ids.shape[1] < 2:
            raise ValueError(
                f"`probe_input_ids` must be (batch, tokens) with tokens >= 2, got {tuple(probe_input_ids.shape)}."
            )
        if not isinstance(every, int) or every <= 0:
            raise ValueError(f"`every` must be a positive integer, got {every!r}.")
        if spike_factor <= 1.0:
            raise ValueError(f"`spike_factor` must be > 1, got {spike_factor!r}.")
        self.probe_input_ids = probe_input_ids
        self.every = every
        self.spike = {"factor": spike_factor, "window": spike_window, "min_history": spike_min_history}
        self.per_layer = per_layer
        self.prefix = prefix
        self.trainer = None

    def attach(self, trainer) -> DiffAttentionTelemetryCallback:
        """Log through ``trainer`` (and add this callback to it unless it is there already); its progress bar or
        printer then prints each probe record as one summary line (:class:`TelemetryProgressCallback`)."""
        self.trainer = trainer
        if self not in trainer.callback_handler.callbacks:
            trainer.add_callback(self)
        callbacks = trainer.callback_handler.callbacks
        for i, callback in enumerate(callbacks):  # in place: the progress bar opens before this callback's step 0
            if type(callback) is ProgressCallback:
                callbacks[i] = TelemetryProgressCallback(prefix=self.prefix, max_str_len=callback.max_str_len)
            elif type(callback) is PrinterCallback:
                callbacks[i] = TelemetryPrinterCallback(prefix=self.prefix)
        return self

    def _spikes(self, state) -> list[dict]:
        return grad_norm_spikes(state.log_history, **self.spike)

    def _probe_and_log(self, model, state) -> None:
        if self.trainer is None:
            raise RuntimeError(
                "DiffAttentionTelemetryCallback logs through the Trainer: call callback.attach(trainer)."
            )
        logs = (
            flatten(probe_metrics(model, self.probe_input_ids), self.prefix, self.per_layer)
            if is_differential(model)
            else {}
        )
        logs[f"{self.prefix}/grad_norm_spikes"] = len(self._spikes(state))
        self._log(logs)

    def _log(self, logs: dict) -> None:
        # Trainer.log resets control.should_log (its callback handler does, for every on_log): restored, so that the
        # Trainer's own log of this step (the loss, due after on_step_end) still happens.
        should_log = self.trainer.control.should_log
        self.trainer.log(logs)
        self.trainer.control.should_log = should_log

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if state.global_step == 0:  # a fresh start: the model before any update (a resumed run has its step 0 logged)
            self._probe_and_log(model, state)

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step % self.every == 0 or state.global_step >= state.max_steps:
            self._probe_and_log(model, state)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not logs or logs.get("grad_norm") is None or self.trainer is None:
            return
        spikes = self._spikes(state)  # `logs` is the last record of state.log_history already
        if spikes and spikes[-1]["step"] == state.global_step and spikes[-1]["grad_norm"] == float(logs["grad_norm"]):
            self._log(
                {
                    f"{self.prefix}/grad_norm_spikes": len(spikes),
                    f"{self.prefix}/grad_norm_spike_ratio": spikes[-1]["ratio"],
                }
            )


_SUMMARY = (
    ("lambda", "λ {:.3f}"),
    ("lambda_mean", "λ {:.3f}"),
    ("lambda_std", "± {:.3f}"),
    ("map_separation", "map separation {:.3f}"),
    ("negative_share", "negative {:.3f}"),
    ("first_token_mass", "first-token {:.3f}"),
)


def summary_line(logs: dict, prefix: str = PREFIX) -> str | None:
    """One terminal line for a logged telemetry record (None for any other record): the layer means, the largest
    attention logit of each map with its layer, the spike count; the per-layer values stay in the record."""
    if f"{prefix}/grad_norm_spikes" not in logs:
        return None
    if f"{prefix}/grad_norm_spike_ratio" in logs:
        return (
            f"[{prefix}] grad-norm spike: {logs[f'{prefix}/grad_norm_spike_ratio']:.1f}× the median of the norms "
            f"before it ({logs[f'{prefix}/grad_norm_spikes']} so far)"
        )
    layers = unflatten(logs, prefix)
    parts = [fmt.format(logs[f"{prefix}/{name}"]) for name, fmt in _SUMMARY if f"{prefix}/{name}" in logs]
    for i, name in enumerate(MAX_METRICS, start=1):
        if name in layers:
            values = layers[name]
            parts.append(f"max logit map {i} {max(values):.2f} (layer {values.index(max(values))})")
        elif f"{prefix}/{name}" in logs:
            parts.append(f"max logit map {i} {logs[f'{prefix}/{name}']:.2f}")
    parts.append(f"grad-norm spikes {logs[f'{prefix}/grad_norm_spikes']}")
    return f"[{prefix}] " + " | ".join(parts)


def _without_layers(logs: dict, prefix: str) -> dict:
    return {k: v for k, v in logs.items() if not (k.startswith(prefix + "/") and "/layer_" in k)}


class TelemetryProgressCallback(ProgressCallback):
    """transformers' progress bar, printing a telemetry record as one line (:func:`summary_line`) instead of a
    dictionary with every per-layer value; every other record as the Trainer prints it. What reaches the reporting
    integrations and ``log_history`` is unchanged (they read the record, not the terminal)."""

    def __init__(self, prefix: str = PREFIX, **kwargs):
        super().__init__(**kwargs)
        self.prefix = prefix

    def on_log(self, args, state, control, logs=None, **kwargs):
        line = summary_line(logs or {}, self.prefix)
        if line is None:
            return super().on_log(args, state, control, logs=_without_layers(logs or {}, self.prefix), **kwargs)
        if state.is_world_process_zero and self.training_bar is not None:
            self.training_bar.write(f"step {state.global_step}: {line}")


class TelemetryPrinterCallback(PrinterCallback):
    """transformers' printer (``disable_tqdm=True``), with telemetry records as one line (see
    :class:`TelemetryProgressCallback`)."""

    def __init__(self, prefix: str = PREFIX):
        self.prefix = prefix

    def on_log(self, args, state, control, logs=None, **kwargs):
        line = summary_line(logs or {}, self.prefix)
        if line is None:
            return super().on_log(args, state, control, logs=_without_layers(logs or {}, self.prefix), **kwargs)
        if state.is_local_process_zero:
            print(f"step {state.global_step}: {line}")


def telemetry_records(log_history: list[dict], prefix: str = PREFIX) -> list[dict]:
    """The probe records of a ``log_history``: ``[{"step": s, "metrics": {name: per-layer list}}]`` in order."""
    return [
        {"step": e["step"], "metrics": unflatten(e, prefix)}
        for e in log_history
        if f"{prefix}/grad_norm_spikes" in e and f"{prefix}/grad_norm_spike_ratio" not in e
    ]


# What plot_telemetry can draw, one panel each, in order (the gradient norm's panel comes last).
PANELS = (
    ("lambda", "λ per layer (V1)"),
    ("lambda_mean", "mean λ = sigmoid(x W_λ) over the probe (V2)"),
    ("map_separation", "map separation ½Σ|A1 − A2|"),
    ("negative_share", "share of negative A1 − λA2 entries"),
    ("first_token_mass", "weight of A1 − λA2 on the first token"),
    ("max_logit_map1", "max attention logit q·k/√d: map 1 (—), map 2 (--)"),
)


def telemetry_panels(log_history: list[dict], prefix: str = PREFIX) -> tuple[list[tuple[str, str]], list[str]]:
    """The metric panels :func:`plot_telemetry` draws for ``log_history`` (``[(metric, title)]``, in
    :data:`PANELS`' order) and the titles of those it leaves out because the metric is 0 at every probe and layer.

    A metric the model's version does not log is not drawn (V1 logs ``lambda``, V2 ``lambda_mean``); one that is 0
    throughout is named in the figure instead of drawn: the negative share stays 0 while ``λ·A2 ≤ A1`` everywhere, as
    it does through a short fine-tuning after the exact V2 or the ``duplicate`` V1 conversion, where both maps of a
    head start equal."""
    records = [r for r in telemetry_records(log_history, prefix) if r["metrics"]]
    drawn, zero = [], []
    for name, title in PANELS:
        values = [v for r in records for v in r["metrics"].get(name, [])]
        if name == "max_logit_map1":
            values += [v for r in records for v in r["metrics"].get("max_logit_map2", [])]
        if not values:
            continue
        (drawn if any(v != 0 for v in values) else zero).append((name, title))
    return drawn, [title for _, title in zero]


def plot_telemetry(
    log_history: list[dict],
    path: str | os.PathLike,
    title: str = "",
    prefix: str = PREFIX,
    spike_factor: float = 3.0,
    spike_window: int = 20,
    spike_min_history: int = 5,
) -> Path:
    """One PNG, a grid of panels two wide (about 1000 pixels wide, readable at that size): the per-layer metrics of
    :func:`telemetry_panels` over the probed steps (one line per layer, coloured by depth) and the logged gradient
    norm with its spikes marked. Metrics that are 0 throughout are named under the title instead of drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    records = [r for r in telemetry_records(log_history, prefix) if r["metrics"]]
    steps = [r["step"] for r in records]
    panels, zero = telemetry_panels(log_history, prefix)
    count = len(panels) + 1  # and the gradient norm's
    ncols = 1 if count == 1 else 2
    nrows = math.ceil(count / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(5.0 * ncols, 3.1 * nrows + 0.9), dpi=100, layout="constrained")
    axes = list(getattr(axes, "flat", [axes]))
    for ax in axes[count:]:
        ax.set_visible(False)
    layers = len(records[0]["metrics"].get(panels[0][0], [])) if panels else 0
    colour = [plt.cm.viridis(layer / max(1, layers - 1)) for layer in range(layers)]
    for ax, (name, label) in zip(axes, panels):
        for layer in range(layers):
            ax.plot(steps, [r["metrics"][name][layer] for r in records], color=colour[layer], linewidth=1)
            if name == "max_logit_map1":
                second = [r["metrics"]["max_logit_map2"][layer] for r in records]
                ax.plot(steps, second, "--", color=colour[layer], linewidth=1)
        _style(ax, label)
    _grad_norm_panel(axes[count - 1], log_history, spike_factor, spike_window, spike_min_history)
    if layers:
        scale = plt.cm.ScalarMappable(cmap="viridis", norm=plt.Normalize(0, max(1, layers - 1)))
        if count < len(axes):  # the grid's free cell holds the layer scale
            axes[count].set_visible(True)
            axes[count].axis("off")
            bar = fig.colorbar(scale, cax=axes[count].inset_axes((0.1, 0.45, 0.8, 0.1)), orientation="horizontal")
        else:
            bar = fig.colorbar(scale, ax=axes[:count], location="bottom", shrink=0.5, aspect=40)
        bar.set_label("layer (one line each)", fontsize=9)
        bar.ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    heading = (
        title + ("\n" if title and zero else "") + ("0 at every probe (not drawn): " + "; ".join(zero) if zero else "")
    )
    fig.suptitle(heading, fontsize=11)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")
    plt.close(fig)
    return path


def _style(ax, title: str) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("optimizer step", fontsize=9)
    ax.tick_params(labelsize=8)
    ax.grid(alpha=0.3)


def _grad_norm_panel(ax, log_history, factor, window, min_history) -> None:
    norms = [(e["step"], e["grad_norm"]) for e in log_history if e.get("grad_norm") is not None]
    if norms:
        ax.plot(*zip(*norms), "-", color="tab:blue", linewidth=1, label="grad norm (before clipping)")
    spikes = grad_norm_spikes(log_history, factor, window, min_history)
    if spikes:
        ax.plot(
            [s["step"] for s in spikes],
            [s["grad_norm"] for s in spikes],
            "v",
            color="tab:red",
            label=f"spike: > {factor:g}× median of the previous {window}",
        )
    _style(ax, f"gradient norm: {len(spikes)} spike(s)")
    if norms:
        ax.legend(fontsize=8)


__all__ = [
    "DiffAttentionTelemetryCallback",
    "MAP_METRICS",
    "MAX_METRICS",
    "PREFIX",
    "TelemetryPrinterCallback",
    "PANELS",
    "TelemetryProgressCallback",
    "attention_logits",
    "flatten",
    "grad_norm_spikes",
    "plot_telemetry",
    "probe_metrics",
    "summary_line",
    "telemetry_panels",
    "telemetry_records",
    "unflatten",
    "unwrap_model",
]

"""Differential-attention telemetry (difftransformer/research/telemetry.py): the logged values against a direct
computation on tiny models, logging through the Trainer, the gradient-norm spike rule."""

import copy
import json

import pytest
import torch
from transformers import AttentionInterface, Trainer, TrainerCallback, TrainingArguments
from transformers.masking_utils import AttentionMaskInterface, eager_mask

from difftransformer import DiffTransformerConfig, DiffTransformerForCausalLM
from difftransformer.modeling_difftransformer import eager_attention_forward
from difftransformer.research import telemetry

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VOCAB = 61
RAW_MAPS: dict[int, torch.Tensor] = {}
RAW_SCORES: dict[int, torch.Tensor] = {}


def _recording_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, diff_lambda=None, **kwargs):
    """Eager attention that also keeps every softmax map of the call, computed from the query and key exactly as the
    model hands them to its kernel (V1: zero-padded queries against packed groups), in q_proj row order."""
    keys = key.repeat_interleave(query.shape[1] // key.shape[1], dim=1)
    scores = torch.matmul(query, keys.transpose(2, 3)) * scaling + attention_mask
    RAW_MAPS[module.layer_idx] = torch.softmax(scores.double(), dim=-1)
    RAW_SCORES[module.layer_idx] = scores.double()
    return eager_attention_forward(
        module, query, key, value, attention_mask, scaling, dropout, diff_lambda=diff_lambda, **kwargs
    )


AttentionInterface.register("telemetry_recorder", _recording_attention)
AttentionMaskInterface.register("telemetry_recorder", eager_mask)


def tiny(version, seed=0):
    config = DiffTransformerConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=4 if version == 1 else 2,
        head_dim=8,
        diff_version=version,
        initializer_range=0.3,
        **({"lambda_std": 0.3} if version == 1 else {}),
    )
    torch.manual_seed(seed)
    return DiffTransformerForCausalLM(config)


def probe_ids(batch=2, length=10):
    return torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(5))


def direct(model, ids) -> dict[str, list[float]]:
    """The telemetry from its definitions: the model's own eager output_attentions and output_lambdas, and the raw
    maps and scores (logits plus the causal mask) the recording kernel saw, split into each head's pair (V1 rows
    (g, c, r), V2 rows (h, c))."""
    model.set_attn_implementation("eager")
    with torch.no_grad():
        out = model(ids, output_attentions=True, output_lambdas=True, use_cache=False)
    model.set_attn_implementation("telemetry_recorder")
    RAW_MAPS.clear()
    with torch.no_grad():
        model(ids, use_cache=False)
    model.set_attn_implementation("sdpa")
    t = ids.shape[1]
    allowed = torch.ones(t, t, dtype=torch.bool).tril()
    result: dict[str, list[float]] = {}
    for layer, (diff, lam) in enumerate(zip(out.attentions, out.lambdas)):
        attn = model.model.layers[layer].self_attn
        a1, a2 = (m.flatten(1, 2) for m in RAW_MAPS[layer].unflatten(1, (-1, 2, attn.pair_stride)).unbind(2))
        # The pairing is right: the raw maps give the model's differential maps back.
        lam_b = lam.double() if lam.dim() == 0 else lam.double().transpose(1, 2)[..., None]
        torch.testing.assert_close(a1 - lam_b * a2, diff.double(), rtol=1e-5, atol=1e-6)
        s1, s2 = (m.flatten(1, 2) for m in RAW_SCORES[layer].unflatten(1, (-1, 2, attn.pair_stride)).unbind(2))
        values = {
            "negative_share": ((diff < 0) & allowed).sum().item()
            / (allowed.sum().item() * diff.shape[0] * diff.shape[1]),
            "max_logit_map1": s1[..., allowed].max().item(),
            "max_logit_map2": s2[..., allowed].max().item(),
            "first_token_mass": diff[:, :, 1:, 0].double().mean().item(),
            "map_separation": (a1 - a2).abs().sum(-1).mean().item() / 2,
        }
        if model.config.diff_version == 1:
            values["lambda"] = model.layer_lambdas()[layer].item()
        else:
            values["lambda_mean"], values["lambda_std"] = (
                lam.double().mean().item(),
                lam.double().std(unbiased=False).item(),
            )
        for name, value in values.items():
            result.setdefault(name, []).append(value)
    return result


def assert_metrics_equal(got: dict, expected: dict):
    assert set(got) == set(expected)
    for name, values in expected.items():
        assert got[name] == pytest.approx(values, rel=1e-5, abs=1e-7), name


@pytest.mark.parametrize("version", [1, 2])
def test_probe_metrics_equal_a_direct_computation(version):
    model = tiny(version).eval()
    ids = probe_ids()
    got = telemetry.probe_metrics(model, ids)
    expected = direct(model, ids)
    assert_metrics_equal(got, expected)
    # Informative: the maps of a head differ and the differential maps have negative entries.
    assert min(expected["map_separation"]) > 0.05 and min(expected["negative_share"]) > 0.01
    assert model.config._attn_implementation == "sdpa"  # the probe switched the backend back


def test_equal_maps_have_no_separation():
    """A head whose two maps are equal (q rows of map 2 copied from map 1, as the duplicate V1 conversion starts)
    has separation 0, and with λ < 1 no negative entry."""
    model = tiny(1).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            attn = layer.self_attn
            for name in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"):
                getattr(attn, name).zero_()  # λ = λinit < 1
            q = attn.q_proj.weight.view(attn.config.num_key_value_heads // 2, 2, attn.pair_stride, -1)  # rows (g, c, r)
            k = attn.k_proj.weight.view(-1, 2, attn.head_dim * attn.config.hidden_size)  # rows (g, c)
            q[:, 1] = q[:, 0]
            k[:, 1] = k[:, 0]
    got = telemetry.probe_metrics(model, probe_ids())
    assert got["map_separation"] == pytest.approx([0.0, 0.0], abs=1e-7)
    assert got["max_logit_map1"] == got["max_logit_map2"]  # the same logits
    assert all(lam < 1 for lam in got["lambda"]) and got["negative_share"] == [0.0, 0.0]


class _Capture(TrainerCallback):
    """Stands for a reporting integration (TensorBoard, W&B): records what on_log hands every callback."""

    def __init__(self):
        self.logs = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append(dict(logs))


class _Rows(torch.utils.data.Dataset):
    ids = torch.randint(3, VOCAB, (24, 12), generator=torch.Generator().manual_seed(1))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


@pytest.mark.parametrize("version,lora", [(1, True), (2, False)])
def test_callback_logs_the_probe_through_the_trainer(tmp_path, version, lora):
    model = tiny(version)
    if lora:
        from peft import LoraConfig, get_peft_model

        from difftransformer.integrations import enable_lambda_training

        model = get_peft_model(model, LoraConfig(target_modules=["q_proj", "k_proj"], modules_to_save=["subln"]))
        enable_lambda_training(model)
    ids = probe_ids()
    at_start = telemetry.probe_metrics(copy.deepcopy(model), ids)
    args = TrainingArguments(
        str(tmp_path),
        max_steps=5,
        learning_rate=0.02,
        per_device_train_batch_size=4,
        logging_steps=1,
        save_steps=5,
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
    )
    capture = _Capture()
    trainer = Trainer(model=model, args=args, train_dataset=_Rows(), callbacks=[capture])
    callback = telemetry.DiffAttentionTelemetryCallback(
        ids, every=2, spike_factor=1.01, spike_window=3, spike_min_history=1
    )
    callback.attach(trainer)
    trainer.train()
    history = trainer.state.log_history
    records = telemetry.telemetry_records(history)
    assert [r["step"] for r in records] == [0, 2, 4, 5]  # step 0, every 2 steps, the last step
    assert [e["step"] for e in history if "loss" in e] == [1, 2, 3, 4, 5]  # the Trainer's own logs are all there
    assert_metrics_equal(records[0]["metrics"], at_start)
    assert_metrics_equal(records[-1]["metrics"], telemetry.probe_metrics(model, ids))  # the trained model
    assert records[-1]["metrics"]["map_separation"] != pytest.approx(at_start["map_separation"], rel=1e-3)
    # Every record: layer means, and the spike count of the grad norms logged before it.
    for index, entry in enumerate(history):
        if "diffattn/grad_norm_spikes" in entry:
            assert entry["diffattn/grad_norm_spikes"] == len(telemetry.grad_norm_spikes(history[:index], 1.01, 3, 1))
        if "diffattn/map_separation" in entry:
            per_layer = [entry[f"diffattn/map_separation/layer_{i:02d}"] for i in range(2)]
            assert entry["diffattn/map_separation"] == pytest.approx(sum(per_layer) / 2)
            logits = [entry[f"diffattn/max_logit_map1/layer_{i:02d}"] for i in range(2)]
            assert entry["diffattn/max_logit_map1"] == max(logits)  # over layers: the largest
    # What the Trainer logged reached the other callbacks and the checkpoint's trainer_state.json.
    assert any("diffattn/map_separation" in logs for logs in capture.logs)
    saved = json.loads((tmp_path / "checkpoint-5" / "trainer_state.json").read_text())["log_history"]
    assert [e["step"] for e in saved if "diffattn/map_separation" in e] == [0, 2, 4, 5]


@pytest.mark.parametrize("disable_tqdm", [True, False])
def test_terminal_gets_one_line_per_probe_the_integrations_every_layer(tmp_path, capsys, disable_tqdm):
    """The Trainer's printer (or progress bar) prints a probe record as one summary line; the reporting integrations
    (here _Capture) and log_history still receive every per-layer value."""
    ids = probe_ids()
    args = TrainingArguments(
        str(tmp_path),
        max_steps=4,
        learning_rate=0.02,
        per_device_train_batch_size=4,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        disable_tqdm=disable_tqdm,
        seed=0,
    )
    capture = _Capture()
    trainer = Trainer(model=tiny(2), args=args, train_dataset=_Rows(), callbacks=[capture])
    telemetry.DiffAttentionTelemetryCallback(ids, every=2).attach(trainer)
    printers = [
        type(c).__name__
        for c in trainer.callback_handler.callbacks
        if "Printer" in type(c).__name__ or "Progress" in type(c).__name__
    ]
    assert printers == ["TelemetryPrinterCallback" if disable_tqdm else "TelemetryProgressCallback"]
    trainer.train()
    out = capsys.readouterr()
    printed = (out.out + out.err).splitlines()
    lines = [line for line in printed if "[diffattn]" in line]
    assert len(lines) == 3 and all(line.startswith(f"step {s}: ") for line, s in zip(lines, (0, 2, 4))), lines
    assert all("max logit map 1" in line and "map separation" in line for line in lines)
    assert "layer_0" not in out.out + out.err
    assert sum("'loss'" in line for line in printed) == 4  # the Trainer's own records, as it prints them
    probes = [logs for logs in capture.logs if "diffattn/map_separation" in logs]
    assert len(probes) == 3 and all("diffattn/max_logit_map2/layer_01" in logs for logs in probes)
    assert len(telemetry.unflatten(probes[0])) == 7  # λ mean and spread, 3 map metrics, 2 max logits: per layer


def test_summary_line():
    record = {
        "step": 4,
        **telemetry.flatten(
            {
                "lambda": [0.2, 0.4],
                "map_separation": [0.1, 0.3],
                "max_logit_map1": [3.0, 9.5],
                "max_logit_map2": [7.25, 2.0],
            }
        ),
        "diffattn/grad_norm_spikes": 1,
    }
    assert telemetry.summary_line(record) == (
        "[diffattn] λ 0.300 | map separation 0.200 | max logit map 1 9.50 (layer 1)"
        " | max logit map 2 7.25 (layer 0) | grad-norm spikes 1"
    )
    assert telemetry.summary_line({"loss": 1.0}) is None


def test_callback_needs_the_trainer(tmp_path):
    args = TrainingArguments(str(tmp_path), max_steps=1, report_to="none", use_cpu=True, disable_tqdm=True)
    callback = telemetry.DiffAttentionTelemetryCallback(probe_ids())
    trainer = Trainer(model=tiny(2), args=args, train_dataset=_Rows(), callbacks=[callback])
    with pytest.raises(RuntimeError, match="attach"):
        trainer.train()
    with pytest.raises(ValueError, match="probe_input_ids"):
        telemetry.DiffAttentionTelemetryCallback(torch.zeros(5, dtype=torch.long))


def test_grad_norm_spikes_rule():
    norms = [1.0, 1.2, 0.9, 1.1, 1.0, 5.0, 1.0, 2.9, 1.0]
    history = [{"step": i + 1, "grad_norm": n, "loss": 1.0} for i, n in enumerate(norms)] + [
        {"step": 9, "eval_loss": 2.0}
    ]
    spikes = telemetry.grad_norm_spikes(history, factor=3.0, window=20, min_history=5)
    assert [s["step"] for s in spikes] == [6]  # 2.9 at step 8 is below 3 × the median 1.0 of what precedes it
    assert spikes[0]["median"] == 1.0 and spikes[0]["ratio"] == 5.0
    assert [s["step"] for s in telemetry.grad_norm_spikes(history, 2.5, window=20, min_history=5)] == [6, 8]
    # A short window forgets the quiet steps: 2.9 against the median of (5.0, 1.0) is no spike.
    assert [s["step"] for s in telemetry.grad_norm_spikes(history, 2.5, window=2, min_history=2)] == [6]
    assert telemetry.grad_norm_spikes(history[:5], factor=1.01) == []  # fewer than min_history norms before any


def test_plot_telemetry(tmp_path):
    history = []
    for step in (0, 2, 4):
        history.append(
            {
                "step": step,
                **telemetry.flatten(
                    {
                        "lambda": [0.2 + step / 100, 0.4],
                        "map_separation": [0.0, step / 10],
                        "negative_share": [0.0, 0.1],
                        "first_token_mass": [0.5, 0.4],
                        "max_logit_map1": [4.0, 5.0 + step],
                        "max_logit_map2": [3.0, 4.0],
                    }
                ),
                "diffattn/grad_norm_spikes": 0,
            }
        )
        history.append({"step": step + 1, "loss": 1.0, "grad_norm": 1.0 + step})
    path = telemetry.plot_telemetry(history, tmp_path / "t.png", title="tiny")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000
    assert telemetry.unflatten(history[0]) == {
        "lambda": [0.2, 0.4],
        "map_separation": [0.0, 0.0],
        "negative_share": [0.0, 0.1],
        "first_token_mass": [0.5, 0.4],
        "max_logit_map1": [4.0, 5.0],
        "max_logit_map2": [3.0, 4.0],
    }


def test_plot_telemetry_is_a_readable_grid_without_panels_that_stay_zero(tmp_path):
    """The plot is a grid two panels wide that reads at its own size (about 1000 pixels wide, not a strip several times
    wider than high), one panel per metric the model's version logs; a metric that is 0 at every probe (V2's negative
    share while λ·A2 ≤ A1 everywhere, as after its exact conversion) is named in the figure, not drawn flat."""
    from PIL import Image

    def history(version, negative):
        records = []
        for step in (0, 5, 10):
            lam = {"lambda": [0.2, 0.3, 0.4]} if version == 1 else {"lambda_mean": [0.5, 0.5, 0.51]}
            metrics = {
                **lam,
                "map_separation": [0.0, step / 100, step / 50],
                "negative_share": [negative * step] * 3,
                "first_token_mass": [0.3, 0.2, 0.1],
                "max_logit_map1": [4.0, 5.0, 6.0],
                "max_logit_map2": [3.0, 4.0, 5.0],
            }
            records += [{"step": step, **telemetry.flatten(metrics), "diffattn/grad_norm_spikes": 0}]
            records += [{"step": step + 1, "loss": 1.0, "grad_norm": 1.0}]
        return records

    v2 = history(2, negative=0.0)
    drawn, zero = telemetry.telemetry_panels(v2)
    names = [name for name, _ in drawn]
    assert names == ["lambda_mean", "map_separation", "first_token_mass", "max_logit_map1"], names
    assert zero == ["share of negative A1 − λA2 entries"]
    v1 = history(1, negative=0.01)
    drawn, zero = telemetry.telemetry_panels(v1)
    assert [name for name, _ in drawn] == [
        "lambda",
        "map_separation",
        "negative_share",
        "first_token_mass",
        "max_logit_map1",
    ]
    assert zero == []
    for version, records in ((1, v1), (2, v2)):
        with Image.open(telemetry.plot_telemetry(records, tmp_path / f"v{version}.png", title="tiny")) as image:
            width, height = image.size
        assert 800 <= width <= 1200 and width / height <= 1.5, (version, image.size)  # 3 rows of 2 panels

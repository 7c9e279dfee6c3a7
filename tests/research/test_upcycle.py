"""Upcycling (difftransformer/research/upcycle/, examples/upcycle.py, benchmarks/compare_upcycled.py) and λ in Trainer
checkpoints of a V1 PeftModel (difftransformer/integrations.py).

They run on a tiny random Llama (``upcycle.smoke_source``) converted to V1 and V2 by the real converter; the real
model's upcycling tests are in test_real_model.py."""

import importlib.util
import json
import math
import os
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("peft", reason="upcycling fine-tunes with PEFT LoRA (pip install peft, or the [train] extra)")
from peft import LoraConfig, PeftModel, get_peft_model  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from transformers import AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments  # noqa: E402

from difftransformer import DiffTransformerConfig, DiffTransformerForCausalLM  # noqa: E402
from difftransformer.hub import check_hub_folder  # noqa: E402
from difftransformer.integrations import LambdaCheckpointCallback, enable_lambda_training, save_adapter  # noqa: E402
from difftransformer.research import telemetry  # noqa: E402
from difftransformer.research import upcycle as up  # noqa: E402
from difftransformer.research.data import LMBlockDataset, corpus_files  # noqa: E402
from utils_upcycle import distillation_trainer, kd_loss_on  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "examples" / "upcycle.py"
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def _load(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


cli = _load("difftransformer_examples_upcycle", SCRIPT)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def source():
    return up.smoke_source()


@pytest.fixture(scope="module")
def students(source, tmp_path_factory):
    """The tiny source converted by the real converter: V1 (duplicate: 1 KV head) and V2 (exact) folders."""
    root = tmp_path_factory.mktemp("students")
    return {v: up.convert_student(source, v, root / f"v{v}").output for v in (1, 2)}


def smoke_settings(tmp_path, **overrides):
    values = dict(cli.SMOKE_SETTINGS, output_dir=str(tmp_path / "run"), progress=False)
    values.update(overrides)
    return up.UpcycleSettings(**values)


# ----------------------------------------------------------------------------------------------- loss and data


def test_distillation_loss_is_the_token_mean_kl_times_t_squared():
    gen = torch.Generator().manual_seed(0)
    student, teacher = torch.randn(2, 5, 11, generator=gen), torch.randn(2, 5, 11, generator=gen)
    for t in (1.0, 2.0):
        p = torch.softmax(teacher.double() / t, -1)
        q = torch.softmax(student.double() / t, -1)
        expected = (p * (p.log() - q.log())).sum(-1).mean() * t * t
        assert up.distillation_loss(student, teacher, t).item() == pytest.approx(expected.item(), rel=1e-5)
    # Zero when the distributions agree (logits equal up to a constant per token), positive otherwise.
    assert up.distillation_loss(teacher + torch.randn(2, 5, 1, generator=gen), teacher).item() == pytest.approx(
        0.0, abs=1e-6
    )
    assert up.distillation_loss(student, teacher).item() > 0.1
    with pytest.raises(ValueError, match="temperature"):
        up.distillation_loss(student, teacher, 0.0)
    with pytest.raises(ValueError, match="shape"):
        up.distillation_loss(student[..., :5], teacher)


def test_documents_are_separated_and_packed(source):
    tok = source.tokenizer
    sep = up.document_separator_id(tok)
    assert sep == tok.eos_token_id  # the tiny tokenizer has no <|endoftext|>
    texts = ["def f(x):\n    return x\n", "import os\n", "class A:\n    pass\n"]
    ids = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    stream = [i for doc in ids for i in (*doc, sep)]
    blocks = up.pack_documents(tok, texts, 4)
    assert blocks.shape == (len(stream) // 4, 4)
    assert blocks.flatten().tolist() == stream[: blocks.numel()]
    assert up.pack_documents(tok, texts, 4, max_blocks=2).tolist() == blocks[:2].tolist()
    with pytest.raises(ValueError, match="block_size"):
        up.pack_documents(tok, texts, 1)


def test_smollm2_style_tokenizers_separate_documents_with_endoftext():
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2, "a": 3}
    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="a")), eos_token="<|im_end|>"
    )
    assert up.document_separator_id(tok) == 0  # not the chat end-of-turn token


def test_held_out_texts_are_never_trained_on():
    texts = up.heldout_texts()
    assert set(texts) == set(up.HELDOUT_TEXTS)
    validation = {p.name for p in corpus_files("validation")}
    assert validation and not validation & {p.name for p in corpus_files("train")}
    # pydoc_data is a stdlib subpackage: the corpus holds top-level modules only.
    assert all(p.parent == corpus_files("train")[0].parent for p in corpus_files("train"))
    assert "topics" not in {p.stem for p in corpus_files("train")}
    from pydoc_data.topics import topics

    assert texts["pydoc_topics"].startswith(topics[sorted(topics)[0]][:200])


# ----------------------------------------------------------------------------------------------- trainer


@pytest.mark.parametrize("version,method,lr", [(1, "full", 3e-4), (1, "lora", 3e-3), (2, "lora", 3e-2)])
def test_a_few_distillation_steps_lower_the_loss(source, students, tmp_path, version, method, lr):
    blocks = up.training_blocks(source.tokenizer, 32, max_blocks=8)
    model = up.prepare_student(up.load_student(students[version]), method, lora_r=4, lora_alpha=8)
    if version == 2:  # the exact V2 upcycle starts at KL 0 (zero gradient): move it off the teacher first
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lambda_proj" in name and p.requires_grad:
                    p.normal_(0, 0.5)
    before = kd_loss_on(model, source.model, blocks[:4])
    assert before > 0.0
    trainer = distillation_trainer(
        model, source.model, blocks, tmp_path, distill_weight=1.0, args=dict(learning_rate=lr)
    )
    trainer.train()
    after = kd_loss_on(model, source.model, blocks[:4])
    assert after < 0.9 * before
    logged = [e for e in trainer.state.log_history if "loss" in e]
    assert len(logged) == 4 and all({"lm_loss", "distill_loss", "teacher_lm_loss"} <= set(e) for e in logged)
    # With w = 1 the optimised loss is the KL itself.
    assert all(e["loss"] == pytest.approx(e["distill_loss"], rel=1e-3, abs=1e-4) for e in logged)


def test_mixed_loss_and_gradient_accumulation(source, students, tmp_path):
    """(1 − w)·LM + w·KD is what is optimised, and accumulation over micro-batches gives the same step as one batch
    (the loss is a per-micro-batch mean, divided by the accumulation steps)."""
    blocks = up.training_blocks(source.tokenizer, 32, max_blocks=4)
    models = []
    for bs, accum in ((4, 1), (2, 2), (1, 4)):
        torch.manual_seed(0)
        model = up.load_student(students[1])
        trainer = distillation_trainer(
            model,
            source.model,
            blocks,
            tmp_path,
            distill_weight=0.25,
            args=dict(
                max_steps=1,
                per_device_train_batch_size=bs,
                gradient_accumulation_steps=accum,
                optim="sgd",
                learning_rate=0.1,
                lr_scheduler_type="constant",
                max_grad_norm=0.0,
            ),
        )
        trainer.train()
        entry = next(e for e in trainer.state.log_history if "loss" in e)
        assert entry["loss"] == pytest.approx(0.75 * entry["lm_loss"] + 0.25 * entry["distill_loss"], rel=1e-3)
        models.append(model.state_dict())
    for other in models[1:]:
        for name, value in models[0].items():
            torch.testing.assert_close(other[name], value, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("version,method", [(1, "full"), (2, "lora")])
def test_lambda_trains_at_its_own_learning_rate(source, students, tmp_path, version, method):
    model = up.prepare_student(up.load_student(students[version]), method, lora_r=4, lora_alpha=8)
    blocks = up.training_blocks(source.tokenizer, 32, max_blocks=4)
    lam_names = {
        n
        for n, p in model.named_parameters()
        if p.requires_grad and ("lambda_q" in n or "lambda_k" in n or "lambda_proj" in n)
    }
    assert lam_names
    by_id = {id(p): n for n, p in model.named_parameters()}
    for scale in (1.0, 10.0):
        trainer = distillation_trainer(
            model,
            source.model,
            blocks,
            tmp_path,
            distill_weight=0.5,
            lambda_lr_scale=scale,
            args=dict(learning_rate=1e-3),
        )
        optimizer = trainer.create_optimizer()
        grouped = [{by_id[id(p)] for p in g["params"]} for g in optimizer.param_groups]
        assert sum(len(g) for g in grouped) == sum(p.requires_grad for p in model.parameters())  # every trainable once
        lam_groups = [names for names in grouped if names & lam_names]
        assert set().union(*lam_groups) >= lam_names
        assert {g["lr"] for g, names in zip(optimizer.param_groups, grouped) if names & lam_names} == {1e-3 * scale}
        if scale == 1.0:  # λ stays in the Trainer's own groups, beside other parameters
            assert all(names - lam_names for names in lam_groups)
        else:  # λ in groups of its own
            assert all(names <= lam_names for names in lam_groups)
    with pytest.raises(ValueError, match="lambda_lr_scale"):
        distillation_trainer(model, source.model, blocks, tmp_path, lambda_lr_scale=0.0)


def test_evaluation_reports_the_plain_lm_loss(source, students, tmp_path):
    held = up.heldout_blocks(source.tokenizer, 2, 32)
    model = up.load_student(students[1])
    trainer = distillation_trainer(
        model,
        source.model,
        held["validation"],
        tmp_path,
        distill_weight=1.0,
        args=dict(per_device_eval_batch_size=2, prediction_loss_only=True),
    )
    metrics = trainer.evaluate({name: LMBlockDataset(b) for name, b in held.items()})
    for name, blocks in held.items():
        assert math.exp(metrics[f"eval_{name}_loss"]) == pytest.approx(up.perplexity(model, blocks), rel=1e-4)


def test_perplexity_is_exp_of_the_token_mean_cross_entropy(source):
    blocks = up.heldout_blocks(source.tokenizer, 3, 16)["validation"]
    with torch.no_grad():
        logits = source.model(input_ids=blocks).logits
    nll = F.cross_entropy(logits[:, :-1].flatten(0, 1).double(), blocks[:, 1:].flatten())
    assert up.perplexity(source.model, blocks, batch_size=2) == pytest.approx(math.exp(nll.item()), rel=1e-5)


def test_lambda_statistics(source, students):
    v1 = up.load_student(students[1])
    stats = up.lambda_statistics(v1)
    assert stats["per_layer"] == pytest.approx(v1.layer_lambdas().tolist())
    v2 = up.load_student(students[2])
    blocks = up.heldout_blocks(source.tokenizer, 2, 16)["validation"]
    exact = up.lambda_statistics(v2, blocks)
    assert exact["mean"] == pytest.approx([0.5, 0.5]) and exact["std"] == pytest.approx([0.0, 0.0], abs=1e-7)
    assert exact["tokens"] == blocks.numel()
    with torch.no_grad():
        for layer in v2.model.layers:
            layer.self_attn.lambda_proj.weight.normal_(0, 0.5)
        lams = v2(input_ids=blocks, output_lambdas=True).lambdas
    stats = up.lambda_statistics(v2, blocks, batch_size=1)
    for layer, lam in enumerate(lams):
        assert stats["mean"][layer] == pytest.approx(lam.double().mean().item(), rel=1e-6)
        assert stats["std"][layer] == pytest.approx(lam.double().std(unbiased=False).item(), rel=1e-5)
        assert stats["head_mean_spread"][layer] == pytest.approx(lam.double().mean((0, 1)).std().item(), rel=1e-5)
    with pytest.raises(ValueError, match="held-out"):
        up.lambda_statistics(v2)


# ----------------------------------------------------------------------------------------------- λ in PEFT checkpoints


def _tiny_v1(seed=0):
    config = DiffTransformerConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        diff_version=1,
    )
    torch.manual_seed(seed)
    return DiffTransformerForCausalLM(config)


class _Rows(torch.utils.data.Dataset):
    def __init__(self):
        self.ids = torch.randint(4, 128, (16, 12), generator=torch.Generator().manual_seed(1))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class _RecordLambdas(TrainerCallback):
    def __init__(self, model):
        self.model, self.at = model, {}

    def on_step_end(self, args, state, control, **kwargs):
        self.at[state.global_step] = self.model.get_base_model().layer_lambdas().clone()


def _lora_v1():
    model = get_peft_model(_tiny_v1(), LoraConfig(target_modules=["q_proj", "v_proj"]))
    assert enable_lambda_training(model)
    return model


def _lambda_args(out, **kwargs):
    values = dict(
        max_steps=4,
        save_steps=2,
        learning_rate=0.05,
        per_device_train_batch_size=4,
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
    )
    return TrainingArguments(str(out), **{**values, **kwargs})


def test_trainer_checkpoints_of_a_v1_peft_model_keep_and_restore_lambda(tmp_path):
    """With LambdaCheckpointCallback, every Trainer checkpoint of a V1 PeftModel holds λ of its step;
    PeftModel.from_pretrained restores it, and resume_from_checkpoint continues with it (a fresh model whose λ were
    moved elsewhere ends where the uninterrupted run ended). save_adapter writes a final folder with λ."""
    initial = _tiny_v1().layer_lambdas()
    model = _lora_v1()
    record = _RecordLambdas(model)
    trainer = Trainer(
        model=model,
        args=_lambda_args(tmp_path / "out"),
        train_dataset=_Rows(),
        callbacks=[record, LambdaCheckpointCallback()],
    )
    trainer.train()
    final = model.get_base_model().layer_lambdas()
    assert not torch.allclose(final, initial, atol=1e-3)  # λ trained
    for step in (2, 4):
        saved = load_file(tmp_path / "out" / f"checkpoint-{step}" / "adapter_model.safetensors")
        keys = sorted(k for k in saved if "lambda_" in k)
        assert len(keys) == 2 * 4  # 2 layers × lambda_q1/k1/q2/k2
        assert any("lora_A" in k for k in saved)  # PEFT's own adapter is still there
        loaded = PeftModel.from_pretrained(_tiny_v1(), tmp_path / "out" / f"checkpoint-{step}")
        torch.testing.assert_close(loaded.get_base_model().layer_lambdas(), record.at[step])
    folder = save_adapter(model, tmp_path / "final")
    assert any("lambda_q1" in k for k in load_file(folder / "adapter_model.safetensors"))
    torch.testing.assert_close(PeftModel.from_pretrained(_tiny_v1(), folder).get_base_model().layer_lambdas(), final)

    # Resuming from step 2 in a fresh model whose λ were moved: the checkpoint's λ come back, and the run ends where
    # the uninterrupted one did.
    resumed = _lora_v1()
    with torch.no_grad():
        for name, param in resumed.named_parameters():
            if "lambda_" in name:
                param.add_(0.3)
    assert not torch.allclose(resumed.get_base_model().layer_lambdas(), record.at[2], atol=1e-2)
    check = _RecordLambdas(resumed)
    Trainer(
        model=resumed,
        args=_lambda_args(tmp_path / "out"),
        train_dataset=_Rows(),
        callbacks=[check, LambdaCheckpointCallback()],
    ).train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-2"))
    torch.testing.assert_close(check.at[3], record.at[3], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(resumed.get_base_model().layer_lambdas(), final, rtol=1e-5, atol=1e-6)


def test_lambda_training_keeps_the_lambdas_without_the_callback(tmp_path):
    """After enable_lambda_training, the PeftModel's own save_pretrained and a Trainer checkpoint written without
    LambdaCheckpointCallback both hold the trained λ (the class's save_pretrained is left as PEFT's)."""
    model = _lora_v1()
    assert type(model).save_pretrained is PeftModel.save_pretrained
    model.save_pretrained(tmp_path / "plain")
    assert any("lambda_" in k for k in load_file(tmp_path / "plain" / "adapter_model.safetensors"))
    Trainer(model=model, args=_lambda_args(tmp_path / "out", max_steps=2), train_dataset=_Rows()).train()
    saved = load_file(tmp_path / "out" / "checkpoint-2" / "adapter_model.safetensors")
    trained = {k: v for k, v in model.named_parameters() if "lambda_" in k}
    assert trained and set(trained) <= set(saved)
    for name, value in trained.items():
        assert torch.equal(saved[name], value.detach().cpu()), name


# ----------------------------------------------------------------------------------------------- the whole job


@pytest.fixture(scope="module")
def smoke_run(source, tmp_path_factory):
    """One uninterrupted smoke run (V1, LoRA+λ): the reference of the report and resume tests."""
    out = tmp_path_factory.mktemp("smoke")
    settings = smoke_settings(out, diff_version=1, method="lora")
    return settings, up.run_upcycle(settings, source=source, log=lambda *_: None)


def test_report_holds_what_it_claims(smoke_run, source):
    settings, report = smoke_run
    out = Path(settings.output_dir)
    on_disk = json.loads((out / "report.json").read_text())
    assert on_disk["after"]["perplexity"] == pytest.approx(report["after"]["perplexity"])
    held = up.heldout_blocks(source.tokenizer, settings.eval_blocks, settings.eval_length)
    for name, blocks in held.items():
        assert report["teacher"]["perplexity"][name] == pytest.approx(up.perplexity(source.model, blocks), rel=1e-5)
        assert report["ratio_to_teacher"]["after"][name] == pytest.approx(
            report["after"]["perplexity"][name] / report["teacher"]["perplexity"][name]
        )
    # The saved Hub folder is the trained student (LoRA merged): it reproduces the reported perplexity and λ.
    check_hub_folder(out / "model")
    saved = AutoModelForCausalLM.from_pretrained(out / "model", dtype=torch.float32)
    for name, blocks in held.items():
        assert up.perplexity(saved, blocks) == pytest.approx(report["after"]["perplexity"][name], rel=1e-4)
    assert saved.layer_lambdas().tolist() == pytest.approx(report["after"]["lambda"]["per_layer"], rel=1e-5)
    assert report["after"]["lambda"]["per_layer"] != pytest.approx(report["before"]["lambda"]["per_layer"], abs=1e-6)
    assert report["training"]["global_step"] == settings.max_steps and not report["interrupted"]
    assert report["training"]["tokens"] == settings.max_steps * settings.batch_size * settings.block_size
    assert [c["prompt"] for c in report["after"]["chat"]] == list(settings.prompts)
    # Markdown: the numbers of the JSON, and every chat answer.
    md = (out / "report.md").read_text()
    for name in held:
        assert f"{report['after']['perplexity'][name]:.3f} ({report['ratio_to_teacher']['after'][name]:.3f})" in md
    assert all(item["prompt"] in md for item in report["teacher"]["chat"])
    for name in ("training_curves.png", "telemetry.png"):
        png = out / name
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000, name
    # Telemetry: logged at step 0 and every telemetry_steps; the duplicated V1 heads start with equal maps and LoRA on
    # q_proj separates them; the last record is the saved model's, recomputed on the same probe batch.
    tel = report["telemetry"]
    assert (tel["before_step"], tel["after_step"]) == (0, settings.max_steps)
    assert tel["before"]["map_separation"] == pytest.approx([0.0, 0.0], abs=1e-6)
    assert min(tel["after"]["map_separation"]) > 1e-4
    probe = held["validation"][:2, :32]
    for name, values in telemetry.probe_metrics(
        saved, probe
    ).items():  # merged LoRA: rounding may flip a few near-zero entries
        assert tel["after"][name] == pytest.approx(values, rel=1e-4, abs=1e-3 if name == "negative_share" else 1e-6), (
            name
        )
    steps = [e["step"] for e in report["training"]["log_history"] if "diffattn/map_separation" in e]
    assert steps == [0, 2, 4]
    prov = report["provenance"]
    assert len(prov["commit"]) == 40 and isinstance(prov["dirty"], bool) and prov["machine"]["cpu"] and prov["command"]
    # The greedy chat answer of the saved model is the one reported.
    answer = up.chat(saved, source.tokenizer, settings.prompts[:1], settings.max_new_tokens)[0]["answer"]
    assert answer == report["after"]["chat"][0]["answer"]


class _InterruptAt(TrainerCallback):
    def __init__(self, step):
        self.step = step

    def on_step_begin(self, args, state, control, **kwargs):  # Ctrl-C during optimizer step `self.step + 1`
        if state.global_step == self.step:
            import signal

            os.kill(os.getpid(), signal.SIGINT)


def test_an_interrupted_run_resumes_to_the_same_model(smoke_run, source, tmp_path):
    reference_settings, _ = smoke_run
    settings = smoke_settings(tmp_path, diff_version=1, method="lora")
    import signal

    handler = signal.getsignal(signal.SIGINT)  # the default one, or SIG_IGN in a background job
    first = up.run_upcycle(settings, source=source, callbacks=[_InterruptAt(2)], log=lambda *_: None)
    # The step in progress finishes and is checkpointed, though 3 is no multiple of save_steps (2).
    assert first["interrupted"] and first["training"]["global_step"] == 3
    assert (tmp_path / "run" / "checkpoints" / "checkpoint-3").is_dir() and not (tmp_path / "run" / "model").exists()
    assert signal.getsignal(signal.SIGINT) is handler  # handler restored
    second = up.run_upcycle(settings, source=source, log=lambda *_: None)
    assert not second["interrupted"] and second["training"]["global_step"] == settings.max_steps
    resumed = load_file(tmp_path / "run" / "model" / "model.safetensors")
    expected = load_file(Path(reference_settings.output_dir) / "model" / "model.safetensors")
    assert resumed.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(resumed[name], expected[name], rtol=1e-5, atol=1e-6, msg=name)


def test_resuming_with_other_settings_is_refused(source, tmp_path):
    settings = smoke_settings(tmp_path, diff_version=1)
    (tmp_path / "run" / "checkpoints" / "checkpoint-2").mkdir(parents=True)
    (tmp_path / "run" / "run_settings.json").write_text(json.dumps({**asdict(settings), "diff_version": 2}))
    with pytest.raises(SystemExit, match="diff_version: checkpoint 2 vs now 1"):
        up.run_upcycle(settings, source=source, log=lambda *_: None)


def test_cli_help_bad_flags_and_smoke_run(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.parse_settings(["--help"])
    assert exit_info.value.code == 0
    help_text = capsys.readouterr().out
    for action in cli.build_parser()._actions:
        for opt in action.option_strings:
            assert opt in help_text
        assert action.help, f"{action.option_strings} has no help"
    for bad, field in (
        (["--distill-weight", "1.5"], "distill_weight"),
        (["--max-steps", "0"], "max_steps"),
        (["--method", "prefix"], "--method"),
        (["--diff-version", "3"], "--diff-version"),
    ):
        with pytest.raises(SystemExit) as exit_info:
            cli.parse_settings(bad)
        assert exit_info.value.code == 2 and field in capsys.readouterr().err, bad
    assert cli.parse_settings(["--smoke", "--max-steps", "3"]).max_steps == 3  # typed flags win over --smoke
    proc = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--smoke",
            "--diff-version",
            "2",
            "--threads",
            "1",
            "--output-dir",
            str(tmp_path / "cli"),
        ],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "it/s]" in proc.stderr or "s/it]" in proc.stderr  # the Trainer's tqdm progress bar
    report = json.loads((tmp_path / "cli" / "report.json").read_text())
    assert report["student"]["diff_version"] == 2
    # V2 is exact: before training the student is the teacher.
    assert report["before"]["perplexity"] == pytest.approx(report["teacher"]["perplexity"], rel=1e-5)
    assert report["before"]["lambda"]["mean"] == pytest.approx([0.5] * len(report["before"]["lambda"]["mean"]))
    assert "student after: held-out perplexity" in proc.stdout


# ----------------------------------------------------------------------------------------------- benchmark


def test_compare_upcycled_smoke(tmp_path):
    bench = _load("compare_upcycled", REPO / "benchmarks" / "compare_upcycled.py")
    results = bench.main(["--size", "smoke", "--out", str(tmp_path), "--no-progress", "--threads", "1"])
    assert set(results["runs"]) == {"llama", "v2", "v1", "v1_eps1"}
    assert all(set(per_seed) == {0, 1} for per_seed in results["runs"].values())
    llama, v2 = results["runs"]["llama"][0]["before"], results["runs"]["v2"][0]["before"]
    # V2 is exact: before fine-tuning it is the source, perplexity and probe answers alike.
    assert v2["perplexity"] == pytest.approx(llama["perplexity"], rel=1e-5)
    assert {k: e["accuracy"] for k, e in v2["probes"].items()} == {k: e["accuracy"] for k, e in llama["probes"].items()}
    # Same data and steps for every model; the summary is the mean and sample std over seeds.
    steps = {r["train"]["history"][-1]["step"] for per_seed in results["runs"].values() for r in per_seed.values()}
    assert steps == {bench.SIZES["smoke"]["steps"]}
    values = [results["runs"]["v1"][s]["after"]["perplexity"]["validation"] for s in (0, 1)]
    stats = results["summary"]["v1"]["after"]["ppl_validation"]
    assert stats["mean"] == pytest.approx(sum(values) / 2) and stats["std"] == pytest.approx(
        abs(values[0] - values[1]) / math.sqrt(2)
    )
    for name in ("results.json", "results.md", "comparison.png"):
        assert (tmp_path / name).is_file()
    md = (tmp_path / "results.md").read_text()
    assert "python benchmarks/compare_upcycled.py --size smoke" in md
    prov = results["provenance"]  # where benchmarks/harness.py's readers look for it
    assert prov["script"] == "compare_upcycled.py" and prov["commit"] in md and "nearly inert" in md
    assert (
        prov["command"]
        == "python benchmarks/compare_upcycled.py --size smoke --out " + str(tmp_path) + " --no-progress --threads 1"
    )
    # The V1 layout with a nearly inert per-head norm starts closer to the source than the paper's V1.
    start = {m: results["summary"][m]["before"]["ppl_validation"]["mean"] for m in ("llama", "v1", "v1_eps1")}
    assert abs(start["v1_eps1"] - start["llama"]) < abs(start["v1"] - start["llama"])
    # Telemetry of every upcycle, before (step 0) and after: the duplicated and exact conversions start with equal
    # maps; the summary is the mean over seeds of each seed's mean over layers.
    for name in ("v2", "v1", "v1_eps1"):
        tel = results["summary"][name]["telemetry"]
        assert (tel["before"]["step"], tel["after"]["step"]) == (0, bench.SIZES["smoke"]["steps"])
        assert tel["before"]["map_separation"]["layer_max"]["mean"] == pytest.approx(0.0, abs=1e-6)
        per_seed = [r["train"]["telemetry"][-1]["metrics"]["map_separation"] for r in results["runs"][name].values()]
        assert tel["after"]["map_separation"]["layer_mean"]["mean"] == pytest.approx(
            sum(sum(v) / len(v) for v in per_seed) / len(per_seed)
        )
    assert "telemetry" not in results["summary"]["llama"]


def test_compare_upcycled_resume_runs_only_the_missing_seeds_and_refuses_other_settings(tmp_path):
    bench = _load("compare_upcycled", REPO / "benchmarks" / "compare_upcycled.py")
    common = ["--size", "smoke", "--out", str(tmp_path), "--no-progress", "--threads", "1", "--models", "llama,v1"]
    first = bench.main(common + ["--seeds", "0"])
    again = bench.main(common + ["--seeds", "0,1", "--resume"])
    assert again["meta"]["seeds"] == [0, 1] and all(set(p) == {0, 1} for p in again["runs"].values())
    # Seed 0 comes from the file, not from a second run (its training time would differ).
    for name in ("llama", "v1"):
        assert again["runs"][name][0]["train"]["seconds"] == first["runs"][name][0]["train"]["seconds"]
    assert again["provenance"]["resumed_from"]["utc"] == first["provenance"]["utc"]
    assert again["meta"]["wall_seconds"] > first["meta"]["wall_seconds"]
    with pytest.raises(SystemExit, match="steps=3"):
        bench.main(common + ["--seeds", "0,1,2", "--resume", "--steps", "4"])


# ----------------------------------------------------------------------------------------------- GGUF source


def test_compare_upcycled_llama_student_of_a_gguf_source_is_plain_and_trainable(tmp_path):
    """transformers' GGUF loader marks the de-quantised model as quantized, which the Trainer refuses to fine-tune:
    load_source gives a plain model with the source's function, and the fair comparison's Llama student copies it.
    (A tiny GGUF file: the loader's marking does not depend on the model.)"""
    from transformers import AutoTokenizer
    from transformers.trainer_utils import validate_quantization_for_training

    from utils_gguf import gguf_llama, write_tiny_gguf

    gguf = write_tiny_gguf(tmp_path / "tiny.gguf")
    teacher = gguf_llama(gguf)  # as transformers' GGUF loader gives it
    tokenizer = AutoTokenizer.from_pretrained(tmp_path, gguf_file=gguf.name)
    with pytest.raises(ValueError):
        validate_quantization_for_training(teacher)
    source = up.load_source(gguf, progress=False)
    bench = _load("compare_upcycled", REPO / "benchmarks" / "compare_upcycled.py")
    llama = bench.student("llama", source, 0, None)
    assert "quantization_config" not in llama.config.to_dict()
    validate_quantization_for_training(llama)
    ids = up.heldout_blocks(tokenizer, 1, 32)["validation"]
    with torch.no_grad():
        torch.testing.assert_close(llama(ids).logits, teacher(ids).logits, rtol=0, atol=0)

"""What every conversion guarantees (docs/convert.md): strict key/shape checks, clear format errors, input never
overwritten, no half-written output, sharding, pickle opt-in, side files, remote code, the CLI and the docs."""

import contextlib
import io
import json
import os
import re
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    DiffLlamaConfig,
    DiffLlamaForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

import difftransformer.convert as conv
from difftransformer import DiffTransformerConfig, DiffTransformerForCausalLM
from difftransformer.convert import ConversionError, convert
from difftransformer.convert.cli import build_parser, main
from difftransformer.convert.engine import is_lambda_vector
from utils_gguf import write_tiny_gguf
from utils_microsoft import ms_config, ms_state_dict, write_source
from utils_motif import motif_folder

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # one thread for these tests, not for the whole session
REPO = Path(__file__).resolve().parents[2]
IDS = torch.tensor([[4, 8, 15, 16, 23, 42, 7, 9]])


def tiny_llama(hq=8, hkv=4, seed=0, **overrides):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=hq,
                      num_key_value_heads=hkv, head_dim=8, max_position_embeddings=64, **overrides)  # fmt: skip
    return LlamaForCausalLM(cfg).eval()


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {w: i for i, w in enumerate(["<pad>", "<s>", "</s>", "<unk>"] + [f"w{i}" for i in range(60)])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    )


def logits_of(folder_or_model):
    model = (
        AutoModelForCausalLM.from_pretrained(folder_or_model)
        if isinstance(folder_or_model, (str, Path))
        else folder_or_model
    )
    with torch.no_grad():
        return model.eval()(IDS).logits


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("src") / "llama"
    tiny_llama().save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


# ------------------------------------------------------------------ the source must be fully accounted for


def test_unknown_missing_and_misshaped_tensors_are_named(tmp_path, llama_dir):
    sd = load_file(llama_dir / "model.safetensors")
    del sd["model.layers.1.mlp.up_proj.weight"]
    sd["model.layers.0.self_attn.q_norm.weight"] = torch.ones(8)
    sd["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(16, 32)
    src = tmp_path / "broken"
    src.mkdir()
    save_file(sd, str(src / "model.safetensors"), metadata={"format": "pt"})
    (src / "config.json").write_text((llama_dir / "config.json").read_text())
    with pytest.raises(ConversionError) as err:
        convert("llama", src, tmp_path / "out", diff_version=2, progress=False)
    message = str(err.value)
    assert "missing tensors: model.layers.1.mlp.up_proj.weight" in message
    assert "unknown tensors: model.layers.0.self_attn.q_norm.weight" in message
    assert "mis-shaped tensors: model.layers.0.self_attn.k_proj.weight (16, 32) (expected (32, 32))" in message
    assert not (tmp_path / "out").exists() and os.listdir(tmp_path) == ["broken"]


def test_wrong_source_format_or_architecture(tmp_path, llama_dir):
    with pytest.raises(
        ConversionError, match=r"--from diffllama expects .*'diffllama'.*found 'llama'; did you mean --from llama"
    ):
        convert("diffllama", llama_dir, tmp_path / "o", progress=False)
    with pytest.raises(ConversionError, match=r"--from difftransformer expects .*found 'llama'"):
        convert("difftransformer", llama_dir, tmp_path / "o", progress=False)
    gpt = tmp_path / "gpt2"
    gpt.mkdir()
    (gpt / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ConversionError, match=r"model_type in \['llama', 'mistral', 'qwen2'\], found 'gpt2'"):
        convert("llama", gpt, tmp_path / "o", diff_version=2, progress=False)
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text((llama_dir / "config.json").read_text())
    with pytest.raises(ConversionError, match="No weights found"):
        convert("llama", empty, tmp_path / "o", diff_version=2, progress=False)
    with pytest.raises(ConversionError, match="is not a folder"):
        convert("llama", tmp_path / "nowhere", tmp_path / "o", diff_version=2, progress=False)
    with pytest.raises(ConversionError, match="has no config.json"):
        convert("llama", empty / "..", tmp_path.parent / f"{tmp_path.name}-o", diff_version=2, progress=False)
    with pytest.raises(ConversionError, match="--key-map applies to Microsoft sources only"):
        convert("llama", llama_dir, tmp_path / "o", diff_version=2, key_map={"a.": "b."}, progress=False)
    with pytest.raises(ConversionError, match=r"--dtype 'float8'; allowed: auto, float32, float16, bfloat16"):
        convert("llama", llama_dir, tmp_path / "o", diff_version=2, dtype="float8", progress=False)
    with pytest.raises(ConversionError, match=r"--diff-version 2 conflicts with --from diffllama"):
        config = DiffLlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=4,
                                 num_key_value_heads=2, vocab_size=32)  # fmt: skip
        convert("diffllama", DiffLlamaForCausalLM(config), tmp_path / "o", diff_version=2)
    assert not (tmp_path / "o").exists()


def test_pickled_weights_need_explicit_flag(tmp_path):
    model = tiny_llama(seed=1)
    src = tmp_path / "bin"
    model.save_pretrained(src)
    torch.save(load_file(src / "model.safetensors"), src / "pytorch_model.bin")
    (src / "model.safetensors").unlink()
    with pytest.raises(ConversionError, match="--allow-pickle"):
        convert("llama", src, tmp_path / "out", diff_version=2, progress=False)
    convert("llama", src, tmp_path / "out", diff_version=2, allow_pickle=True, progress=False)
    torch.testing.assert_close(logits_of(tmp_path / "out"), logits_of(model), atol=1e-5, rtol=1e-5)


def test_sharded_input_and_sharded_output_with_index(tmp_path, monkeypatch):
    model = tiny_llama(seed=2)
    model.save_pretrained(tmp_path / "src", max_shard_size="20KB")
    assert (tmp_path / "src" / "model.safetensors.index.json").is_file()
    real_save, in_memory = conv.engine.save_file, []

    def recording_save(tensors, *args, **kwargs):
        in_memory.append((sum(t.nbytes for t in tensors.values()), max(t.nbytes for t in tensors.values())))
        return real_save(tensors, *args, **kwargs)

    monkeypatch.setattr(conv.engine, "save_file", recording_save)
    convert("llama", tmp_path / "src", tmp_path / "out", diff_version=2, max_shard_size="20KB", progress=False)
    # Streaming: never more than one shard (20KB, or one larger tensor on its own) held at a time.
    assert len(in_memory) > 1 and all(total <= 20_000 or total == largest for total, largest in in_memory)
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and all(re.fullmatch(r"model-\d{5}-of-\d{5}\.safetensors", s) for s in shards)
    assert not (tmp_path / "out" / "model.safetensors").exists()
    stored = {k for s in shards for k in load_file(tmp_path / "out" / s)}
    assert stored == set(index["weight_map"])
    torch.testing.assert_close(logits_of(tmp_path / "out"), logits_of(model), atol=1e-5, rtol=1e-5)
    # Re-saving our own format (here: unsharded, float16) reads the sharded result back.
    convert("difftransformer", tmp_path / "out", tmp_path / "fp16", dtype="float16", progress=False)
    assert set(load_file(tmp_path / "fp16" / "model.safetensors")) == stored


def test_resave_in_memory_model_leaves_it_untouched(tmp_path):
    """--from difftransformer with a model in memory: bf16 copy on disk, λ kept in float32, caller's model unchanged."""
    model = DiffTransformerForCausalLM(DiffTransformerConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2))  # fmt: skip
    config_before = model.config.to_json_string()
    convert("difftransformer", model, tmp_path / "bf16", dtype="bfloat16", progress=False)
    assert model.config.to_json_string() == config_before and model.dtype == torch.float32
    stored = load_file(tmp_path / "bf16" / "model.safetensors")
    assert stored["model.layers.0.self_attn.lambda_q1"].dtype == torch.float32
    assert stored["model.layers.0.self_attn.q_proj.weight"].dtype == torch.bfloat16
    torch.testing.assert_close(
        stored["model.layers.1.self_attn.lambda_k2"], model.model.layers[1].self_attn.lambda_k2.detach(), rtol=0, atol=0
    )


# ------------------------------------------------------------------ output safety


def test_input_is_never_overwritten_and_non_empty_output_needs_overwrite(tmp_path, llama_dir):
    before = {p.name: p.read_bytes() for p in llama_dir.iterdir()}
    for out in (llama_dir, llama_dir.parent, llama_dir / "."):
        with pytest.raises(ConversionError, match="would overwrite the input"):
            convert("llama", llama_dir, out, diff_version=2, overwrite=True, progress=False)
    with pytest.raises(ConversionError, match="lies inside the input folder"):
        convert("llama", llama_dir, llama_dir / "converted", diff_version=2, progress=False)
    assert {p.name: p.read_bytes() for p in llama_dir.iterdir()} == before

    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    with pytest.raises(ConversionError, match="is not empty; pass --overwrite"):
        convert("llama", llama_dir, out, diff_version=2, progress=False)
    assert os.listdir(out) == ["notes.txt"]
    convert("llama", llama_dir, out, diff_version=2, overwrite=True, progress=False)
    assert not (out / "notes.txt").exists() and (out / "model.safetensors").is_file()
    assert sorted(os.listdir(tmp_path)) == ["out"]  # no temporary or backup folder left behind


def test_interrupted_conversion_leaves_no_half_written_model(tmp_path, llama_dir, monkeypatch):
    real_save, calls = conv.engine.save_file, []

    def fail_on_second_shard(*args, **kwargs):
        calls.append(args[1])
        if len(calls) == 2:
            raise KeyboardInterrupt("simulated interruption")
        return real_save(*args, **kwargs)

    monkeypatch.setattr(conv.engine, "save_file", fail_on_second_shard)
    with pytest.raises(KeyboardInterrupt):
        convert("llama", llama_dir, tmp_path / "out", diff_version=2, max_shard_size="20KB", progress=False)
    assert len(calls) == 2 and Path(calls[0]).parent.parent == tmp_path  # it wrote into a temporary sibling...
    assert os.listdir(tmp_path) == []  # ...which is gone, and no output exists

    # With --overwrite, the previous output survives an interrupted run untouched.
    previous = tmp_path / "previous"
    previous.mkdir()
    (previous / "config.json").write_text("{}")
    calls.clear()
    with pytest.raises(KeyboardInterrupt):
        convert("llama", llama_dir, previous, diff_version=2, max_shard_size="20KB", overwrite=True, progress=False)
    assert os.listdir(tmp_path) == ["previous"] and os.listdir(previous) == ["config.json"]


# ------------------------------------------------------------------ output contents


def test_side_files_copied_and_remote_code_loads_without_the_package(tmp_path, llama_dir):
    out = tmp_path / "out"
    result = convert("llama", llama_dir, out, diff_version=2, progress=False)
    assert {"tokenizer.json", "tokenizer_config.json", "generation_config.json"} <= set(result.copied_files)
    assert (
        AutoTokenizer.from_pretrained(out)("w1 w2").input_ids
        == AutoTokenizer.from_pretrained(llama_dir)("w1 w2").input_ids
    )
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["DiffTransformerForCausalLM"]
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_difftransformer.DiffTransformerForCausalLM"
    assert config["auto_map"]["AutoModel"] == "modeling_difftransformer.DiffTransformerModel"
    assert (out / "modeling_difftransformer.py").is_file() and (out / "configuration_difftransformer.py").is_file()
    # The temporary folder was private (mkdtemp); the installed result has ordinary permissions, as save_pretrained's.
    umask = os.umask(0)
    os.umask(umask)
    assert out.stat().st_mode & 0o777 == 0o777 & ~umask
    assert all(p.stat().st_mode & 0o777 == 0o666 & ~umask for p in out.iterdir())

    torch.save(logits_of(llama_dir), tmp_path / "expected.pt")
    script = textwrap.dedent(
        f"""
        import sys
        sys.modules["difftransformer"] = None  # the package is absent: only the folder's own code may be used
        import torch
        from transformers import AutoModel, AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained({str(out)!r}, trust_remote_code=True).eval()
        assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
        with torch.no_grad():
            logits = model(torch.tensor({IDS.tolist()})).logits
        torch.testing.assert_close(logits, torch.load({str(tmp_path / "expected.pt")!r}), atol=1e-5, rtol=1e-5)
        base = AutoModel.from_pretrained({str(out)!r}, trust_remote_code=True)
        assert type(base).__name__ == "DiffTransformerModel"
        print("remote code ok")
        """
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(tmp_path / "modules")}
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300
    )
    assert proc.returncode == 0 and "remote code ok" in proc.stdout, proc.stderr[-3000:]


# ------------------------------------------------------------------ command line


def test_cli_help_explains_every_option():
    parser = build_parser()
    text = parser.format_help()
    for action in parser._actions:
        for flag in action.option_strings:
            assert flag in text
        assert action.help and len(action.help) > 15, action.option_strings
    for flag in ("--from", "--to", "--input", "--output", "--diff-version", "--dtype", "--verify", "--overwrite",
                 "--allow-pickle", "--key-map", "--microsoft-module", "--seed", "--max-shard-size", "--no-progress",
                 "--v1-init", "--v1-calibration"):  # fmt: skip
        assert flag in text
    # The file runs as a script too (python convert_scripts/convert.py), importing the installed package.
    proc = subprocess.run(
        [sys.executable, str(REPO / "convert_scripts" / "convert.py"), "--help"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0 and "--allow-pickle" in proc.stdout


def test_installed_console_command_converts_with_a_progress_bar(tmp_path, llama_dir):
    """`difftransformer-convert` (pyproject.toml's console script) runs the same CLI; tqdm reports progress over
    tensors."""
    command = Path(sys.executable).parent / "difftransformer-convert"
    if not command.exists():
        pytest.skip(f"difftransformer-convert is not installed beside {sys.executable} (package not pip-installed)")
    out = tmp_path / "v2"
    argv = [str(command), "--from", "llama", "--diff-version", "2", "--input", str(llama_dir), "--output", str(out)]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr
    n_tensors = len(load_file(out / "model.safetensors"))
    assert re.search(rf"Converting tensors: 100%.*{n_tensors}/{n_tensors}", proc.stderr), proc.stderr
    torch.testing.assert_close(logits_of(out), logits_of(llama_dir), atol=1e-5, rtol=0)


def test_auto_dtype_follows_the_weights_not_the_float32_lambdas(tmp_path):
    """A Microsoft checkpoint has no dtype in its config: `--dtype auto` takes the dtype holding most weights, even when
    the (always float32) λ vectors come first; λ stays float32 in the output."""
    sd = ms_state_dict(1, 4, 2, seed=3)
    sd = {k: v if is_lambda_vector(k) else v.to(torch.bfloat16) for k, v in sd.items()}
    sd = dict(sorted(sd.items(), key=lambda kv: not is_lambda_vector(kv[0])))  # λ first
    src = write_source(tmp_path / "ms", sd, ms_config(4, 2, module="MultiheadFlashDiff1"))
    convert("microsoft-v1", src, tmp_path / "out", progress=False)
    weights = load_file(tmp_path / "out" / "model.safetensors")
    assert weights["model.layers.0.self_attn.q_proj.weight"].dtype == torch.bfloat16
    assert weights["model.layers.0.self_attn.lambda_q1"].dtype == torch.float32


def test_cli_converts_verifies_and_reports_errors(tmp_path, llama_dir, capsys):
    assert (
        main(
            [
                "--from",
                "llama",
                "--diff-version",
                "2",
                "--input",
                str(llama_dir),
                "--output",
                str(tmp_path / "o"),
                "--verify",
                "--no-progress",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    diff = float(re.search(r"max \|logit difference\|.*: ([0-9.e+-]+)", out).group(1))
    assert diff < 1e-4 and "exact conversion" in out
    assert main(["--from", "llama", "--input", str(llama_dir), "--output", str(tmp_path / "o2")]) == 2
    assert "--from llama needs --diff-version" in capsys.readouterr().err


def _docs_blocks(language):
    text = (REPO / "docs" / "convert.md").read_text()
    return re.findall(rf"```{language}\n(.*?)```", text, flags=re.S)


def test_docs_examples_run(tmp_path, monkeypatch, capsys):
    """Every command and code block of docs/convert.md, run as written against tiny stand-in inputs."""
    monkeypatch.chdir(tmp_path)
    tiny_llama(seed=5).save_pretrained("my-llama")
    tiny_tokenizer().save_pretrained("my-llama")
    torch.manual_seed(6)
    config = DiffLlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=8, num_key_value_heads=4, rms_norm_eps=1e-5)  # fmt: skip
    DiffLlamaForCausalLM(config).save_pretrained("my-diffllama")
    (key_map,) = _docs_blocks("json")
    Path("torchscale-keys.json").write_text(key_map)
    inverse = sorted(((v, k) for k, v in json.loads(key_map).items()), key=lambda kv: -len(kv[0]))

    def torchscale_name(key):
        for ours, theirs in inverse:
            m = re.match(re.escape(ours).replace(re.escape("{l}"), r"(\d+)"), key)
            if m:
                return theirs.replace("{l}", m.group(1) if m.groups() else "") + key[m.end() :]
        raise AssertionError(key)

    sd = {torchscale_name(k): v for k, v in ms_state_dict(1, 4, 2).items()}
    write_source(tmp_path / "my-microsoft-v1", sd, ms_config(4, 2))
    write_source(tmp_path / "my-microsoft-v2", ms_state_dict(2, 4, 2, d=8), ms_config(4, 2, d=8))
    write_tiny_gguf(
        tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf", hq=3, hkv=1
    )  # a tiny stand-in with the same layout rules
    # Motif-2-12.7B's head topology (8 groups of 4 signal + 1 noise half-heads, 16 KV half-heads), tiny widths
    motif_folder(
        tmp_path / "Motif-2-12.7B",
        "12.7b",
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=2,
        head_dim=8,
        vocab_size=64,
        max_position_embeddings=64,
    )

    commands = [c for block in _docs_blocks("bash") for c in block.replace("\\\n", " ").splitlines() if c.strip()]
    assert len(commands) == 12
    for command in commands:
        argv = shlex.split(command)
        assert argv[0] == "difftransformer-convert"
        assert main([*argv[1:], "--no-progress"]) == 0, (command, capsys.readouterr().err)
        output = argv[argv.index("--output") + 1]
        assert AutoModelForCausalLM.from_pretrained(output) is not None

    (code,) = _docs_blocks("python")
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        exec(compile(code, "docs/convert.md", "exec"), {})
    assert float(printed.getvalue().strip().splitlines()[-1]) < 1e-4

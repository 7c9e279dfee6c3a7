"""Quantized loading (transformers' ``quantization_config``) never touches the differential parameters: V2's
``lambda_proj``, V1's λ vectors and per-head norm (``subln``) stay unconverted, bit-identical to the unquantized
model's and in the dtype they have without quantization, under bitsandbytes (4- and 8-bit, its CPU kernels), torchao
(int8 and int4 weight-only) and optimum-quanto (int8, int4); greedy generation runs; QLoRA
(``peft.prepare_model_for_kbit_training`` + LoRA) trains with λ trainable. docs/ecosystem.md, "Tools".

Every transformers quantizer converts ``nn.Linear`` layers (torchao: the weights of ``nn.Linear``); V2's λ projection
is a module of its own (``DiffTransformerLambdaProjection``), V1's λ vectors and per-head norm are no linear layers, so
none is converted, whatever skip list the user gives. Each test also checks that the other linear layers *were*
quantized, so that a scheme that converts nothing cannot pass."""

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM

from difftransformer import DiffTransformerConfig, DiffTransformerForCausalLM
from difftransformer.modeling_difftransformer import DiffTransformerLambdaProjection

pytestmark = pytest.mark.usefixtures("one_torch_thread")

DIFFERENTIAL = ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2", "subln.weight", "lambda_proj.weight")


def _bnb(bits):
    pytest.importorskip("bitsandbytes", reason="bitsandbytes is not installed (pip install bitsandbytes)")
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_4bit=True) if bits == 4 else BitsAndBytesConfig(load_in_8bit=True)


def _torchao(kind):
    pytest.importorskip("torchao", reason="torchao is not installed (pip install torchao)")
    from torchao.quantization import Int4WeightOnlyConfig, Int8WeightOnlyConfig, IntxWeightOnlyConfig, PerGroup
    from transformers import TorchAoConfig

    if kind == "int8":
        return TorchAoConfig(Int8WeightOnlyConfig())
    if kind == "int4":  # torchao's int4 weight-only on CPU: int4 values in groups of 32 along the input
        return TorchAoConfig(IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(32)))
    if not torch.cuda.is_available():
        pytest.skip(
            "torchao's Int4WeightOnlyConfig packs for CUDA kernels (tinygemm's tile layout, or mslk's, a CUDA "
            "library): no CPU form; its CPU int4 weight-only scheme is IntxWeightOnlyConfig (torchao-int4)"
        )
    return TorchAoConfig(Int4WeightOnlyConfig(group_size=32))


def _quanto(weights):
    pytest.importorskip("optimum.quanto", reason="optimum-quanto is not installed (pip install optimum-quanto)")
    from transformers import QuantoConfig

    return QuantoConfig(weights=weights)


SCHEMES = {
    "bnb-4bit": lambda: _bnb(4),
    "bnb-8bit": lambda: _bnb(8),
    "torchao-int8": lambda: _torchao("int8"),
    "torchao-int4": lambda: _torchao("int4"),
    "torchao-int4-cuda": lambda: _torchao("int4-cuda"),
    "quanto-int8": lambda: _quanto("int8"),
    "quanto-int4": lambda: _quanto("int4"),
}


def tiny(version):
    # Widths of 64: bitsandbytes' CPU 4-bit kernel packs output features in blocks, torchao's int4 groups inputs by 32.
    return DiffTransformerConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=16,
        diff_version=version,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    found = {}
    for version in (1, 2):
        torch.manual_seed(version)
        folder = tmp_path_factory.mktemp(f"v{version}")
        DiffTransformerForCausalLM(tiny(version)).save_pretrained(folder)
        found[version] = folder
    return found


def differential(model) -> dict[str, torch.Tensor]:
    return {name: param for name, param in model.named_parameters() if name.endswith(DIFFERENTIAL)}


def is_quantized(linear: nn.Module) -> bool:
    """A linear layer some scheme converted: another class (bitsandbytes, quanto) or a tensor subclass (torchao)."""
    return type(linear) is not nn.Linear or type(linear.weight) is not nn.Parameter


@pytest.fixture
def no_quanto_compile(request):
    """quanto's int4 unpack compiles a C++ extension on first use (minutes): the torch unpack of tests/conftest.py."""
    if request.getfixturevalue("scheme") == "quanto-int4":
        request.getfixturevalue("quanto_without_its_compiled_kernel")


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_quantization_leaves_the_differential_parameters_alone(folders, scheme, version, no_quanto_compile):
    config = SCHEMES[scheme]()
    reference = AutoModelForCausalLM.from_pretrained(folders[version])
    model = AutoModelForCausalLM.from_pretrained(folders[version], quantization_config=config)

    attention = [layer.self_attn for layer in model.model.layers]
    assert all(is_quantized(a.q_proj) and is_quantized(a.o_proj) for a in attention), scheme  # it did quantize
    if version == 2:
        assert all(
            type(a.lambda_proj) is DiffTransformerLambdaProjection and type(a.lambda_proj.weight) is nn.Parameter
            for a in attention
        )
    expected, got = differential(reference), differential(model)
    assert sorted(got) == sorted(expected) and len(got) == (
        10 if version == 1 else 2
    )  # 2 layers: 4 λ + subln, or lambda_proj
    for name, param in got.items():
        assert type(param) is nn.Parameter, (name, type(param))
        assert param.dtype == expected[name].dtype and torch.equal(param, expected[name]), name

    prompt = torch.tensor([[1, 5, 9, 13]])
    out = model.generate(prompt, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert out.shape == (1, 8) and torch.equal(out[:, :4], prompt)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_differential_parameters_keep_the_dtype_of_the_load(folders, dtype):
    """In a bfloat16 or float16 load, quantized or not, lambda_proj and subln have the load's dtype and V1's λ vectors
    stay float32, as without quantization; the float16 V2 runs."""
    for version in (1, 2):
        plain = AutoModelForCausalLM.from_pretrained(folders[version], dtype=dtype)
        quantized = AutoModelForCausalLM.from_pretrained(
            folders[version], dtype=dtype, quantization_config=SCHEMES["torchao-int8"]()
        )
        for model in (plain, quantized):
            for name, param in differential(model).items():
                assert param.dtype == (torch.float32 if ".lambda_" in name and "proj" not in name else dtype), name
            with torch.no_grad():
                assert torch.isfinite(model(torch.tensor([[1, 5, 9]])).logits).all()
        for name, param in differential(quantized).items():
            assert torch.equal(param, differential(plain)[name]), name


def test_a_users_skip_list_keeps_the_differential_parameters_too(folders):
    """bitsandbytes replaces its default skips (lm_head) with ``llm_int8_skip_modules`` when given: λ's projection
    stays unconverted whatever the user's list says, since it is no linear layer."""
    pytest.importorskip("bitsandbytes", reason="bitsandbytes is not installed")
    from transformers import BitsAndBytesConfig

    model = AutoModelForCausalLM.from_pretrained(
        folders[2], quantization_config=BitsAndBytesConfig(load_in_8bit=True, llm_int8_skip_modules=["down_proj"])
    )
    layer = model.model.layers[0]
    assert type(layer.mlp.down_proj) is nn.Linear and is_quantized(layer.self_attn.q_proj)
    assert type(layer.self_attn.lambda_proj) is DiffTransformerLambdaProjection


def stored(weight: torch.Tensor) -> torch.Tensor:
    """The integers a quantized weight stores (torchao's tensor subclasses keep them in ``qdata``)."""
    return getattr(weight, "qdata", weight).detach()


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("scheme", ["bnb-4bit", "torchao-int8"])
def test_qlora_trains_lambda_with_the_adapter(folders, scheme, version):
    """QLoRA as PEFT documents it: prepare_model_for_kbit_training, then LoRA; λ trains beside the adapter (V2:
    modules_to_save=["lambda_proj"]; V1: enable_lambda_training), the quantized base weights do not change."""
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

    from difftransformer.integrations import enable_lambda_training, lambda_modules_to_save

    model = AutoModelForCausalLM.from_pretrained(folders[version], quantization_config=SCHEMES[scheme]())
    model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    lora = LoraConfig(
        task_type="CAUSAL_LM", target_modules=["q_proj", "v_proj"], modules_to_save=lambda_modules_to_save(model.config)
    )
    model = get_peft_model(model, lora)
    if version == 1:
        enable_lambda_training(model)
    lambdas = {n: p for n, p in model.named_parameters() if p.requires_grad and "lambda" in n}
    assert len(lambdas) == (8 if version == 1 else 2), sorted(lambdas)  # V2: each layer's copy in modules_to_save
    frozen = {n: stored(p).clone() for n, p in model.named_parameters() if n.endswith("o_proj.weight")}
    before = {n: p.detach().clone() for n, p in lambdas.items()}

    ids = torch.randint(3, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model.train()
    losses = []
    for _ in range(3):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0], losses
    assert all(not torch.equal(before[n], p) for n, p in lambdas.items())  # every λ moved
    for name, weight in model.named_parameters():
        if name in frozen:
            assert torch.equal(stored(weight), frozen[name]), name

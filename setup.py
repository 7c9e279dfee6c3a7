from pathlib import Path

from setuptools import find_packages, setup

setup(
    name="difftransformer",
    version="0.1.0",
    description="Differential Transformer (DIFF V1, arXiv 2410.05258, and DIFF V2) for Hugging Face transformers",
    long_description=Path(__file__).with_name("README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    license="MIT",
    python_requires=">=3.10",
    packages=find_packages(include=["difftransformer", "difftransformer.*", "convert_scripts"]),
    # Every lower bound is a version CI runs (tests/test_versions.py checks it): transformers' in the lowest-version
    # run (scripts/setup_min.sh, .venv-vllm), the others' in the pinned run (requirements-dev.txt); CI also runs the
    # newest releases these ranges allow (scripts/setup_latest.sh).
    install_requires=[
        "torch>=2.13",
        "transformers>=5.19,<6",  # 5.19: vLLM 0.32's pin, the lowest-version run
        "safetensors>=0.8",
        "accelerate>=1.15",
        "tqdm",
    ],
    extras_require={
        "train": ["tokenizers>=0.23.3", "matplotlib>=3.7", "peft>=0.21.2"],
        "test": ["pytest>=8", "optimum-quanto>=0.2", "tokenizers>=0.23.3", "matplotlib>=3.7", "peft>=0.21.2", "gguf>=0.10",
                 "parameterized"],  # parameterized: imported by transformers' common model tests
        # difftransformer-convert --input model.gguf (transformers' GGUF loader needs it)
        "gguf": ["gguf>=0.10"],
    },
    entry_points={
        "console_scripts": [
            "difftransformer-convert=convert_scripts.convert:main",
            # refreshes the remote code of saved folders (docs/ecosystem.md#updating-a-saved-folders-code)
            "difftransformer-update-code=difftransformer.hub:main_update_code",
        ],
        # vLLM loads it in every process: DIFF V2 folders then serve on a native vLLM model (difftransformer/vllm_model.py)
        "vllm.general_plugins": ["difftransformer = difftransformer.vllm_plugin:register"],
    },
)

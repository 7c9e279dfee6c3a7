"""Motif checkpoint folders for the tests: Motif's config.json (tests/motif_reference.py's configs, with the auto_map
of Motif's Hub folders) and random weights in Motif's key layout."""

import json

import torch
from safetensors.torch import save_file

from motif_reference import motif_config, random_motif_checkpoint

# Motif's own files, named by the auto_map of its Hub folders; absent here, so loading must not need them.
MOTIF_AUTO_MAP = {
    "AutoConfig": "configuration_motif.MotifConfig",
    "AutoModelForCausalLM": "modeling_motif.MotifForCausalLM",
}


def motif_folder(path, kind, seed=0, dtype=torch.float32, **overrides):
    """A Motif checkpoint folder: Motif's config.json (with its auto_map) and random weights in its key layout."""
    cfg = {**motif_config(kind, **overrides), "auto_map": MOTIF_AUTO_MAP}
    state = random_motif_checkpoint(cfg, seed=seed, dtype=dtype)
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    return cfg, state

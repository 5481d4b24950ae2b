"""`model.init_from: DIR`: a `jdp train` GPT that starts from a Hugging Face GPT-2 checkpoint.

The architecture comes from DIR/config.json (`jdp.models.hub.gpt2_in.read_architecture`), so a config needs
no model sizes: model.d_model, n_heads and n_layers are filled in from it, and a value the config
sets that contradicts config.json is refused, naming both. model.context is the training window:
at most n_positions, n_positions where it is left out (the model keeps all its position
embeddings either way, so what it exports is the checkpoint's shape). model.dropout, attention,
remat and scan_layers stay the config's: how the model trains, not what it is. The run reads
token files (data.name tokens) whose ids the checkpoint's vocabulary holds.
"""
from __future__ import annotations

from collections.abc import Mapping

from jdp.run.sections import ConfigError
from jdp.text import quoted

# jdp's size fields and the config.json keys that set them.
SIZES = (("d_model", "n_embd"), ("n_heads", "n_head"), ("n_layers", "n_layer"))


def _architecture(path: str):
    from jdp.models.hub.gpt2_in import read_architecture  # jax and flax: imported only for a config that starts from one

    try:
        return read_architecture(path)
    except ValueError as e:
        raise ConfigError(f"model.init_from: {e}") from None


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def init_from_values(values: Mapping) -> Mapping:
    """The model section's values (as written) with model.init_from's sizes applied; unchanged without it.
    ConfigError in one sentence for a size that contradicts its config.json, or another model.name."""
    path = values.get("init_from")
    if not isinstance(path, str) or not path:
        return values  # absent, or a bad value the section's own rule names
    name = values.get("name", "gpt")
    if name != "gpt":
        raise ConfigError(f"model.init_from starts a GPT from a Hugging Face GPT-2 checkpoint and needs model.name "
                          f"'gpt', got {name!r}.")
    arch = _architecture(path)
    resolved = dict(values, name="gpt")
    for key, hf_key in SIZES:
        written, value = values.get(key), getattr(arch, key)
        if _is_int(written) and written != value:
            raise ConfigError(f"model.{key}={written} contradicts model.init_from={quoted(path)}, whose config.json "
                              f"has {hf_key}={value}; leave model.{key} out (the checkpoint sets it).")
        resolved.setdefault(key, value)
    context = values.get("context")
    if _is_int(context) and context > arch.context:
        raise ConfigError(f"model.context={context} (the training window) is longer than model.init_from="
                          f"{quoted(path)} holds positions for (config.json's n_positions={arch.context}); use at "
                          f"most {arch.context}.")
    resolved.setdefault("context", arch.context)
    return resolved


def check_init_from(config) -> None:
    """The data a model.init_from run trains on: token files (data.name tokens) whose ids its vocabulary holds."""
    m, d = config.model, config.data
    if m.init_from is None:
        return
    if d.name != "tokens":
        raise ConfigError(f"model.init_from (a Hugging Face GPT-2 checkpoint) trains on token files made with its "
                          f"tokenizer: it needs data.name 'tokens', got {d.name!r}.")
    vocab = _architecture(m.init_from).vocab_size
    if d.vocab_size is not None and d.vocab_size > vocab:
        raise ConfigError(f"data.vocab_size={d.vocab_size} is more than model.init_from={quoted(m.init_from)}'s "
                          f"vocab_size={vocab} (config.json): an id of {vocab} or more has no embedding there; make "
                          f"the token files with its tokenizer (jdp data prepare-tokens INPUT OUTPUT --tokenizer "
                          f"{m.init_from}/tokenizer.json).")

"""Flax's NNX language-model example, `examples/gemma` at google/flax commit 18f8f311 (2026-07-02), as written.

Every other file in this folder is a byte-for-byte copy of that commit's file of the same name
(`git show 18f8f311:examples/gemma/<name>`), Apache 2.0 headers kept, `LICENSE` the repository's:
train.py (its train steps and loss), transformer.py, transformer_cfg.py, modules.py, layers.py,
positional_embeddings.py, params.py, helpers.py, sow_lib.py (the model), and train_cfg.py,
input_pipeline.py, sampler.py, tokenizer.py (which train.py imports for its training loop). Left out:
the configs, the README, the tests, and the tf/grain input pipelines' modules, which need tensorflow.
The files import each other by bare name (`import modules`) as the example's folder does; `load`
imports them that way and hands back the modules without leaving those bare names (`helpers`,
`params`, `train`) where they would shadow others. Two packages the example needs beyond jdp's:
jaxtyping (its type annotations) and sentencepiece (sampler.py and tokenizer.py import it). clu,
whose metric writers need tensorflow, is stood in for by an empty module while train.py is
imported: only its training loop (`train_and_evaluate`, not run here) uses it.
"""
import importlib
import os
import sys
import types

HERE = os.path.dirname(os.path.abspath(__file__))
COMMIT = "18f8f311c275d57f46d95e41b15aa97b454754c0"
MODULES = ("train_cfg", "params", "transformer_cfg", "positional_embeddings", "layers", "sow_lib", "modules",
           "helpers", "transformer", "input_pipeline", "tokenizer", "sampler", "train")
STAND_INS = ("clu", "clu.metric_writers", "clu.periodic_actions")


def load() -> types.SimpleNamespace:
    """The example's modules (`.train`, `.transformer`, ...), imported once by their bare names."""
    if hasattr(load, "modules"):
        return load.modules
    names = MODULES + STAND_INS
    saved = {name: sys.modules.pop(name) for name in names if name in sys.modules}
    for name in STAND_INS:
        sys.modules[name] = types.ModuleType(name)
    sys.modules["clu"].metric_writers = sys.modules["clu.metric_writers"]
    sys.modules["clu"].periodic_actions = sys.modules["clu.periodic_actions"]
    sys.path.insert(0, HERE)
    try:
        loaded = {name: importlib.import_module(name) for name in MODULES}
    finally:
        sys.path.remove(HERE)
        for name in names:
            sys.modules.pop(name, None)
        sys.modules.update(saved)
    load.modules = types.SimpleNamespace(**loaded)
    return load.modules

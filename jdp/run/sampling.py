"""`jdp sample WORKDIR`: continuations of prompts from a GPT run's newest intact checkpoint.

The run's config is the one its checkpoint saved; the model is the GPT `jdp train` built for it
(scanned or not, as it trained), and the state is read into a one-device step: checkpoints are
canonical, so a run trained replicated, with ZeRO-1 or with FSDP reads back alike. The text goes
through the run's own tokenizer: the character corpus's for `data.name: chars`, the token files'
(`jdp.data.tokenizer.load_tokenizer` on data.path's folder) for `data.name: tokens`.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass

import jax
from flax import nnx

from jdp.models import functional
from jdp.run.checkpoint import Checkpointer
from jdp.run.checkpoint_reading import quiet_orbax
from jdp.run.config import apply_overrides, config_from_dict
from jdp.run.tasks import gpt_for, language_model, train_step_for
from jdp.text import quoted

# The layout a checkpoint is read into: one device, replicated (every layout saves the same canonical state).
ONE_DEVICE = ("parallel.shard_optimizer_state=false", "parallel.shard_params=false", "parallel.replicas=1")


@dataclass(frozen=True)
class Run:
    """A trained GPT run, ready to continue text: its model (eval mode), tokenizer, config and checkpoint."""

    model: nnx.Module  # the jdp.models.GPT with the checkpoint's params
    tokenizer: object  # encode(text) -> ids, decode(ids) -> text
    config: object  # the run's jdp.config.Config, as its checkpoint saved it
    step: int  # the checkpoint's optimizer step


def run_tokenizer(config):
    """The tokenizer of a `data.name: chars | tokens` config's data, and its vocabulary size for the model."""
    if config.data.name == "chars":
        from jdp.data import load_char_corpus

        corpus = load_char_corpus()
        return corpus, corpus.vocab_size
    from jdp.data.tokenizer import load_tokenizer

    return load_tokenizer(os.path.dirname(os.path.abspath(config.data.path))), config.data.vocab_size


def load_run(workdir: str, log=print, command: str = "jdp sample continues text with") -> Run:
    """The GPT of `workdir`'s newest intact checkpoint (a damaged one is said with `log`, skipped and
    left as it is; nothing in `workdir` is written). ValueError, in one sentence, for a workdir
    without a checkpoint or whose run is not a GPT on text (`command`: what the caller does with one,
    for that sentence)."""
    directory = os.path.join(workdir, "checkpoints")
    if not os.path.isdir(directory):
        raise ValueError(f"{quoted(workdir)} holds no checkpoint ({quoted(directory)} does not exist); train a GPT "
                         f"there first (jdp train char_gpt --workdir {workdir}).")
    built = {}

    def step_for(saved: dict | None):
        if saved is None:
            raise ValueError(f"the checkpoints in {quoted(directory)} hold no config (a jdp before 0.1 wrote them); "
                             f"jdp sample reads the run's config from its checkpoint.")
        config = config_from_dict(saved, source=f"the config saved in {directory}")
        m, d = config.model, config.data
        if m.name != "gpt" or d.name not in ("chars", "tokens"):
            raise ValueError(f"{quoted(workdir)} holds a run of model.name {m.name!r} on data.name {d.name!r}; "
                             f"{command} a GPT run (model.name gpt on data.name chars or tokens).")
        tokenizer, vocab = run_tokenizer(config)
        fm = functional(gpt_for(config, vocab))
        task = language_model(fm, "", None, None)
        step = train_step_for(apply_overrides(config, ONE_DEVICE), task, jax.devices()[:1])
        built.update(config=config, tokenizer=tokenizer, fm=fm)
        return step, step.init(task.params, task.model_state, seed=config.train.seed)

    with quiet_orbax([]):  # orbax reads each step's metadata as it opens: a damaged one is said by newest_intact
        checkpoints = Checkpointer(directory)
    try:
        state, _, number = checkpoints.newest_intact(step_for, log)
    finally:
        checkpoints.close(wait=False)  # it saved nothing: no rotation
    fm = built["fm"]
    model = nnx.merge(fm.graphdef, jax.device_get(state.params), jax.device_get(state.model_state))
    return Run(model, built["tokenizer"], built["config"], number)


@dataclass(frozen=True)
class Samples:
    """What `sample` made: each prompt's continuation (text), and how fast."""

    texts: list  # one str per prompt: the new text only
    tokens: int  # new tokens per prompt
    seconds: float  # decoding time, the compilation left out
    compile_seconds: float

    @property
    def tokens_per_s(self) -> float:
        """New tokens per second over all prompts (batch × tokens / seconds)."""
        return len(self.texts) * self.tokens / self.seconds


def sample(run: Run, prompts: list[str], tokens: int | None = None, *, temperature: float = 1.0,
           top_k: int | None = None, top_p: float | None = None, seed: int = 0) -> Samples:
    """Continue `prompts` (texts, batched) with `run`'s model: `tokens` new tokens each (None: as many as the
    context leaves after the longest prompt), decoded with the run's tokenizer. ValueError (one sentence)
    for an empty prompt, one with text the tokenizer cannot encode or ids outside the vocabulary, one too
    long for the context, or bad sampling values (`jdp.models.generate`'s)."""
    from jdp.models.decode import compiled_generate

    ids = []
    for i, text in enumerate(prompts):
        if not text:
            raise ValueError(f"prompt {i + 1} is empty; a prompt needs at least one token (leave --prompt out for "
                             f"the default, a newline).")
        ids.append([int(t) for t in run.tokenizer.encode(text)])
    context = run.model.context
    if tokens is None:
        longest = max(len(row) for row in ids)
        if longest > context:
            raise ValueError(f"a prompt of {longest} tokens is longer than the model's context of {context}; "
                             f"shorten it.")
        tokens = context - longest + 1
    t0 = time.perf_counter()
    decode = compiled_generate(run.model, ids, tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                               key=jax.random.key(seed))
    t1 = time.perf_counter()
    out = decode()
    seconds = time.perf_counter() - t1
    return Samples([run.tokenizer.decode(row) for row in out], tokens, seconds, t1 - t0)


__all__ = ["ONE_DEVICE", "Run", "Samples", "load_run", "run_tokenizer", "sample"]

"""`jdp export WORKDIR OUT`: a GPT run's newest intact checkpoint as a Hugging Face GPT-2 directory.

The model is the one `jdp sample` reads (`jdp.run.sampling.load_run`: the run's own config and GPT,
replicated, ZeRO-1 or FSDP, scanned or not), written by `jdp.models.save_hf`: config.json and
model.safetensors, which `transformers.GPT2LMHeadModel.from_pretrained(OUT)` loads with the same
logits. The run's tokenizer goes beside them where it is a tokenizer.json: a token folder prepared
with `--tokenizer bpe:VOCAB` or `--tokenizer PATH/tokenizer.json` (its meta.json says so). Byte
tokens and the character corpus have no tokenizer.json, and the export says so. Nothing in WORKDIR
is written, and OUT must be new or an empty directory.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from jdp.data.tokenizer import TOKENIZER_FILE, read_metadata
from jdp.text import quoted


@dataclass(frozen=True)
class Exported:
    """What `export_run` wrote: the directory, the checkpoint's step, and the tokenizer copied (or None)."""

    out: str
    step: int
    tokenizer: str | None  # the tokenizer.json copied beside the model, or None
    why_no_tokenizer: str | None  # for None: which tokenizer the run has instead


def run_tokenizer_file(config) -> tuple[str | None, str | None]:
    """The tokenizer.json of a GPT run's data (`data.name: tokens` from a prepared folder whose
    meta.json names one), or None and what the run tokenizes with instead."""
    if config.data.name != "tokens":
        return None, "the character corpus's own symbols (data.name chars)"
    folder = os.path.dirname(os.path.abspath(config.data.path))
    meta = read_metadata(folder)
    if meta is None or meta["tokenizer"]["kind"] == "bytes":
        return None, "byte tokens (one id per UTF-8 byte)"
    return os.path.join(folder, meta["tokenizer"]["file"] or TOKENIZER_FILE), None


def export_run(workdir: str, out: str, log=print) -> Exported:
    """Write `workdir`'s newest intact GPT checkpoint to the Hugging Face GPT-2 directory `out`.

    ValueError (one sentence) for a workdir without a checkpoint or whose run is not a GPT on text,
    or an `out` that exists and is not an empty directory (checked first: nothing is read or written
    then). A damaged newest checkpoint is said with `log` and skipped, as `jdp sample` does."""
    from jdp.models.hub import save_hf
    from jdp.models.hub.folder import check_output
    from jdp.run.sampling import load_run

    check_output(os.path.abspath(out))
    run = load_run(workdir, log, command="jdp export writes")
    tokenizer, why = run_tokenizer_file(run.config)
    path = save_hf(run.model, out, tokenizer_file=tokenizer)
    return Exported(path, run.step, tokenizer, why)


def export_lines(done: Exported, workdir: str) -> list[str]:
    """What `jdp export` prints: where the model went and what it holds."""
    lines = [f"exported checkpoint {done.step} of {workdir} to {done.out} (config.json, model.safetensors"
             f"{', tokenizer.json' if done.tokenizer else ''}): transformers loads it with "
             f"GPT2LMHeadModel.from_pretrained({quoted(done.out)})"]
    if done.tokenizer is None:
        lines.append(f"no tokenizer.json beside it: the run tokenizes with {done.why_no_tokenizer}")
    return lines


__all__ = ["Exported", "export_lines", "export_run", "run_tokenizer_file"]

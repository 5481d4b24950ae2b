"""A Hugging Face model folder, as `save_pretrained` writes it: what every architecture's reader and writer share.

Reading: config.json (`read_config`), the safetensors weights (`model.safetensors`, or the shards that
`model.safetensors.index.json` names; `weight_files`), each tensor read once, on its own
(`checkpoint_tensors`), so a reader holds the params it has made and one tensor in transit, never a
second copy of the whole checkpoint. Weights in other formats (`pytorch_model.bin`, ...) are refused:
reading them means unpickling, which runs code from the file.

Writing (`write_folder`): nothing is overwritten. OUT must be absent or an empty directory (and not a
link); the files are written into a new hidden sibling directory, flushed, and renamed to OUT in one step.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from typing import Callable, Iterator

import numpy as np

from jdp.models.hub.safetensors_io import tensors as file_tensors
from jdp.text import quoted

CONFIG, WEIGHTS, INDEX, TOKENIZER = "config.json", "model.safetensors", "model.safetensors.index.json", "tokenizer.json"
OTHER_WEIGHTS = ("pytorch_model.bin", "pytorch_model.bin.index.json", "tf_model.h5", "flax_model.msgpack")


def read_config(path: str) -> dict:
    """`path`/config.json as a dict; ValueError (one sentence) where `path` is not a directory or its
    config.json is missing or not a JSON object."""
    if not os.path.isdir(path):
        raise ValueError(f"{quoted(path)} is not a directory; give the folder a Hugging Face model was saved to "
                         f"(save_pretrained), which holds config.json and model.safetensors.")
    file = os.path.join(path, CONFIG)
    if not os.path.isfile(file):
        raise ValueError(f"{quoted(path)} is not a Hugging Face model folder: it has no config.json.")
    try:
        with open(file, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{quoted(path)} is not a Hugging Face model folder: its config.json cannot be read as "
                         f"JSON ({e}).") from None
    if not isinstance(config, dict):
        raise ValueError(f"{quoted(path)} is not a Hugging Face model folder: its config.json is not a JSON object.")
    return config


def weight_files(path: str, convert_with: str = "AutoModelForCausalLM") -> list[str]:
    """The safetensors files of `path`: model.safetensors, or the shards its index names. ValueError naming
    the conversion (`convert_with`.from_pretrained(DIR).save_pretrained(NEW_DIR)) for other formats."""
    single, index = os.path.join(path, WEIGHTS), os.path.join(path, INDEX)
    if os.path.isfile(single):
        return [single]
    if os.path.isfile(index):
        try:
            with open(index, encoding="utf-8") as f:
                weight_map = json.load(f).get("weight_map")
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError) as e:
            raise ValueError(f"{quoted(index)} cannot be read as a safetensors index ({e}).") from None
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{quoted(index)} has no weight_map naming the shards.")
        files = [os.path.join(path, name) for name in sorted(set(weight_map.values()))]
        missing = [f for f in files if not os.path.isfile(f)]
        if missing:
            raise ValueError(f"{quoted(index)} names the shard {quoted(missing[0])}, which is not there.")
        return files
    others = [name for name in OTHER_WEIGHTS if os.path.exists(os.path.join(path, name))]
    if others:
        raise ValueError(f"{quoted(path)} holds its weights as {others[0]}, and jdp reads safetensors only (the other "
                         f"formats unpickle code); convert it with transformers: {convert_with}.from_pretrained(DIR)"
                         f".save_pretrained(NEW_DIR) writes model.safetensors.")
    raise ValueError(f"{quoted(path)} has config.json but no {WEIGHTS} (nor {INDEX}).")


def checkpoint_tensors(path: str, convert_with: str = "AutoModelForCausalLM") -> Iterator[tuple[str, np.ndarray]]:
    """(name, array) for every tensor of `path`'s safetensors files, one at a time: each array is a
    read-only view of the file's bytes in its own dtype (nothing is copied until the caller converts it)."""
    for file in weight_files(path, convert_with):
        yield from file_tensors(file)


def check_output(out: str) -> None:
    """ValueError (one sentence) unless `out` is free to write: absent, or an empty directory that is not a
    symbolic link (a link's target would be written, and jdp writes only where it is told)."""
    if os.path.islink(out):
        raise ValueError(f"{quoted(out)} is a symbolic link (to {quoted(os.readlink(out))}); jdp writes only where it "
                         f"is told and overwrites nothing: name a new directory or an empty one that is not a link.")
    if os.path.isdir(out) and os.listdir(out):
        raise ValueError(f"{quoted(out)} is a directory that is not empty; jdp overwrites nothing: name a new or "
                         f"empty one.")
    if os.path.exists(out) and not os.path.isdir(out):
        raise ValueError(f"{quoted(out)} is a file; jdp overwrites nothing: name a new or empty directory.")


def write_folder(out: str | os.PathLike, write: Callable[[str], None]) -> str:
    """Make the directory `out` (absolute path returned) holding what `write(staging)` puts in a new hidden
    sibling directory, renamed to `out` in one step. ValueError (`check_output`) before anything is written
    for an `out` that is taken, and again, with nothing left behind, if it was taken while writing."""
    out = os.path.abspath(os.fspath(out))
    check_output(out)
    parent = os.path.dirname(out)
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.", dir=parent)
    try:
        write(staging)
        os.chmod(staging, 0o755)  # mkdtemp's 0o700 would hide the export from other users
        check_output(out)  # again: something may have appeared while we wrote
        os.rename(staging, out)  # replaces only an empty directory, atomically
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out


def write_json(path: str, value: dict) -> None:
    """`value` as indented JSON in the new file `path` (never overwritten)."""
    with open(path, "x", encoding="utf-8") as f:
        json.dump(value, f, indent=2)
        f.write("\n")


def copy_tokenizer(tokenizer_file: str | None, staging: str) -> None:
    """A copy of `tokenizer_file` (a tokenizer.json) as staging/tokenizer.json; nothing for None."""
    if tokenizer_file is not None:
        shutil.copyfile(tokenizer_file, os.path.join(staging, TOKENIZER))


def check_tokenizer_file(tokenizer_file: str | None) -> None:
    """ValueError unless `tokenizer_file` is None or a file."""
    if tokenizer_file is not None and not os.path.isfile(tokenizer_file):
        raise ValueError(f"tokenizer_file={quoted(tokenizer_file)} is not a file; give a tokenizer.json or None.")


__all__ = ["CONFIG", "INDEX", "OTHER_WEIGHTS", "TOKENIZER", "WEIGHTS", "check_output", "check_tokenizer_file",
           "checkpoint_tensors", "copy_tokenizer", "read_config", "weight_files", "write_folder", "write_json"]

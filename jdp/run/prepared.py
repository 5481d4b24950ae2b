"""A `data.name: tokens` config whose data.path names a folder prepared by `jdp data prepare-tokens`.

The folder's meta.json (`jdp.data.tokenizer`) says the vocabulary size and the dtype of its token
files, so the config takes them from there: data.vocab_size and data.dtype may be left out, and a
config that sets another value than the files hold is refused, naming both. data.path may name
the folder itself (then its train.bin, and its val.bin unless data.val_path is set) or a token
file in it. A token file without meta.json beside it is read as the config says, as before.
"""
from __future__ import annotations

import os
from collections.abc import Mapping

from jdp.data.tokenizer import read_metadata
from jdp.run.sections import ConfigError
from jdp.text import quoted


def prepared_data(values: Mapping) -> Mapping:
    """The data section's values (as written) with a prepared folder's vocab_size and dtype applied;
    ConfigError in one sentence for a value that disagrees with its meta.json."""
    path = values.get("path")
    if values.get("name") != "tokens" or not isinstance(path, str) or not os.path.exists(path):
        return values
    folder = path if os.path.isdir(path) else os.path.dirname(path) or "."
    try:
        meta = read_metadata(folder)
    except ValueError as e:
        raise ConfigError(f"data.path={quoted(path)}: {e}") from None
    if meta is None:
        if os.path.isdir(path):
            train = os.path.join(path, "train.bin")
            inside = f", data.path={quoted(train)}," if os.path.isfile(train) else ""
            raise ConfigError(f"data.path={quoted(path)} is a folder without meta.json; name its token file{inside} (and "
                              f"set data.vocab_size), or prepare the folder with jdp data prepare-tokens.")
        return values
    resolved = dict(values)
    for key in ("vocab_size", "dtype"):
        written = values.get(key)
        if written is not None and written != meta[key]:
            raise ConfigError(f"data.{key}={written!r} disagrees with the tokens prepared in {quoted(folder)}, whose "
                              f"meta.json says {key} {meta[key]!r}; leave data.{key} out of the config to take it "
                              f"from there.")
        resolved[key] = meta[key]
    if os.path.isdir(path):
        resolved["path"] = os.path.join(path, "train.bin")
        if values.get("val_path") is None:
            resolved["val_path"] = os.path.join(path, "val.bin")
    return resolved


__all__ = ["prepared_data"]

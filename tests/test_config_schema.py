"""`jdp config schema`: a JSON Schema (draft 2020-12) that accepts every shipped config, refuses
unknown keys and wrong types, and agrees with the sections' own checks field by field."""
import json
import pathlib
from dataclasses import MISSING, fields

import jsonschema
import pytest

import jdp.run.cli
from jdp.run.config_schema import config_schema
from jdp.run.config_sections import SECTIONS
from jdp.run.sections import ConfigError, read_yaml

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))
SCHEMA = config_schema()
VALIDATOR = jsonschema.Draft202012Validator(SCHEMA)


def test_it_is_a_draft_2020_12_schema_of_every_section_and_field():
    jsonschema.Draft202012Validator.check_schema(SCHEMA)
    jsonschema.Draft7Validator.check_schema(SCHEMA)
    assert SCHEMA["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    assert SCHEMA["additionalProperties"] is False and list(SCHEMA["properties"]) == list(SECTIONS)
    for name, cls in SECTIONS.items():
        section = SCHEMA["properties"][name]
        assert section["additionalProperties"] is False and list(section["properties"]) == [f.name for f in fields(cls)]
        for f in fields(cls):
            prop = section["properties"][f.name]
            default = f.default_factory() if f.default is MISSING else f.default
            assert prop["default"] == (list(default) if isinstance(default, tuple) else default), (name, f.name)
            assert VALIDATOR.is_valid({name: {f.name: prop["default"]}}), (name, f.name)
            assert len(prop["description"]) > len("Must be ."), (name, f.name)  # the docstring is there
    assert SCHEMA["properties"]["optim"]["properties"]["name"]["enum"] == ["sgd", "momentum", "adam", "adamw"]


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_every_shipped_config_is_valid(path):
    errors = [f"{'.'.join(map(str, e.path))}: {e.message}" for e in VALIDATOR.iter_errors(read_yaml(str(path)))]
    assert not errors, errors


@pytest.mark.parametrize("config, where", [
    ({"optim": {"learning_rate": 0.1}}, "optim"),          # an unknown key
    ({"optimizer": {"lr": 0.1}}, ""),                      # an unknown section
    ({"optim": {"lr": "fast"}}, "optim.lr"),               # wrong types
    ({"train": {"steps": "300"}}, "train.steps"),
    ({"model": {"hidden": 128}}, "model.hidden"),
    ({"parallel": {"devices": True}}, "parallel.devices"),
    ({"optim": {"name": "lamb"}}, "optim.name"),           # not an allowed value
    ({"model": {"channels": [8, 16, 32]}}, "model.channels"),
    ({"train": {"steps": 2**31}}, "train.steps"),
    ({"data": {"path": ""}}, "data.path"),                # any file path, but not an empty one
    ({"model": []}, "model"),
])
def test_unknown_keys_and_wrong_types_are_refused(config, where):
    errors = list(VALIDATOR.iter_errors(config))
    assert errors and {".".join(map(str, e.absolute_path)) for e in errors} == {where}, errors
    # draft-07 keywords only: editors that implement draft-07 (not 2020-12) judge the same
    assert not jsonschema.Draft7Validator(SCHEMA).is_valid(config)
    assert jsonschema.Draft7Validator(SCHEMA).is_valid({"optim": {"lr": 0.1}})


PROBES = (None, True, False, 0, 1, 2, 3, -1, 0.5, 1.5, 2**31 - 1, 2**31, 2**63, "3e-4", "abc", "a.npz", "a.NPZ",
          "a.txt", [], [1], [0], [1, 2], [1, 2, 3], [True], "float32", "bf16", "fp16", {"a": 1})


def _section_accepts(cls, key, value) -> bool:
    try:
        cls(**{key: value})
    except ConfigError:
        return False
    return True


@pytest.mark.parametrize("section", list(SECTIONS))
def test_the_schema_and_the_section_agree_on_every_field(section):
    """Each probe value, and each value the schema lists, is accepted by the schema exactly when
    the section accepts it: a rule whose `schema` drifts from its check fails here, for new fields too."""
    cls = SECTIONS[section]
    disagree = []
    for f in fields(cls):
        enum = SCHEMA["properties"][section]["properties"][f.name].get("enum", [])
        for value in (*PROBES, *enum):
            by_schema = VALIDATOR.is_valid({section: {f.name: value}})
            if by_schema != _section_accepts(cls, f.name, value):
                disagree.append(f"{section}.{f.name}={value!r}: schema {'accepts' if by_schema else 'refuses'}")
    assert not disagree, disagree


def test_cli_prints_the_schema(capsys):
    assert jdp.run.cli.main(["config", "schema"]) == 0
    assert json.loads(capsys.readouterr().out) == SCHEMA

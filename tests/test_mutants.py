"""The mutation check's list stays in step with the code: every snippet occurs exactly once.

`python -m tests.mutants` runs the mutants (minutes); this only checks that each one still
applies, so a refactor that moves a line makes a mutant fail loudly here instead of going stale.
JDP_MUTANTS_SOURCE names another copy of the package to check (as `--jdp` does for the runner).
"""
import os
import pathlib

import pytest

from tests.mutants import MUTANTS

ROOT = pathlib.Path(__file__).parents[1]
SOURCE = pathlib.Path(os.environ.get("JDP_MUTANTS_SOURCE", ROOT / "jdp"))


@pytest.mark.parametrize("mutant", MUTANTS, ids=lambda m: m.name)
def test_snippet_occurs_exactly_once(mutant):
    found = (SOURCE / mutant.file).read_text(encoding="utf-8").count(mutant.old)
    assert found == 1, f"{mutant.name}: {mutant.old!r} occurs {found} times in jdp/{mutant.file}; re-target the mutant"
    assert mutant.new != mutant.old


def test_names_are_unique_and_selections_exist():
    assert len({m.name for m in MUTANTS}) == len(MUTANTS)
    for m in MUTANTS:
        assert m.tests, m.name
        for selection in m.tests:
            if selection.startswith("tests/"):  # a file or node id; "-k" and its expression pass through
                assert (ROOT / selection.split("::")[0]).is_file(), (m.name, selection)


def test_each_mutant_meets_the_quick_tier_first_then_its_selection():
    from tests.mutants import Mutant, stages

    m = Mutant("m", "core/step.py", "a", "b", ("tests/test_zero.py", "-k", "sgd and not adam", "tests/test_fsdp.py::t"))
    quick = ("quick", ("-m", "quick", "tests/test_zero.py", "tests/test_fsdp.py::t"))  # the -k dropped
    assert stages(m, "quick") == [quick, ("full", m.tests)]
    assert stages(m, "whole-quick") == [quick, ("quick", ("-m", "quick", "tests")), ("full", m.tests)]
    assert stages(m, "selection") == [("full", m.tests)]

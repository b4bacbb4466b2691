"""docs/spec.md, the specification that error messages and docstrings cite, ships with the
repository: every "docs/spec.md section N" names a section it has, the modules that write
the refusals cite it rather than the unshipped SPEC, and each "our choice" it leaves open
names the option that sets it, with the default the code has."""

import ast
import dataclasses
import pathlib
import re

import pytest
import torch

import depthrewrite
from depthrewrite import NotPreNormError
from tests.toy_models import ToyLM

ROOT = pathlib.Path(__file__).resolve().parents[2]
SPEC = ROOT / "docs" / "spec.md"
PACKAGE = ROOT / "depthrewrite"
#: every file that may cite the spec: the package, the README, the examples and the docs
CITING_SOURCES = [ROOT / "README.md", *sorted(PACKAGE.rglob("*.py")), *sorted((ROOT / "examples").glob("*.py")),
                  *sorted(p for p in (ROOT / "docs").glob("*.md") if p.name != "spec.md")]


def spec_sections() -> dict[str, str]:
    """Section number -> its text ('0' for the header before section 1)."""
    parts = re.split(r"^## (\d+)\. ", SPEC.read_text(), flags=re.M)
    return {"0": parts[0], **dict(zip(parts[1::2], parts[2::2]))}


def test_spec_has_every_section_cited():
    sections = spec_sections()
    cited = {(path.relative_to(ROOT), n) for path in [*PACKAGE.rglob("*.py"), ROOT / "README.md"]
             for n in re.findall(r"docs/spec\.md sections? (\d+)", path.read_text())}
    assert cited, "nothing cites docs/spec.md"
    assert [c for c in cited if c[1] not in sections] == []
    assert set(sections) >= {str(n) for n in range(1, 10)}


@pytest.mark.parametrize("path", CITING_SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_citations_are_of_the_shipped_spec(path):
    assert re.findall(r".*\bSPEC\b(?!S).*", path.read_text()) == []


def test_a_refusal_points_at_the_spec_section_it_breaks():
    with pytest.raises(NotPreNormError) as err:
        depthrewrite.inspect(ToyLM(shape="no_norm"), example_inputs=(torch.zeros(1, 4, dtype=torch.long),))
    assert "see docs/spec.md section 1" in str(err.value)
    assert "PreNorm" in spec_sections()["1"]


@pytest.mark.parametrize("number, text", [(n, t) for n, t in spec_sections().items() if "our choice" in t.lower()])
def test_each_our_choice_names_its_option_and_the_code_default(number, text):
    notes = re.findall(r"option `(\w+)` of `(\w+)` \(default `([^`]+)`", text)
    assert notes, f"section {number} leaves a choice open without naming the option that sets it"
    for option, scheme, default in notes:
        fields = {f.name: f for f in dataclasses.fields(depthrewrite.SCHEMES[scheme].Options)}
        assert option in fields, f"{scheme} has no option {option!r}"
        assert fields[option].default == ast.literal_eval(default), (scheme, option)

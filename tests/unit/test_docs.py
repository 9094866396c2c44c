"""The docs against the code: config references whose keys and defaults are the models', links that
resolve, and citations of docs/DESIGN.md that name a section it has."""

from __future__ import annotations

import enum
import re
import types
import typing
from pathlib import Path

import pytest
from pydantic import BaseModel, ValidationError
from pydantic_core import PydanticUndefined

from tests.conftest import REPO

DOCS = REPO / "docs"
CONFIG_REFERENCE = DOCS / "config-reference.md"
TRAINER_REFERENCE = DOCS / "trainer.md"
TABLE_HEADER = "| key | default | description |"
# A default cell: one of these, then optionally a note in parentheses.
DEFAULT_CELL = re.compile(r"^(?P<value>required|none|see below|`[^`]*`)(?: \((?P<note>.+)\))?$")


# --- the models ---------------------------------------------------------------------------------

def _nested(annotation) -> tuple[type[BaseModel] | None, bool]:
    """The model inside ``Model``, ``Model | None``, ``list[Model]`` or ``Annotated[...]``, and whether it is a list."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation, False
    origin = typing.get_origin(annotation)
    if origin in (list, typing.Union, types.UnionType, typing.Annotated):
        for arg in typing.get_args(annotation):
            model, is_list = _nested(arg)
            if model is not None:
                return model, is_list or origin is list
    return None, False


def model_fields(model: type[BaseModel], prefix: str = ""):
    """(path, effective default, is a section) for every field, depth first. ``[]`` marks list items.

    The effective default is what a model built from nothing holds, so defaults that a validator
    fills in (fsx.throughput_per_tib: 250 for PERSISTENT_2) count; a model with required fields
    falls back to the declared defaults.
    """
    try:
        built = model()
    except ValidationError:
        built = None
    for name, field in model.model_fields.items():
        if built is not None:
            default = getattr(built, name)
        elif field.is_required():
            default = PydanticUndefined
        else:
            default = field.get_default(call_default_factory=True)
        nested, is_list = _nested(field.annotation)
        yield prefix + name, default, nested is not None
        if nested is not None:
            yield from model_fields(nested, f"{prefix}{name}{'[]' if is_list else ''}.")


def _literal(value) -> str:
    if isinstance(value, enum.Enum):
        value = value.value
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_literal(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_literal(v)}" for k, v in value.items()) + "}"
    return repr(value) if isinstance(value, float) else str(value)


def render_default(value) -> str:
    """How the references write a default."""
    if value is PydanticUndefined:
        return "required"
    if value is None:
        return "none"
    if isinstance(value, BaseModel):
        return "see below"
    return f"`{_literal(value)}`"


# --- the docs -----------------------------------------------------------------------------------

def _without_code_blocks(text: str) -> str:
    return re.sub(r"^```.*?^```[ \t]*$", "", text, flags=re.S | re.M)


def reference_rows(path: Path) -> dict[str, tuple[str, str | None]]:
    """key path -> (documented default, note) from every ``| key | default | description |`` table.

    A heading ``## `fsx` `` makes its rows' keys ``fsx.<key>``; ``## `accelerated_node_groups[]` ``
    makes them ``accelerated_node_groups[].<key>``; any other heading adds nothing.
    """
    rows: dict[str, tuple[str, str | None]] = {}
    prefix, in_table = "", False
    for line in _without_code_blocks(path.read_text()).splitlines():
        heading = re.match(r"^#{1,6} (.*)$", line)
        if heading:
            named = re.fullmatch(r"`([\w.\[\]]+)`", heading.group(1).strip())
            prefix, in_table = (named.group(1) + "." if named else ""), False
            continue
        if line.strip() == TABLE_HEADER:
            in_table = True
            continue
        if not in_table or not line.startswith("|") or set(line) <= set("|- "):
            in_table = in_table and line.startswith("|")
            continue
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        key = re.fullmatch(r"`([\w.\[\]]+)`", cells[0])
        assert key, f"{path.name}: a row without a `key`: {line}"
        found = DEFAULT_CELL.match(cells[1])
        assert found, f"{path.name}: {key.group(1)}: default {cells[1]!r} is not required, none, see below or a `literal`"
        full = prefix + key.group(1)
        assert full not in rows, f"{path.name}: {full} is documented twice"
        rows[full] = (found.group("value"), found.group("note"))
    return rows


def check_reference(path: Path, model: type[BaseModel]) -> list[str]:
    documented = reference_rows(path)
    problems = []
    fields = list(model_fields(model))
    for key, default, is_section in fields:
        if key not in documented:
            children = any(other.startswith((key + ".", key + "[].")) for other in documented)
            if not (is_section and children):
                problems.append(f"{key}: not documented")
            continue
        written, expected = documented[key][0], render_default(default)
        if written != expected:
            problems.append(f"{key}: the doc says {written}, the model's default is {expected}")
    known = {key for key, _, _ in fields}
    problems += [f"{key}: documented, but no such field" for key in documented if key not in known]
    return problems


def test_the_platform_config_reference_documents_every_field_with_its_default():
    from config import PlatformConfig

    assert check_reference(CONFIG_REFERENCE, PlatformConfig) == []


def test_the_trainer_config_reference_documents_every_field_with_its_default():
    from training.config import TrainConfig

    assert check_reference(TRAINER_REFERENCE, TrainConfig) == []


def test_the_check_catches_a_changed_default(tmp_path):
    from config import PlatformConfig

    changed = tmp_path / "config-reference.md"
    changed.write_text(CONFIG_REFERENCE.read_text().replace("| `storage_capacity_gib` | `1200` |",
                                                            "| `storage_capacity_gib` | `2400` |"))
    assert check_reference(changed, PlatformConfig) == [
        "fsx.storage_capacity_gib: the doc says `2400`, the model's default is `1200`"]


def test_the_scratch_defaults_in_the_notes_are_the_models():
    from config.storage import FsxConfig

    scratch = FsxConfig(deployment_type="SCRATCH_2")
    rows = reference_rows(CONFIG_REFERENCE)
    for field in ("throughput_per_tib", "automatic_backup_retention_days"):
        note = rows[f"fsx.{field}"][1]
        assert note == f"{render_default(getattr(scratch, field))} for `SCRATCH_2`", field


def test_the_derived_autoscaler_charts_are_the_pinned_ones():
    from config.versions import CLUSTER_AUTOSCALER_CHARTS

    text = CONFIG_REFERENCE.read_text()
    row = next(line for line in text.splitlines() if line.startswith("| `cluster_autoscaler_chart` |"))
    assert dict((minor, chart) for chart, minor in re.findall(r"(\d+\.\d+\.\d+) for (1\.\d+)", row)) == \
        CLUSTER_AUTOSCALER_CHARTS


def test_the_design_notes_instance_facts_are_the_catalogs():
    from config.catalog import lookup

    text = (DOCS / "DESIGN.md").read_text()
    table = text[text.index("### Instance facts"):]
    table = table[:table.index("\n#")]
    rows = [[c.strip() for c in line.strip().strip("|").split("|")]
            for line in table.splitlines() if re.match(r"^\| [a-z]\w*\.\w+", line)]
    assert len(rows) >= 12
    for name, _, count, efa, nproc in rows:
        t = lookup(name.split()[0])
        assert (int(count), int(efa), int(nproc.split()[0])) == \
            (t.accelerator_count, t.efa_interfaces, t.nproc_per_node), name


# --- links, headings, citations -----------------------------------------------------------------

MARKDOWN = [REPO / "README.md", *sorted(DOCS.glob("*.md"))]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lowercase, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip()).replace("`", "")
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    found = set()
    for heading in re.findall(r"^#{1,6} (.+)$", _without_code_blocks(path.read_text()), flags=re.M):
        base = slug(heading)
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def links(path: Path) -> list[str]:
    text = re.sub(r"`[^`\n]*`", "", _without_code_blocks(path.read_text()))
    return re.findall(r"\[[^\]]*\]\(([^)\s]+)\)", text)


def test_the_link_check_sees_links_and_anchors():
    assert "docs/config-reference.md" in links(REPO / "README.md")
    assert "accelerated_node_groups" in anchors(CONFIG_REFERENCE)
    assert slug("How long a deploy takes, and what the platform costs") == \
        "how-long-a-deploy-takes-and-what-the-platform-costs"


@pytest.mark.parametrize("path", MARKDOWN, ids=lambda p: str(p.relative_to(REPO)))
def test_every_link_resolves(path):
    broken = []
    for link in links(path):
        if re.match(r"^[a-z]+:", link):
            continue
        target, _, anchor = link.partition("#")
        file = (path.parent / target).resolve() if target else path
        if not file.exists():
            broken.append(f"{link}: no such file")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(f"{link}: no such heading in {file.relative_to(REPO)}")
    assert broken == []


@pytest.mark.parametrize("path", sorted(DOCS.glob("*.md")), ids=lambda p: p.name)
def test_every_doc_says_what_it_is_for_and_links_back_to_the_readme(path):
    lines = path.read_text().splitlines()
    assert lines[0].startswith("# ") and lines[1] == ""
    assert "](../README.md)" in lines[2], f"{path.name}: the line after the title should link back to the README"


def test_the_readme_links_every_doc():
    readme = links(REPO / "README.md")
    assert [p.name for p in sorted(DOCS.glob("*.md")) if f"docs/{p.name}" not in readme] == []


def test_the_readme_keeps_its_two_commands():
    readme = (REPO / "README.md").read_text()
    quick_start = readme[readme.index("## Quick start"):readme.index("## Deploy")]
    assert re.search(r"^make synth +# 1\. ", quick_start, flags=re.M)
    assert re.search(r"^make test +# 2\. ", quick_start, flags=re.M)


def test_citations_of_the_design_note_name_its_sections():
    sections = {h.strip() for h in re.findall(r"^#{1,6} (.+)$", (DOCS / "DESIGN.md").read_text(), flags=re.M)}
    problems = []
    for root in ("app.py", "stacks", "cdk_constructs", "k8s_charts", "training", "trainctl", "config",
                 "typed_config", "tests", "benchmarks"):
        path = REPO / root
        for file in [path] if path.is_file() else sorted(path.rglob("*.py")):
            if file == Path(__file__):
                continue
            text = file.read_text()
            for match in re.finditer(r"(\S*)DESIGN\.md(?:, [\"']([^\"']+)[\"'])?", text):
                where = f"{file.relative_to(REPO)}: {match.group(0)}"
                if not match.group(1).endswith("docs/"):
                    problems.append(f"{where}: cite docs/DESIGN.md")
                elif match.group(2) and match.group(2) not in sections:
                    problems.append(f"{where}: docs/DESIGN.md has no section {match.group(2)!r}")
    assert problems == []


# --- the upgrade table --------------------------------------------------------------------------

OPERATIONS = DOCS / "operations.md"
UPGRADE_SECTION = "## Upgrades and config changes"
UPGRADE_HEADER = "| field | update policy | what happens to running jobs |"


def upgrade_table(text: str) -> tuple[dict[str, str], set[str], list[str]]:
    """(field -> policy, the policies the section defines, the sections it claims to cover)."""
    section = text[text.index(UPGRADE_SECTION) + len(UPGRADE_SECTION):]
    section = section[:section.index("\n## ")]
    defined = set(re.findall(r"^- \*\*([a-z ]+)\*\*:", section, flags=re.M))
    claim = re.search(r"^The table covers every field of (.+)\.$", section, flags=re.M)
    covered = re.findall(r"`([\w\[\]]+)`", claim.group(1)) if claim else []
    rows: dict[str, str] = {}
    table = section[section.index(UPGRADE_HEADER):].splitlines()[2:]
    for line in table:
        if not line.startswith("|"):
            break
        field, policy, _ = [c.strip() for c in line.strip().strip("|").split("|", 2)]
        name = re.fullmatch(r"`([\w.\[\]]+)`", field)
        assert name, f"a row without a `field`: {line}"
        assert name.group(1) not in rows, f"{name.group(1)} is listed twice"
        rows[name.group(1)] = policy
    return rows, defined, covered


def upgrade_table_problems(text: str) -> list[str]:
    from config import PlatformConfig

    rows, defined, covered = upgrade_table(text)
    fields = {key: is_section for key, _, is_section in model_fields(PlatformConfig)}
    problems = [f"{f}: no such config field" for f in rows if f not in fields]
    problems += [f"{f}: update policy {p!r} is not one the section defines ({', '.join(sorted(defined))})"
                 for f, p in rows.items() if p not in defined]
    for section in covered:  # e.g. fsx, or accelerated_node_groups[] (model_fields marks list items so)
        for key, is_section in fields.items():
            parent = key.rsplit(".", 1)[0]
            if (key.startswith(section + ".") and key not in rows and parent not in rows  # a listed section covers its keys
                    and not (is_section and any(r.startswith(key + ".") for r in rows))):
                problems.append(f"{key}: the table claims to cover {section} but has no row for it")
    return problems


def test_the_upgrade_table_names_real_fields_and_covers_the_sections_it_claims():
    rows, defined, covered = upgrade_table(OPERATIONS.read_text())
    assert defined == {"in place", "rolled", "replaced", "create only"}
    assert covered == ["cluster", "system_node_group", "accelerated_node_groups[]", "fsx"]
    assert rows["cluster.kubernetes_version"] == "rolled" and rows["cluster.ami_release_version"] == "rolled"
    assert upgrade_table_problems(OPERATIONS.read_text()) == []


def test_the_upgrade_table_check_catches_a_missing_row_a_made_up_field_and_an_unknown_policy():
    text = OPERATIONS.read_text()
    text = re.sub(r"^\| `fsx\.compression` \|.*\n", "", text, flags=re.M)
    text = text.replace("| `fsx.log_retention_days` | in place |", "| `fsx.log_days` | in place |")
    text = text.replace("| `cluster.admin_principal_arns` | in place |", "| `cluster.admin_principal_arns` | hot |")
    assert sorted(upgrade_table_problems(text)) == sorted([
        "fsx.log_days: no such config field",
        "cluster.admin_principal_arns: update policy 'hot' is not one the section defines "
        "(create only, in place, replaced, rolled)",
        "fsx.compression: the table claims to cover fsx but has no row for it",
        "fsx.log_retention_days: the table claims to cover fsx but has no row for it",
    ])

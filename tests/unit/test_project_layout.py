"""House rules that keep the two README commands working on a fresh clone."""

from __future__ import annotations

import ast
import json
from pathlib import Path
import re
import subprocess
import sys

import pytest

from tests.conftest import REPO

PIN = re.compile(r"^[A-Za-z0-9_.-]+(\[[A-Za-z0-9_,.-]+\])?==[A-Za-z0-9_.+-]+$")


def _requirement_lines(name: str) -> list[str]:
    lines = (line.split("#", 1)[0].strip() for line in (REPO / name).read_text().splitlines())
    return [line for line in lines if line]


@pytest.mark.parametrize("name", ["requirements.txt", "requirements-dev.txt", "training/requirements.txt",
                                  "requirements-xla.txt"])
def test_every_python_requirement_is_pinned(name):
    for line in _requirement_lines(name):
        if not line.startswith("-r "):
            assert PIN.match(line), f"{name}: {line!r} is not pinned with =="


def test_deploy_requirements_leave_out_the_trainer():
    lines = _requirement_lines("requirements.txt")
    assert lines and not any("torch" in line.lower() or "training/" in line for line in lines)


def test_cdk_cli_is_pinned_to_a_version_that_reads_aws_cdk_lib_2_27x():
    package = json.loads((REPO / "package.json").read_text())
    assert re.fullmatch(r"2\.1148\.\d+", package["devDependencies"]["aws-cdk"])
    lock = json.loads((REPO / "package-lock.json").read_text())
    assert lock["packages"]["node_modules/aws-cdk"]["version"] == package["devDependencies"]["aws-cdk"]


def test_cli_telemetry_and_notices_are_off():
    cdk = json.loads((REPO / "cdk.json").read_text())
    assert cdk["notices"] is False and cdk["context"]["cli-telemetry"] is False


def test_no_top_level_constructs_folder():
    assert not (REPO / "constructs").exists(), "a top-level constructs/ would shadow the constructs library"


def test_trainer_never_imports_cdk():
    code = "import sys, training; print(sorted(m for m in sys.modules if m.split('.')[0] in ('aws_cdk', 'cdk_nag', 'jsii')))"
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


def _field_paths(model, prefix=""):
    from typed_config import unwrap_model

    for name, field in model.model_fields.items():
        nested = unwrap_model(field.annotation)
        yield prefix + name
        if nested is not None:
            yield from _field_paths(nested, f"{prefix}{name}.")


def test_config_reference_covers_every_field():
    from config import PlatformConfig

    doc = (REPO / "docs" / "config-reference.md").read_text()
    reference = doc[doc.index("## Top level") : doc.index("## Instance catalog")]
    # A field is named as a key of its own (`weight`) or as a part of a dotted key (`queue.weight`).
    named = {part for key in re.findall(r"`([\w.\[\]]+)`", reference) for part in key.replace("[]", "").split(".")}
    missing = [path for path in _field_paths(PlatformConfig) if path.rsplit(".", 1)[-1] not in named]
    assert missing == []


def test_trainer_config_reference_covers_every_field():
    from training.config import TrainConfig

    doc = (REPO / "docs" / "trainer.md").read_text()
    reference = doc[doc.index("## Trainer config reference") : doc.index("## Trainer images")]
    nested = [path for path in _field_paths(TrainConfig) if "." in path]
    assert nested and [path for path in nested if f"`{path}`" not in reference] == []


def test_trainctl_is_a_declared_console_command():
    import tomllib

    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {"trainctl": "trainctl.__main__:main"}
    command = Path(sys.executable).parent / "trainctl"
    result = subprocess.run([str(command), "--help"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and "preflight" in result.stdout and "stage-data" in result.stdout


# --- the import graph: the contract is the only bridge ------------------------------------------

PACKAGES = ("app.py", "stacks", "cdk_constructs", "k8s_charts", "training", "trainctl", "config", "typed_config")
DEPLOY_SIDE = {"app", "stacks", "cdk_constructs", "k8s_charts", "trainctl", "config"}
# The trainer's own config model judges a job's trainer_args before anything is rendered
# (config/job_spec.py): pydantic only, and read by the deploy side, never the reverse.
TRAINER_SCHEMA = "training.config"


def import_graph() -> dict[str, set[str]]:
    """Module -> the project's modules it imports, at any depth of the file (function-level too)."""
    import ast

    modules = {}
    for root in PACKAGES:
        path = REPO / root
        for file in [path] if path.is_file() else sorted(path.rglob("*.py")):
            name = ".".join(file.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
            modules[name] = file

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph = {name: set() for name in modules}
    for name, file in modules.items():
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, ast.Import):
                found = [resolve(alias.name) for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found = [resolve(f"{node.module}.{alias.name}") or resolve(node.module) for alias in node.names]
            else:
                continue
            graph[name] |= {target for target in found if target and target != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for node in graph:
        if node not in index:
            visit(node)
    return sorted(found)


def test_no_import_cycle():
    assert cycles(import_graph()) == []


def test_the_cycle_check_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_platform_and_the_image_meet_only_in_the_contract():
    graph = import_graph()
    crossings = sorted((source, target) for source, targets in graph.items() for target in targets
                       if (source.split(".")[0] in DEPLOY_SIDE) != (target.split(".")[0] in DEPLOY_SIDE)
                       and "typed_config" not in (source.split(".")[0], target.split(".")[0]))
    assert {target for _, target in crossings} <= {"training.contract", TRAINER_SCHEMA}
    assert all(source.split(".")[0] in DEPLOY_SIDE for source, _ in crossings)  # the image imports no deploy code
    contract = graph["training.contract"]
    assert contract == set(), f"the contract imports {sorted(contract)}"


def test_the_contract_loads_neither_torch_nor_cdk():
    code = ("import sys, training.contract; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'aws_cdk', 'cdk8s', 'numpy'}))")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


# --- the trainer's rooms --------------------------------------------------------------------------

def room(module: str) -> str:
    """training.loop.trainer -> training.loop; top-level modules (training.config) are rooms of their own."""
    return ".".join(module.split(".")[:2])


def test_the_trainer_is_in_rooms_that_import_each_other_one_way():
    graph = import_graph()
    rooms: dict[str, set[str]] = {}
    for source, targets in graph.items():
        if source.startswith("training"):
            rooms.setdefault(room(source), set()).update(room(t) for t in targets if t.startswith("training"))
    for name, targets in rooms.items():
        targets.discard(name)
    assert {"training.launcher", "training.loop", "training.data", "training.models"} <= set(rooms)
    assert cycles(rooms) == []


def test_the_image_holds_nothing_only_tests_use():
    """The local harness (trainctl/backends/local_cluster.py) and the drills (tests/drill_harness.py) are outside
    training/, which the images copy whole (training/docker/Dockerfile.*: COPY training/ training/)."""
    graph = import_graph()
    assert not (REPO / "training" / "devtools").exists()
    users = sorted(source for source, targets in graph.items()
                   if source.startswith("training") and any(t.startswith(("trainctl", "tests")) for t in targets))
    assert users == []
    for dockerfile in (REPO / "training" / "docker").glob("Dockerfile*"):
        copied = [line.split()[1] for line in dockerfile.read_text().splitlines() if line.startswith("COPY ")]
        assert not [path for path in copied if path.startswith(("tests", "trainctl", "benchmarks"))], dockerfile


def test_constructs_take_resources_and_facts_not_config_models():
    """A construct's props are resources and plain facts (issue 34); the stacks translate the config.
    From config/ a construct reads only the catalog's hardware facts and the pinned versions."""
    graph = import_graph()
    reads = {(source, target) for source, targets in graph.items() if source.split(".")[0] == "cdk_constructs"
             for target in targets if target.split(".")[0] == "config"}
    assert {target for _, target in reads} <= {"config.catalog", "config.versions"}, sorted(reads)


def test_the_shared_paths_and_node_labels_are_spelled_only_in_the_contract():
    """The /fsx folders and the platform's node labels: one spelling, in training/contract.py."""
    import ast

    spelled = []
    for root in PACKAGES:
        path = REPO / root
        for file in [path] if path.is_file() else sorted(path.rglob("*.py")):
            for node in ast.walk(ast.parse(file.read_text())):
                if (isinstance(node, ast.Constant) and isinstance(node.value, str)
                        and node.value.startswith(("/fsx", "training-platform/"))):
                    spelled.append((str(file.relative_to(REPO)), node.value))
    assert spelled and {file for file, _ in spelled} == {"training/contract.py"}, spelled


def test_trainctl_backends_import_only_the_interface_and_main_only_dispatches():
    """trainctl/backends/: no backend imports another (what they share is the interface module's), and
    __main__ reaches a backend only by name, through the interface (trainctl.backends.load), and
    compares nothing against a backend's name: the backend's own logic lives in its module."""
    import ast

    from trainctl.backends import BACKENDS

    graph = import_graph()
    # a backend's modules: its own, and its helpers beside it (slurm's SSM shell, slurm_transport)
    own = {name: {m for m in graph if m == module or m.startswith(f"{module}_")} for name, module in BACKENDS.items()}
    for name, modules in own.items():
        others = set().union(*(theirs for other, theirs in own.items() if other != name))
        for module in modules:
            assert not graph[module] & others, (module, graph[module] & others)
    assert not graph["trainctl.__main__"] & set().union(*own.values())
    tree = ast.parse((REPO / "trainctl" / "__main__.py").read_text())
    compared = {node.value for compare in ast.walk(tree) if isinstance(compare, ast.Compare)
                for node in ast.walk(compare) if isinstance(node, ast.Constant)}
    assert not compared & set(BACKENDS), compared & set(BACKENDS)


def test_the_regroup_handshake_names_its_files_through_the_contract_only():
    """The agent and its workers meet in a control folder (training/launcher/agent.py and
    training/loop/regroup.py, the two sides of a regroup): every file name there comes from
    training.contract.control_file, never typed again on one side."""
    import re

    typed = re.compile(r"\{(?:PAUSED_FILE|MEMBERSHIP_FILE|BROKEN_MARKER|RECOVERS_MARKER|WRITING_MARKER)\}-")
    found = [f"{path.relative_to(REPO)}:{number}" for path in sorted((REPO / "training").rglob("*.py"))
             for number, line in enumerate(path.read_text().splitlines(), 1) if typed.search(line)]
    assert found == []


def test_every_test_module_is_a_unit_test_or_a_drill():
    """Slow by directory (tests/conftest.py, DRILLS): a module outside both would run in neither
    `make test-fast` nor as a marked drill."""
    assert sorted(path.name for path in (REPO / "tests").glob("test_*.py")) == []
    folders = {path.parent.relative_to(REPO / "tests").as_posix() for path in (REPO / "tests").rglob("test_*.py")}
    assert folders == {"unit", "unit/cdk", "drills"}


def builds_constructs(path: Path) -> bool:
    """Imports aws_cdk, or a test or fixture takes the synth fixture (tests/conftest.py)."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "aws_cdk":
            return True
        if isinstance(node, ast.Import) and any(alias.name.split(".")[0] == "aws_cdk" for alias in node.names):
            return True
        if isinstance(node, ast.FunctionDef) and any(arg.arg == "synth" for arg in node.args.args):
            return True
    return False


def test_the_unit_modules_that_build_constructs_are_the_ones_in_tests_unit_cdk():
    """xdist runs tests/unit/cdk/ on one worker (tests/conftest.py, SuiteScopes): a module that
    synthesizes outside it would start a second jsii runtime and repeat the configs there."""
    unit = REPO / "tests" / "unit"
    assert sorted(p.name for p in unit.glob("test_*.py") if builds_constructs(p)) == []
    assert sorted(p.name for p in (unit / "cdk").glob("test_*.py") if not builds_constructs(p)) == []


# What starts the timed machinery of a drill: the drills' harness, a Slurm cluster, agents and etcd members,
# and the waits on them (a module's names, or None for any of them), and the etcd fixtures of tests/conftest.py.
# A drill that launches agents as a subprocess of its own (test_resume_safety's refused launches,
# test_allreduce_bench's standalone torchrun, whose assertions hold no deadline, test_gpu_check's
# benchmarks/gpu_check.py) is judged by hand.
TIMED_MACHINERY = {"tests.drill_harness": None, "tests.slurm_cluster": None,
                   "trainctl.backends.local_cluster": {"Agent", "LocalEtcd", "LocalEtcdCluster", "wait_until"}}
TIMED_FIXTURES = {"etcd_server", "etcd_module"}


def imports_any(tree: ast.Module, table: dict[str, set[str] | None]) -> bool:
    """Whether the module imports one of ``table``'s modules (or a module inside one), whole or, where the table
    names some, one of those names from it."""
    def within(module: str) -> str | None:
        return next((key for key in table if module == key or module.startswith(key + ".")), None)

    for node in ast.walk(tree):
        if isinstance(node, ast.Import) and any(within(alias.name) for alias in node.names):
            return True
        if isinstance(node, ast.ImportFrom) and node.module:
            names = {alias.name for alias in node.names}
            if {f"{node.module}.{name}" for name in names} & table.keys():  # from tests import slurm_cluster
                return True
            key = within(node.module)
            if key is not None and (table[key] is None or table[key] & names):
                return True
    return False


def uses_timed_machinery(tree: ast.Module) -> bool:
    return imports_any(tree, TIMED_MACHINERY) or any(
        isinstance(node, ast.FunctionDef) and TIMED_FIXTURES & {arg.arg for arg in node.args.args}
        for node in ast.walk(tree))


def module_marks(tree: ast.Module, mark_name: str) -> tuple[bool, list[int]]:
    """Whether the module's `pytestmark` holds `pytest.mark.<mark_name>`, and the lines of the mark anywhere else."""
    marks = [node for node in ast.walk(tree) if isinstance(node, ast.Attribute) and node.attr == mark_name
             and isinstance(node.value, ast.Attribute) and node.value.attr == "mark"]
    module_level = {id(node) for statement in tree.body if isinstance(statement, ast.Assign)
                    and any(isinstance(target, ast.Name) and target.id == "pytestmark" for target in statement.targets)
                    for node in ast.walk(statement.value)}
    return any(id(mark) in module_level for mark in marks), [mark.lineno for mark in marks if id(mark) not in module_level]


def test_no_drill_that_runs_agents_etcd_or_slurm_is_marked_untimed():
    """An untimed drill runs beside others (tests/background.py, tests/machine_turns.py); one that runs agents,
    etcd or Slurm waits on them with deadlines, and must have the machine to itself."""
    drills = sorted((REPO / "tests" / "drills").glob("test_*.py"))
    trees = {p.name: ast.parse(p.read_text()) for p in drills}
    assert [name for name, tree in trees.items() if module_marks(tree, "untimed")[0] and uses_timed_machinery(tree)] == []


CLOCKS = {"monotonic", "perf_counter", "time", "monotonic_ns", "perf_counter_ns", "time_ns"}


def reads_the_clock(tree: ast.Module) -> bool:
    return any(isinstance(node, ast.Attribute) and node.attr in CLOCKS and isinstance(node.value, ast.Name)
               and node.value.id == "time" for node in ast.walk(tree))


def test_no_untimed_drill_reads_the_clock():
    """make test runs the untimed drills at the lowest priority, on the CPU the timed drills leave idle
    (tests/background.py): a deadline there ("exits within 20 s") fails whenever a timed drill keeps both
    cores busy that long. A drill that times something is timed."""
    drills = sorted((REPO / "tests" / "drills").glob("test_*.py"))
    trees = {p.name: ast.parse(p.read_text()) for p in drills}
    assert [name for name, tree in trees.items() if module_marks(tree, "untimed")[0] and reads_the_clock(tree)] == []
    assert reads_the_clock(ast.parse("import time\nstarted = time.monotonic()"))


def test_a_unit_module_that_reads_the_clock_is_marked_timed_and_only_unit_modules_are():
    """make test runs the unit tests at the lowest priority beside the timed drills (tests/background.py), all but
    the modules marked `timed`, which run with the drills: a unit test that reads the clock holds a deadline
    ("wait(timeout=0.2) returns within 1 s"). A drill is timed unless marked untimed."""
    units = sorted((REPO / "tests" / "unit").rglob("test_*.py"))
    trees = {p.relative_to(REPO).as_posix(): ast.parse(p.read_text()) for p in units}
    assert [path for path, tree in trees.items() if reads_the_clock(tree) and not module_marks(tree, "timed")[0]] == []
    drills = sorted((REPO / "tests" / "drills").glob("test_*.py"))
    assert [p.name for p in drills if module_marks(ast.parse(p.read_text()), "timed")[0]] == []


def test_the_untimed_and_timed_marks_are_set_on_whole_modules_alone():
    """tests/machine_turns.py and make test's selection read the marks from the module: every test of a module
    takes the same turn."""
    tests = sorted((REPO / "tests").rglob("test_*.py"))
    elsewhere = {p.relative_to(REPO).as_posix(): [line for mark in ("untimed", "timed", "light")
                                                  for line in module_marks(tree, mark)[1]]
                 for p in tests for tree in [ast.parse(p.read_text())]}
    assert {path: lines for path, lines in elsewhere.items() if lines} == {}


# What a light drill may not use: it runs at full priority beside the timed drills (Makefile, LIGHT_TIMED_TESTS),
# so it must leave the cores idle. An etcd and the rendezvous handlers in threads do; agents, trainers, the drills'
# jobs, a Slurm cluster and subprocesses of its own would not.
HEAVY_MACHINERY = {"tests.slurm_cluster": None, "subprocess": None, "training.loop": None,
                   "trainctl.backends.local_cluster": {"Agent", "LocalEtcdCluster"}}


def starts_heavy_work(tree: ast.Module) -> bool:
    return imports_any(tree, HEAVY_MACHINERY) or any(
        isinstance(node, ast.ImportFrom) and node.module == "tests.drill_harness"
        and any(alias.name.endswith("_drill") for alias in node.names) for node in ast.walk(tree))


def test_a_light_drill_is_a_timed_drill_that_starts_no_agent_trainer_or_slurm():
    drills = sorted((REPO / "tests" / "drills").glob("test_*.py"))
    trees = {p.name: ast.parse(p.read_text()) for p in drills}
    light = [name for name, tree in trees.items() if module_marks(tree, "light")[0]]
    assert "test_rendezvous_v3.py" in light
    assert [name for name in light if module_marks(trees[name], "untimed")[0] or starts_heavy_work(trees[name])] == []
    units = sorted((REPO / "tests" / "unit").rglob("test_*.py"))
    assert [p.name for p in units if module_marks(ast.parse(p.read_text()), "light")[0]] == []


@pytest.mark.parametrize(("source", "heavy"), [
    ("from tests.drill_harness import lost_node_drill", True),
    ("from tests.drill_harness import etcd_metrics", False),
    ("import subprocess", True),
    ("from trainctl.backends.local_cluster import Agent", True),
    ("from trainctl.backends.local_cluster import LocalEtcd, free_port", False),
    ("from training.loop.trainer import Trainer", True),
    ("from tests import slurm_cluster", True),
    ("import tests.slurm_cluster", True),
])
def test_the_light_guard_sees_what_starts_heavy_work(source, heavy):
    assert starts_heavy_work(ast.parse(source)) is heavy


@pytest.mark.parametrize(("source", "timed"), [
    ("from tests.drill_harness import etcd_drill", True),
    ("from tests import slurm_cluster", True),
    ("import tests.slurm_cluster", True),
    ("from trainctl.backends import local_cluster", True),
    ("from trainctl.backends.local_cluster import Agent, free_port", True),
    ("from trainctl.backends.local_cluster import wait_until", True),
    ("def test_x(etcd_module):\n    pass", True),
    ("from trainctl.backends.local_cluster import free_port", False),
    ("from tests.conftest import REPO\ndef test_x(tmp_path):\n    pass", False),
])
def test_the_guard_sees_each_way_a_drill_reaches_the_timed_machinery(source, timed):
    assert uses_timed_machinery(ast.parse(source)) is timed


@pytest.mark.parametrize(("source", "module_level", "elsewhere"), [
    ("pytestmark = pytest.mark.untimed", True, []),
    ("pytestmark = [pytest.mark.untimed, pytest.mark.timeout(300)]", True, []),
    ("import pytest\n@pytest.mark.untimed\ndef test_x():\n    pass", False, [2]),
    ("pytestmark = pytest.mark.timeout(300)", False, []),
])
def test_the_guard_tells_a_module_mark_from_a_tests(source, module_level, elsewhere):
    assert module_marks(ast.parse(source), "untimed") == (module_level, elsewhere)

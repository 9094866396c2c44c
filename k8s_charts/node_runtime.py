"""The Node.js runtime that cdk8s (through jsii) runs on: the pinned one from node_modules.

jsii starts ``$JSII_NODE`` (default: the first ``node`` on PATH) when cdk8s is imported. A
user's shell seldom has node_modules/.bin on PATH, and the system's Node may be one jsii no
longer supports (Node 20 prints an 11-line end-of-life banner on every call), or absent (an
opaque traceback). So the pinned Node that ``make synth`` installs is chosen before cdk8s loads.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

# package.json pins Node 22; jsii supports 22 and 24 (its end-of-life banner, jsii 1.12x).
OLDEST_SUPPORTED_MAJOR = 22
PINNED_NODE = Path(__file__).resolve().parents[1] / "node_modules" / ".bin" / "node"
HOW_TO_GET_IT = ("run `make synth` in the platform's checkout (it installs the pinned Node into node_modules), "
                 f"or install Node.js {OLDEST_SUPPORTED_MAJOR} or newer, or set JSII_NODE to one")


class NodeRuntimeMissing(RuntimeError):
    """No supported Node.js for cdk8s; the message is one line that says how to get one."""


def node_major(executable: str) -> int | None:
    try:
        version = subprocess.run([executable, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    match = re.match(r"v(\d+)\.", version.strip())
    return int(match.group(1)) if match else None


def select_node(pinned: Path | None = None, needed_for: str = "to render manifests (cdk8s runs on it)") -> str:
    """Point jsii at a supported Node (``JSII_NODE``), preferring the pinned one, and return it.
    ``needed_for`` says in the error what the caller was about to do."""
    pinned = pinned or PINNED_NODE
    chosen = os.environ.get("JSII_NODE")
    if chosen:
        return chosen
    if pinned.exists():
        os.environ["JSII_NODE"] = str(pinned)
        return str(pinned)
    on_path = shutil.which("node")
    if on_path is None:
        raise NodeRuntimeMissing(f"Node.js is needed {needed_for} and none was found; {HOW_TO_GET_IT}")
    major = node_major(on_path)
    if major is None or major < OLDEST_SUPPORTED_MAJOR:
        raise NodeRuntimeMissing(f"{on_path} is Node.js {major or 'of an unknown version'}, which cdk8s no longer "
                                 f"supports; {HOW_TO_GET_IT}")
    os.environ["JSII_NODE"] = on_path
    return on_path

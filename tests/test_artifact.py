"""The compiled/ directory: deterministic bytes, and refused when it cannot be trusted."""

import json
import os
import subprocess
import sys

import pytest

from helpers import compile_text
from parc import artifact
from parc.errors import ArtifactError

PLAN = """
mesh dp=2
batch global=8 micro=2
"""


def _tree(root):
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_output_is_byte_deterministic(tmp_path):
    a = compile_text(PLAN, tmp_path / "a" / "compiled").root
    b = compile_text(PLAN, tmp_path / "b" / "compiled").root
    assert _tree(a) == _tree(b)
    assert set(_tree(a)) >= {"plan.json", "MANIFEST", "model/model.py", "programs/stage0_tp0.py"}


def test_recompiling_in_place_replaces_the_artifact(tmp_path):
    out = tmp_path / "compiled"
    compile_text(PLAN, out)
    (out / "stray.txt").write_text("left over")
    compile_text(PLAN, out)
    assert not (out / "stray.txt").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporaries left behind


def test_program_is_readable_python(tmp_path):
    src = (compile_text(PLAN, tmp_path / "c").root / "programs" / "stage0_tp0.py").read_text()
    assert "def forward(" in src and "torch.ops.aten.linear" in src
    assert "wte.weight" in src  # the header maps placeholders to model FQNs


def test_tampered_file_is_refused(tmp_path):
    root = compile_text(PLAN, tmp_path / "c").root
    prog = root / "programs" / "stage0_tp0.py"
    prog.write_text(prog.read_text() + "\n# edited\n")
    with pytest.raises(ArtifactError, match=r"programs/stage0_tp0.py does not match its manifest hash"):
        artifact.load(root)


def test_unknown_format_version_is_refused(tmp_path):
    root = compile_text(PLAN, tmp_path / "c").root
    plan = json.loads((root / "plan.json").read_text())
    plan["format_version"] = 99
    files = {p: (root / p).read_text() for p in ["model/model.py", "programs/stage0_tp0.py"]}
    files["plan.json"] = artifact.dumps(plan)
    artifact.write(root, files)  # a consistent manifest, so only the version is wrong
    with pytest.raises(ArtifactError, match=r"format version 99, but this parc reads version 1"):
        artifact.load(root)


def test_wrong_world_size_is_refused_with_one_line(tmp_path):
    root = compile_text(PLAN, tmp_path / "c").root
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "3", "LOCAL_RANK": "0",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
    r = subprocess.run([sys.executable, "-m", "parc.run", str(root)], env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2
    assert "launched with 3 processes but" in r.stderr and "= 2; use --nproc-per-node 2" in r.stderr
    assert "Traceback" not in r.stderr

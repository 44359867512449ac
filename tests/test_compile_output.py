"""`parc compile -o` never deletes or replaces what is not a parc artifact (issue 10).

Start at `test_refuses_a_directory_that_is_not_an_artifact`. The rule lives in
parc/artifact.py (`check_output`, applied by `write`): the output may be missing, an
empty directory or an earlier artifact (replaced atomically); a file, a symbolic
link or any other directory is refused unless `force`. The CLI tests check the
refusal comes before tracing, in one line, exit 2, with the user's files intact.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from helpers import GPT, ROOT
from parc import artifact
from parc.errors import ArtifactError

FILES = {"plan.json": '{"format_version": 1}\n', "programs/stage0_tp0.py": "def forward(): ...\n"}


def _tree(root) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_refuses_a_directory_that_is_not_an_artifact(tmp_path):
    out = tmp_path / "mine"
    (out / "sub").mkdir(parents=True)
    (out / "notes.txt").write_text("precious")
    (out / "sub" / "data.bin").write_bytes(b"\0\1")
    before = _tree(out)
    with pytest.raises(ArtifactError) as info:
        artifact.write(out, FILES)
    assert info.value.message == (f"output {out} exists and is a directory that is not a parc artifact "
                                  "(no MANIFEST and plan.json); refusing to replace it")
    assert "--force" in info.value.diagnostics[0].hint
    assert _tree(out) == before and sorted(os.listdir(tmp_path)) == ["mine"]  # no temporary left behind


def test_refuses_a_file_and_a_symlink(tmp_path):
    (tmp_path / "somefile.txt").write_text("keep me")
    (tmp_path / "link").symlink_to(tmp_path / "somefile.txt")
    for name, what in (("somefile.txt", "a file"), ("link", "a symbolic link")):
        with pytest.raises(ArtifactError, match=f"exists and is {what}; refusing"):
            artifact.write(tmp_path / name, FILES)
    assert (tmp_path / "somefile.txt").read_text() == "keep me" and (tmp_path / "link").is_symlink()


def test_writes_into_an_empty_directory_and_replaces_an_earlier_artifact(tmp_path):
    out = tmp_path / "compiled"
    out.mkdir()
    artifact.write(out, FILES)
    assert artifact.is_artifact(out) and set(_tree(out)) == {"MANIFEST", *FILES}
    artifact.write(out, {**FILES, "plan.json": '{"format_version": 1, "v": 2}\n'})  # what -o asks for
    assert '"v": 2' in (out / "plan.json").read_text()
    assert sorted(os.listdir(tmp_path)) == ["compiled"]  # the old one moved aside, then removed


def test_force_replaces_a_file_or_a_foreign_directory(tmp_path):
    (tmp_path / "f").write_text("x")
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "x").write_text("x")
    for name in ("f", "d"):
        artifact.write(tmp_path / name, FILES, force=True)
        assert artifact.is_artifact(tmp_path / name) and "x" not in os.listdir(tmp_path / name)
    assert sorted(os.listdir(tmp_path)) == ["d", "f"]


def test_an_output_under_a_file_is_a_clean_error(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(ArtifactError, match="cannot create it"):
        artifact.write(tmp_path / "f" / "compiled", FILES)


def _parc(*args, cwd):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "parc.cli", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


def test_cli_refuses_before_tracing_and_keeps_the_files(tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "a.txt").write_text("precious")
    (tmp_path / "somefile.txt").write_text("keep me")
    for out in ("mine", "somefile.txt"):
        r = _parc("compile", str(GPT), "--plan", str(ROOT / "examples/dp.par"), "-o", out, cwd=tmp_path)
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        assert r.stderr.startswith(f"error: output {out} exists and is ") and "refusing to replace it" in r.stderr
        assert r.stdout == ""  # nothing compiled
    assert (tmp_path / "mine" / "a.txt").read_text() == "precious"
    assert (tmp_path / "somefile.txt").read_text() == "keep me"
    r = _parc("compile", "--help", cwd=tmp_path)
    assert "--force" in r.stdout and "not a parc artifact" in " ".join(r.stdout.split())


def test_compile_model_refuses_absurd_sizes_before_tracing(tmp_path, monkeypatch):
    """A Plan built in code skips the parser's checks; compile_model validates it before any work scales."""

    from parc.compiler import compile_model
    from parc.errors import PlanError
    from parc.grammar.plan import Batch, Mesh, Plan

    def no_trace(*args, **kwargs):  # what "before any work scales" means: the model is never traced
        raise AssertionError("traced a plan that should have been refused first")

    monkeypatch.setattr("parc.compiler.trace", no_trace)
    for plan in (Plan(mesh=Mesh(dp=10**12, tp=2)), Plan(mesh=Mesh(dp=2), batch=Batch(20_000_000, 10_000_000)),
                 Plan(mesh=Mesh(pp=2), batch=Batch(20_000_000, 1))):
        with pytest.raises(PlanError, match="the most parc"):
            compile_model(GPT, plan, tmp_path / "c")
        assert not (tmp_path / "c").exists()

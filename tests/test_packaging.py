"""The wheel installs `parc`, `parc.analysis`, `parc.passes`, `parc.runtime`, `parc.grammar` — and no top-level
`passes` or `runtime` — and imports from the wheel alone."""

import subprocess
import sys
import zipfile

from helpers import ROOT


def test_wheel_contents_and_import(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path), str(ROOT)], check=True, timeout=300, capture_output=True)
    (wheel,) = tmp_path.glob("parc-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith((".dist-info", ".data"))}
    assert tops == {"parc"}, tops
    assert "parc/grammar/parc.lark" in names and "parc/runtime/train.py" in names
    assert "parc/passes/grad_buckets.py" in names and "parc/analysis/cost.py" in names
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    code = ("import parc, parc.passes, parc.runtime.train, parc.grammar.parser as f; "
            "assert parc.__file__.startswith(%r); print(f.parse('mesh dp=2').mesh.dp)" % str(site))
    r = subprocess.run([sys.executable, "-I", "-c", f"import sys; sys.path.insert(0, {str(site)!r}); {code}"],
                       capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "2"

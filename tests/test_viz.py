"""`parc viz`: the mesh, the pipeline timeline and the stages render as valid SVG naming what they draw."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from parc import viz
from parc.cli import main
from parc.errors import ParcError
from parc.passes.schedule import build_schedule

from helpers import compile_text

PLAN = """mesh dp=2 pp=2 tp=2
topology nodes=2 gpus_per_node=4 preset=h100
batch global=8 micro=1
tensor_parallel {
    "blocks.*.attn.qkv"  : column
    "blocks.*.attn.proj" : row
    "blocks.*.mlp.fc"    : column
    "blocks.*.mlp.proj"  : row
}
pipeline schedule=1f1b stages=auto
recompute "blocks.*"
"""


def _texts(svg: Path) -> list[str]:
    root = ET.parse(svg).getroot()  # raises on malformed XML
    return [t.text for t in root.iter("{http://www.w3.org/2000/svg}text") if t.text]


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    out = tmp_path_factory.mktemp("viz") / "c"
    compile_text(PLAN, out)
    return out


def test_viz_cli_writes_all_drawings(compiled, tmp_path, capsys):
    assert main(["viz", str(compiled), "-o", str(tmp_path)]) == 0
    for name in ("mesh", "schedule", "stages"):
        assert (tmp_path / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    mesh = _texts(tmp_path / "mesh.svg")
    for r in range(8):
        assert f"r{r}" in mesh
    assert "node 0" in mesh and "node 1" in mesh and "tp group 0" in mesh
    timeline = _texts(tmp_path / "schedule.svg")
    assert "r0" in timeline and "r1" in timeline and "F0" not in timeline  # one-unit F cells show the number
    assert any(t.startswith("simulated 1f1b: pp 2, 4 micro-batches") for t in timeline)
    assert "B3" in timeline  # backward spans two units: named
    stages = " ".join(_texts(tmp_path / "stages.svg"))
    assert "stage0_tp0" in stages and "stage1_tp1" in stages
    assert "allreduce" in stages or "reduce" in stages  # the TP collectives the programs call
    assert "recomputed: blocks.0 … blocks.1 (2)" in stages and "recomputed: blocks.2 … blocks.3 (2)" in stages


def test_simulated_trace_round_trips_through_the_trace_format(compiled, tmp_path):
    assert main(["viz", str(compiled), "-o", str(tmp_path), "--format", "svg"]) == 0
    events = json.loads((tmp_path / "schedule.trace.json").read_text())["traceEvents"]
    assert {e["name"] for e in events} >= {"F0", "B3"} and all(e["ph"] == "X" for e in events)
    measured = viz.read_trace(tmp_path / "schedule.trace.json")
    assert measured == viz.simulated_timeline(json.loads((compiled / "plan.json").read_text()))
    out = tmp_path / "side"
    assert main(["viz", str(compiled), "-o", str(out), "--trace", str(tmp_path / "schedule.trace.json"),
                 "--format", "svg"]) == 0
    texts = _texts(out / "schedule.svg")
    assert any(t.startswith("measured: schedule.trace.json") for t in texts)


def test_bad_trace(compiled, tmp_path):
    bad = tmp_path / "t.json"
    bad.write_text(json.dumps([{"name": "x", "ph": "B", "ts": 0}]))
    with pytest.raises(ParcError, match="no complete events"):
        viz.draw_all(compiled, tmp_path / "o", trace=bad)


def test_pp16_m64_renders(tmp_path):
    pj = {"schedule": build_schedule("1f1b", 16, 64).to_json()}
    paths = viz._render(viz.schedule_graph(pj), tmp_path, "schedule", "both")
    texts = _texts(paths[0])
    for r in range(16):
        assert f"r{r}" in texts
    assert "63" in texts and "B63" in texts
    assert sum(t.startswith("simulated 1f1b") for t in texts) == 3  # 237 units in panels of 80
    assert paths[1].stat().st_size > 10_000


def test_mesh_names_every_rank_without_a_compile():
    pj = {"mesh": {"dp": 2, "pp": 4, "tp": 8, "order": ["tp", "pp", "dp"], "world_size": 64},
          "plan": {"source": "mesh dp=2 pp=4 tp=8\ntopology nodes=8 gpus_per_node=8\n"},
          "ranks": [], "groups": {}}
    from parc import mesh as meshlib
    from parc.grammar.plan import Mesh

    m = Mesh(2, 4, 8)
    pj["ranks"] = [{"rank": r, **meshlib.coords(m, r).as_dict()} for r in range(64)]
    pj["groups"] = {a: meshlib.groups(m, a) for a in ("dp", "pp", "tp")}
    source = viz.mesh_graph(pj).source
    for r in range(64):
        assert f'r{r} [label="r{r}' in source
    assert "cluster_node7" in source


def test_dp_stages_name_the_runtime_all_reduce(tmp_path):
    out = tmp_path / "c"
    compile_text("mesh dp=2\nbatch global=4 micro=2\n", out)
    assert main(["viz", str(out), "-o", str(tmp_path / "v"), "--format", "svg"]) == 0
    stages = " ".join(_texts(tmp_path / "v" / "stages.svg"))
    assert "dp all-reduce × 1 bucket (runtime)" in stages and "no collectives" not in stages


def test_without_dot_one_line_and_no_files(compiled, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert main(["viz", str(compiled), "-o", str(tmp_path / "v")]) == 2
    err = capsys.readouterr().err
    assert "graphviz's `dot`" in err and "apt-get install graphviz" in err and "Traceback" not in err
    assert not (tmp_path / "v").exists()


def test_reads_the_trace_parc_run_writes(compiled, tmp_path):
    from parc.runtime.parallel.pipeline import write_chrome_trace

    events = [[("F(s0,m0)", 0.0, 0.01), ("post SEND_F(s0,m0>r1)", 0.01, 0.011), ("B(s0,m0)", 0.04, 0.06)],
              [("wait RECV_F", 0.0, 0.011), ("F(s1,m0)", 0.011, 0.021), ("B(s1,m0)", 0.021, 0.041)]]
    write_chrome_trace(events, tmp_path / "run.json")
    timeline = viz.read_trace(tmp_path / "run.json")
    assert [[(k, st, m) for _, _, k, st, m in row] for row in timeline] == [[("F", 0, 0), ("B", 0, 0)],
                                                                          [("F", 1, 0), ("B", 1, 0)]]
    assert timeline[0][1][1] - timeline[0][1][0] == pytest.approx(2.0)  # unit = the median F, 10 ms
    assert main(["viz", str(compiled), "-o", str(tmp_path / "v"), "--trace", str(tmp_path / "run.json"),
                 "--format", "svg"]) == 0


def test_timeline_to_scale_with_a_time_axis():
    pj = {"schedule": build_schedule("gpipe", 2, 4).to_json()}  # F = 1, B = 2: 15 units
    label = viz.schedule_graph(pj).source.split("simulated0 [label=")[1]
    assert "COLSPAN" not in label  # one fixed-width cell per unit of time on every row
    rows = label.split("<TR>")[1:]
    assert [r.count(f'WIDTH="{viz.SLOT_PX}"') for r in rows] == [15, 15, 15]  # the axis, r0, r1
    assert ">time<" in rows[0] and ">0<" in rows[0] and ">10<" in rows[0]

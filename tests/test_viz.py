"""`parc viz`: the mesh, the pipeline timeline and the stages render as valid SVG naming what they draw."""

from __future__ import annotations

import json
import re
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from parc import viz
from parc.analysis import report
from parc.cli import main
from parc.errors import ParcError
from parc.grammar.plan import Mesh
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
    assert "pp" in mesh and "dp" in mesh  # the group edges' labels
    timeline = _texts(tmp_path / "schedule.svg")
    assert "pp 0" in timeline and "pp 1" in timeline
    assert "F0" in timeline and "B3" in timeline  # every cell names its kind and micro-batch
    assert any(t.startswith("planned: 1f1b, pp 2, 4 micro-batches") for t in timeline)
    # the report's bubble, stated beside the unit-cost one, and said to be priced
    priced = report.build(compiled)["utilization"]["schedule_bubble"]
    assert any(t.startswith("parc report prices each stage's F and B on H100-80GB: bubble "
                            f"{priced:.1%}") for t in timeline)
    assert any("forward of micro-batch 3" in t for t in timeline)  # the legend
    stages = " ".join(_texts(tmp_path / "stages.svg"))
    assert "stage0_tp0 … stage0_tp1 (2 programs, alike)" in stages and "stage1_tp0" in stages
    assert "allreduce" in stages or "reduce" in stages  # the TP collectives the programs call
    assert "recomputed: blocks.0 … blocks.1 (2)" in stages and "recomputed: blocks.2 … blocks.3 (2)" in stages
    # the arrow between the stages names the module whose output crosses the cut, not an fx node
    (sent,) = json.loads((compiled / "plan.json").read_text())["programs"]["stage0_tp0"]["send"]
    assert sent["module"] == "blocks.1" and f"blocks.1 {tuple(sent['shape'])}" in stages
    assert sent["name"] not in stages


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
        assert f"pp {r}" in texts
    assert "F63" in texts and "B63" in texts
    assert sum(t.startswith("planned: 1f1b") for t in texts) == 4  # 237 units in panels of 60
    assert paths[1].stat().st_size > 10_000


def test_cells_fit_their_labels():
    """A one-unit cell holds its label ("B63", three glyphs) at FONT_PT: Helvetica's glyphs are at most about
    0.67 em wide for digits and capitals, and a point is 4/3 px at graphviz's 96 dpi."""
    assert viz.SLOT_PX >= 3 * 0.67 * viz.FONT_PT * 4 / 3


def test_zb_h1_i_and_w_differ_and_colour_means_pp_rank():
    """I and W cells differ (lightness and a dashed border), each has a legend entry, and the hue of a row
    is its pp rank's, the colour mesh.png gives that pp rank's ranks."""
    pj = {"schedule": build_schedule("zb_h1", 4, 8).to_json()}
    source = viz.schedule_graph(pj).source
    row = next(r for r in source.split("simulated0 [label=")[1].split("<TR>") if ">pp 1<" in r)
    cells = dict((label, colour) for colour, label in
                 re.findall(r'BGCOLOR="(#[0-9a-f]{6})"><FONT POINT-SIZE="\d+" COLOR="\w+">([FIW]\d+)<', row))
    assert {k: cells[f"{k}0"] for k in "FIW"} == {k: viz._cell_colour(1, k) for k in "FIW"}
    assert len({viz._cell_colour(1, k) for k in "FIW"}) == 3
    assert re.search(r'STYLE="dashed" BGCOLOR="[^"]+"><FONT[^>]*>W0<', row)
    assert not re.search(r'STYLE="dashed" BGCOLOR="[^"]+"><FONT[^>]*>I0<', row)
    assert "backward to the input" in source and "backward to the weights" in source
    for r in range(4):
        assert f'BGCOLOR="{viz._colour(r)}"><FONT POINT-SIZE="{viz.FONT_PT}">pp {r}<' in source
    mesh = viz.mesh_graph(_pj_of(Mesh(2, 2, 2), "mesh dp=2 pp=2 tp=2\n")).source
    for r, coords in enumerate(viz_coords(Mesh(2, 2, 2))):
        assert f'fillcolor="{viz._colour(coords["pp"])}"' in mesh.split(f"\tr{r} [label=")[1].split("]")[0]


def _pj_of(m, source: str) -> dict:
    """plan.json's mesh part for mesh `m`, as the compiler writes it."""
    from parc import mesh as meshlib

    return {"mesh": {"dp": m.dp, "pp": m.pp, "tp": m.tp, "order": ["tp", "pp", "dp"], "world_size": m.world_size},
            "plan": {"source": source}, "ranks": [{"rank": r, **c} for r, c in enumerate(viz_coords(m))],
            "groups": {a: meshlib.groups(m, a) for a in ("dp", "pp", "tp")}}


def viz_coords(m) -> list[dict]:
    from parc import mesh as meshlib

    return [meshlib.coords(m, r).as_dict() for r in range(m.world_size)]


def _edges(source: str, axis: str) -> set[tuple[int, int]]:
    return {(int(a), int(b)) for a, b in re.findall(rf"\tr(\d+) -> r(\d+) \[label={axis} ", source)}


def test_mesh_draws_every_group_and_no_made_up_nodes():
    """8 ranks, no topology: each pp group an arrow chain in stage order, each dp group a chain of dotted
    edges, each tp group a frame; boxes of consecutive ranks, never "node" or a GPU count."""
    pj = _pj_of(Mesh(2, 2, 2), "mesh dp=2 pp=2 tp=2\n")
    source = viz.mesh_graph(pj).source
    for axis in ("pp", "dp"):
        want = {(a, b) for grp in pj["groups"][axis] for a, b in zip(grp, grp[1:])}
        assert _edges(source, axis) == want, axis
    assert _edges(source, "tp") == set()  # framed instead: each tp group on one line of one box
    assert source.count("label=\"tp group") == 4
    assert 'label="node ' not in source and "per node" not in source and "GPU" not in source
    assert "no topology in the plan" in source and 'label="ranks 0–7"' in source


def test_mesh_names_every_rank_without_a_compile():
    pj = _pj_of(Mesh(2, 4, 8), "mesh dp=2 pp=4 tp=8\ntopology nodes=8 gpus_per_node=8\n")
    source = viz.mesh_graph(pj).source
    for r in range(64):
        assert f'r{r} [label="r{r}' in source
    assert "cluster_node7" in source and "8 ranks per node (the plan's topology)" in source
    # 64 ranks: rank 0's groups are marked on the boxes (edges across every node would reorder them), and the
    # title says how
    assert "groups of rank 0" in source and _edges(source, "pp") == _edges(source, "dp") == set()
    pp0, dp0 = (next(g for g in pj["groups"][a] if 0 in g) for a in ("pp", "dp"))
    attrs = {r: source.split(f"\tr{r} [label=")[1].split("]")[0] for r in range(64)}
    assert "peripheries=2" in attrs[0]
    assert all("penwidth=3" in attrs[r] and "dashed" not in attrs[r] for r in pp0[1:])
    assert all("penwidth=3" in attrs[r] and "dashed" in attrs[r] for r in dp0[1:])
    assert all("penwidth" not in attrs[r] for r in set(range(64)) - set(pp0) - set(dp0))


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
    from parc.runtime.parallel.pipeline import measured_bubble, write_chrome_trace

    events = [[("F(s0,m0)", 0.0, 0.01), ("post SEND_F(s0,m0>r1)", 0.01, 0.011), ("B(s0,m0)", 0.04, 0.06)],
              [("wait RECV_F", 0.0, 0.011), ("F(s1,m0)", 0.011, 0.021), ("B(s1,m0)", 0.021, 0.041)]]
    write_chrome_trace(events, tmp_path / "run.json")
    timeline = viz.read_trace(tmp_path / "run.json")
    assert [[(k, st, m) for _, _, k, st, m in row] for row in timeline] == [[("F", 0, 0), ("B", 0, 0)],
                                                                          [("F", 1, 0), ("B", 1, 0)]]
    assert timeline[0][1][1] - timeline[0][1][0] == pytest.approx(2.0)  # unit = the median F, 10 ms
    assert main(["viz", str(compiled), "-o", str(tmp_path / "v"), "--trace", str(tmp_path / "run.json"),
                 "--format", "svg"]) == 0
    texts = _texts(tmp_path / "v" / "schedule.svg")
    measured = texts[texts.index("measured: run.json: units 0…6"):]
    # the measured rows name their cells as the planned ones do, and the bubble is the one parc.run printed
    assert {"F0", "B0"} <= set(measured) and "0" not in measured[measured.index("pp 0"):]
    assert f"measured bubble {measured_bubble(events):.3f} of the step (as parc.run prints it: 1 − compute / (pp × " \
        "span))" in measured
    assert viz.bubble(timeline) == pytest.approx(measured_bubble(events))
    assert "1 unit = the median F, 10 ms; axis in ms" in measured and "ms" in measured and "50" in measured


def test_timeline_to_scale_with_a_time_axis():
    pj = {"schedule": build_schedule("gpipe", 2, 4).to_json()}  # F = 1, B = 2: 15 units
    label = viz.schedule_graph(pj).source.split("simulated0 [label=")[1].split("</TABLE>")[0]
    assert "COLSPAN" not in label  # one fixed-width cell per unit of time on every row
    rows = label.split("<TR>")[1:]
    assert [r.count(f'WIDTH="{viz.SLOT_PX}"') for r in rows] == [15, 15, 15]  # the axis, pp 0, pp 1
    ticks = re.findall(r'SIDES="L" ALIGN="LEFT"><FONT POINT-SIZE="\d+">(\d+)<', rows[0])
    assert ">units<" in rows[0] and ticks == ["0", "5", "10"]


CP_PLAN = """mesh pp=2 cp=2
batch global=4 micro=2
context_parallel ring
pipeline schedule=1f1b
"""


def test_cp_plan_draws_its_rings(tmp_path):
    """A compiled cp plan (pp 2 × cp 2, dp 1): every drawing is written; the mesh names each rank's cp
    coordinate and draws every cp group as its ring (r → r+1, the last back to the first); the stages say
    what the ring's backward sends and that gradients are summed over dp × cp even at dp 1."""
    out = tmp_path / "c"
    compile_text(CP_PLAN, out)
    assert main(["viz", str(out), "-o", str(tmp_path / "v")]) == 0
    for name in ("mesh", "schedule", "stages"):
        assert (tmp_path / "v" / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    pj = json.loads((out / "plan.json").read_text())
    source = viz.mesh_graph(pj).source
    rings = {(a, b) for grp in pj["groups"]["cp"] for a, b in zip(grp, grp[1:] + grp[:1])}
    assert pj["groups"]["cp"] == [[0, 1], [2, 3]] and _edges(source, "cp") == rings
    for r in pj["ranks"]:
        assert f'r{r["rank"]} [label="r{r["rank"]}\ndp 0 pp {r["pp"]} tp 0 cp {r["cp"]}"' in source
    assert "mesh dp 1 × pp 2 × tp 1 × cp 2 = 4 ranks" in source and "cp ring" in source
    mesh = _texts(tmp_path / "v" / "mesh.svg")
    assert sum(t == "cp" for t in mesh) == len(rings)  # each ring edge labelled with its axis
    stages = " ".join(_texts(tmp_path / "v" / "stages.svg"))
    assert stages.count("ring_attention × 2") == 4  # 2 layers a stage; the forward op and its backward line
    assert "backward: bwd_ring_attention × 2 (autograd): K, V, dK, dV 1 hop round the cp ring" in stages
    assert stages.count("dp×cp all-reduce × 1 bucket (runtime)") == 2
    assert "a batch input, this cp rank's tokens (2, 16)" in stages  # the targets, cut for the last stage


def test_large_cp_mesh_outlines_rank_0s_ring():
    """64 ranks (dp 8 × cp 8): no edges; rank 0's cp ring is outlined in the cp colour, the others are not."""
    from parc import mesh as meshlib

    m = Mesh(dp=8, cp=8, order=("tp", "cp", "pp", "dp"))
    pj = _pj_of(m, "mesh dp=8 cp=8\n")
    pj["mesh"]["cp"], pj["mesh"]["order"] = 8, list(m.order)
    pj["groups"]["cp"] = meshlib.groups(m, "cp")
    source = viz.mesh_graph(pj).source
    assert _edges(source, "cp") == set() and "blue outline = its cp ring" in source
    attrs = {r: source.split(f"\tr{r} [label=")[1].split("]")[0] for r in range(64)}
    assert all(f"color=\"{viz.CP_INK}\"" in attrs[r] for r in range(8))  # cp coordinates 0..7 of dp 0
    assert all("color=" not in attrs[r].replace("fillcolor=", "") for r in range(8, 64))

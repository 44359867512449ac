"""`parc viz compiled/ -o DIR`: Graphviz drawings of a compiled plan (SVG and PNG).

Start at `draw_all`. It writes three drawings, each from plan.json alone:

- `mesh`: the ranks placed on nodes (rank // gpus_per_node), each box naming its
  rank and (dp, pp, tp) coordinates (and cp under context parallelism), coloured by
  pp rank; a dashed frame around every tp group that shares a node, and each cp
  group drawn as its ring (rank r sends K/V blocks to r+1, the last back to the
  first). Nodes sit side by side, 8 to a row; meshes over 256 ranks draw their
  first 256.
- `schedule`: the pipeline schedule as a timeline from the simulator
  (`parc.passes.simulate`, F = 1, B = 2 units): one row per pp rank, one cell per
  compute action, numbered by micro-batch and coloured by it (backward darker);
  blank cells are the bubble. With `--trace FILE`, the measured timeline is drawn
  under the simulated one.
- `stages`: one box per program (stage, tp rank) listing the `torch.ops.parc.*`
  collectives its generated code calls, with the stage's first … last module;
  arrows between stages name the values sent.

The timeline is a Graphviz HTML table: a cell spans as many columns as its action
lasts, so the drawing stays a grid that `dot` lays out in milliseconds even at
pp 16 × 64 micro-batches.

Trace format (`--trace`, and `schedule.trace.json` written here for the simulated
schedule, which chrome://tracing and Perfetto open): a JSON list (or
{"traceEvents": [...]}) of complete events
    {"name": "F3", "ph": "X", "ts": <µs>, "dur": <µs>, "pid": <pp rank>, "tid": <pp rank>,
     "args": {"stage": <s>, "micro": <m>, "kind": "F"}}
with kind F, B, I or W; other events are ignored. The measured timeline is
quantized to the median F duration.
"""

from __future__ import annotations

import colorsys
import contextlib
import html
import json
import re
import shutil
import statistics
from pathlib import Path

import graphviz

from parc.errors import ParcError

MAX_RANKS = 256
NODES_PER_ROW = 8
PANEL_UNITS = 60  # time units per panel: 60 × 30 px fits a screen
AXIS_TICK = 5  # a labelled tick on the time axis every 5 units
SLOT_PX = 30  # width of one time unit in the timeline: fits "B63" at FONT_PT
ROW_PX = 24
LABEL_PX = 44  # the rows' label column ("pp 15")
FONT_PT = 10
TITLE_PT = 12


def _colour(pp_rank: int, lightness: float = 0.72) -> str:
    """The hue of a pp rank, in every drawing (golden-ratio steps so neighbours differ); `lightness` tells
    kinds of action apart in the timeline."""
    h = (pp_rank * 0.618033988749895) % 1.0
    r, g, b = colorsys.hls_to_rgb(h, lightness, 0.75)
    return f"#{int(r * 255):02x}{int(g * 255):02x}{int(b * 255):02x}"


def _render(g: graphviz.Digraph, out: Path, name: str, fmt: str) -> list[Path]:
    formats = ("svg", "png") if fmt == "both" else (fmt,)
    paths = []
    for f in formats:
        g.format = f
        paths.append(Path(g.render(filename=name, directory=str(out), cleanup=True)))
    return paths


# ---------------------------------------------------------------- mesh

GROUPS_DRAWN = 32  # up to this many ranks every dp/pp/tp/cp group is drawn; above, rank 0's (the title says so)
CP_INK = "#1f5fbf"  # the cp rings' colour: the one axis drawn in colour, as box fills already mean pp rank
EDGE = {"pp": {"style": "solid", "color": "#333333", "dir": "forward", "arrowsize": "0.6"},
        "dp": {"style": "dotted", "color": "#333333", "dir": "none", "penwidth": "1.6"},
        "tp": {"style": "dashed", "color": "#333333", "dir": "none"},
        "ep": {"style": "bold", "color": "#333333", "dir": "none"},
        "cp": {"style": "solid", "color": CP_INK, "fontcolor": CP_INK, "dir": "forward", "arrowsize": "0.6",
               "penwidth": "1.4"}}


def mesh_graph(pj: dict) -> graphviz.Digraph:
    """Nodes side by side, NODES_PER_ROW to a row; in a node, one line per tp group (with tp 1, per cp group;
    else per rank). The groups are drawn: a dashed frame around a tp group on one node, edges (styled per
    axis, each labelled with its axis) joining the ranks of every dp, pp (in stage order) and tp group, and
    each cp group as its ring: r → r+1 → … → back to the first, the way ring attention passes K/V blocks."""
    mesh, ranks = pj["mesh"], pj["ranks"][:MAX_RANKS]
    cp = mesh.get("cp", 1)  # plan.json names cp only for a plan with context parallelism
    stated = _gpus_per_node(pj)
    per_box = stated or NODES_PER_ROW  # without a topology: boxes of consecutive ranks, not nodes
    shown = {r["rank"] for r in ranks}
    every = mesh["world_size"] <= GROUPS_DRAWN
    where = (f"{stated} ranks per node (the plan's topology)" if stated else
             "no topology in the plan: ranks are not placed on nodes, boxes hold consecutive ranks")
    key = ("groups: ─▶ pp (stage order), ····· dp, - - - tp (a dashed frame on one node)"
           + (", ━━ ep (all-to-all)" if mesh.get("ep", 1) > 1 else "")
           + (f"\\nblue ─▶ (labelled cp) {_cp_method(pj)}; gradients summed over dp × cp" if cp > 1 else "")
           if every else
           "groups of rank 0 (each group alike, shifted): thick outline = its pp group, thick dashed outline = its "
           "dp group, dashed frame = its tp group on one node" + (", blue outline = its cp ring" if cp > 1 else ""))
    degrees = f"dp {mesh['dp']} × pp {mesh['pp']} × tp {mesh['tp']}" + (f" × cp {cp}" if cp > 1 else "")
    g = graphviz.Digraph("mesh", graph_attr={"rankdir": "TB", "fontname": "Helvetica", "nodesep": "0.15",
                         "label": f"mesh {degrees} = {mesh['world_size']} "
                         f"ranks, order {','.join(mesh['order'])} (inner → outer); {where}\\n"
                         f"box colour: pp rank (as the rows of schedule.png); {key}"
                         + (f"; first {MAX_RANKS} ranks" if mesh["world_size"] > MAX_RANKS else ""), "labelloc": "t"},
                         node_attr={"shape": "box", "style": "filled", "fontname": "Helvetica", "fontsize": "10"},
                         edge_attr={"fontname": "Helvetica", "fontsize": "9"})
    # a large mesh: rank 0's groups are marked on the boxes (edges would cross every node and reorder them)
    of_0 = {a: set(next((grp for grp in pj["groups"].get(a, []) if 0 in grp), [0])) for a in ("pp", "dp", "cp")}
    by_node: dict[int, list[dict]] = {}
    for r in ranks:
        by_node.setdefault(r["rank"] // per_box, []).append(r)
    tp_of = {r: i for i, grp in enumerate(pj["groups"]["tp"]) for r in grp}
    cp_of = {r: i for i, grp in enumerate(pj["groups"].get("cp", [])) for r in grp}
    first_last: dict[int, tuple[str, str]] = {}
    framed_groups: set[int] = set()
    for node, members in sorted(by_node.items()):
        # a tp group's ranks share a line; with tp 1 a cp group's, its ring drawn along it (a mesh whose groups
        # are drawn; a large one keeps a rank a line, so its nodes stay columns); else each rank its own
        lines: dict[tuple[str, int], list[dict]] = {}
        for r in members:
            line = (("tp", tp_of[r["rank"]]) if mesh["tp"] > 1 else ("cp", cp_of[r["rank"]]) if cp > 1 and every
                    else ("rank", r["rank"]))
            lines.setdefault(line, []).append(r)
        with g.subgraph(name=f"cluster_node{node}") as c:
            if stated:
                c.attr(label=f"node {node}", style="rounded", color="#555555")
            else:
                c.attr(label=f"ranks {members[0]['rank']}–{members[-1]['rank']}", style="dotted", color="#999999")
            heads = []
            for (kind, gi), rs in lines.items():
                framed = kind == "tp" and len(rs) == mesh["tp"]  # the whole group in this box
                if framed:
                    framed_groups.add(gi)
                with (c.subgraph(name=f"cluster_tp{gi}_n{node}") if framed else contextlib.nullcontext(c)) as t:
                    if framed:
                        t.attr(label=f"tp group {gi}", style="dashed", color="#555555")
                    with t.subgraph() as same:
                        same.attr(rank="same")
                        for r in rs:
                            ep = f" ep {r['ep']}" if "ep" in r else ""  # mesh ep > 1: which experts it holds
                            at = f" cp {r['cp']}" if cp > 1 else ""  # cp c: sequence chunks c and 2·cp−1−c
                            same.node(f"r{r['rank']}",
                                      f"r{r['rank']}\ndp {r['dp']} pp {r['pp']} tp {r['tp']}{at}{ep}",
                                      fillcolor=_colour(r["pp"]), **({} if every else _outline(r["rank"], of_0)))
                        for x, y in zip(rs, rs[1:]):  # an edge within a rank orders it left to right
                            same.edge(f"r{x['rank']}", f"r{y['rank']}", style="invis")
                heads.append(f"r{rs[0]['rank']}")
            for a, b in zip(heads, heads[1:]):  # the node's lines top to bottom
                c.edge(a, b, style="invis")
        first_last[node] = (heads[0], heads[-1])
    for node, (_, last) in first_last.items():  # wrap: box k + NODES_PER_ROW below box k
        below = first_last.get(node + NODES_PER_ROW)
        if below:
            g.edge(last, below[0], style="invis")
    for axis in ("pp", "dp", "tp", "ep", "cp") if every else ():
        drawn = [grp for grp in pj["groups"].get(axis, []) if len(grp) > 1]
        if axis == "tp":  # a framed tp group is drawn already
            drawn = [grp for grp in drawn if tp_of[grp[0]] not in framed_groups]
        _group_edges(g, axis, drawn, shown)
    return g


def _cp_method(pj: dict) -> str:
    """How the cp ranks exchange, for the mesh's key: ring attention's P2P hops, or Ulysses' all-to-alls."""
    if pj.get("context_parallel", {}).get("method", "ring") == "ring":
        return "cp ring: ring attention sends K/V blocks to the next rank"
    return "cp group: all-to-all attention (Ulysses) among its ranks"


def _outline(rank: int, of_0: dict[str, set[int]]) -> dict[str, str]:
    """The box of a rank in rank 0's pp group (thick), dp group (thick dashed), or both (rank 0: doubled);
    in rank 0's cp ring (a plan with cp > 1), thick and blue."""
    pp, dp, cp = rank in of_0["pp"], rank in of_0["dp"], len(of_0["cp"]) > 1 and rank in of_0["cp"]
    ink = {"color": CP_INK} if cp else {}
    if pp and dp:
        return {"penwidth": "3", "peripheries": "2", **ink}
    if pp:
        return {"penwidth": "3", **ink}
    return {"penwidth": "3", "style": "filled,dashed", **ink} if dp else {"penwidth": "3", **ink} if cp else {}


def _group_edges(g: graphviz.Digraph, axis: str, groups: list[list[int]], shown: set[int]) -> None:
    """Edges joining each group's ranks in order (for pp, stage 0 → 1 → …), styled and labelled by `axis`;
    they do not move the layout. A cp group is closed into its ring (the last rank sends to the first)."""
    for grp in groups:
        members = [r for r in grp if r in shown]
        pairs = list(zip(members, members[1:]))
        if axis == "cp" and len(members) == len(grp):
            pairs.append((members[-1], members[0]))
        for a, b in pairs:
            g.edge(f"r{a}", f"r{b}", label=axis, constraint="false", **EDGE[axis])


def _gpus_per_node(pj: dict) -> int | None:
    """The plan's `topology gpus_per_node=`, or None when the plan states no topology (nothing to place
    ranks on nodes with: 8 would be made up)."""
    from parc.grammar.parser import parse

    topo = parse(pj["plan"].get("source", ""), file=pj["plan"].get("file") or "plan.par").topology
    return topo.gpus_per_node if topo.span is not None else None


# ---------------------------------------------------------------- schedule timeline

def simulated_timeline(pj: dict) -> list[list[tuple[float, float, str, int, int]]]:
    """Per pp rank: (start, end, kind, stage, micro) of each compute action, from the simulator."""
    from parc.passes.schedule import COMPUTE, Schedule
    from parc.passes.simulate import simulate

    if "schedule" not in pj:
        raise ParcError("plan.json has no pipeline schedule (pp 1): nothing to draw as a timeline")
    sim = simulate(Schedule.from_json(pj["schedule"]))
    return [[(s, e, a.kind, a.stage, a.micro) for s, e, a in row if a.kind in COMPUTE] for row in sim.timeline]


def trace_events(timeline) -> list[dict]:
    """The Chrome-trace form of a timeline (unit = 1 ms), the format `--trace` reads."""
    return [{"name": f"{k}{m}", "ph": "X", "ts": s * 1000, "dur": (e - s) * 1000, "pid": r, "tid": r,
             "args": {"stage": st, "micro": m, "kind": k}}
            for r, row in enumerate(timeline) for s, e, k, st, m in row]


_ACTION = re.compile(r"([FBIW])\(s(\d+),m(\d+)\)$")  # str(Action) of a compute action: F(s0,m3)


def _compute_event(e) -> dict | None:
    """A complete (ph X) compute event with args kind/stage/micro, from either form this module reads:
    its own (args carry them) or parc.run's (the action's name carries them)."""
    if not isinstance(e, dict) or e.get("ph") != "X":
        return None
    args = e.get("args") if isinstance(e.get("args"), dict) else {}
    if args.get("kind") in ("F", "B", "I", "W"):
        return e
    hit = _ACTION.match(str(e.get("name", "")))
    if hit is None:
        return None
    return {**e, "args": {**args, "kind": hit[1], "stage": int(hit[2]), "micro": int(hit[3])}}


def _trace_acts(path: Path) -> list[dict]:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ParcError(f"cannot read trace {path}: {e}") from None
    events = data.get("traceEvents", []) if isinstance(data, dict) else data
    acts = [a for a in map(_compute_event, events if isinstance(events, list) else []) if a is not None]
    if not acts:
        raise ParcError(f"trace {path} has no complete events (ph X) of compute: args.kind F, B, I or W, "
                        "or names like F(s0,m3) as `parc.run --trace` writes them")
    return acts


def _trace_unit(acts: list[dict]) -> float:
    """The drawing's unit of time, µs: the median F duration (any action's without F)."""
    fs = [e["dur"] for e in acts if e["args"]["kind"] == "F"]
    return statistics.median(fs or [e["dur"] for e in acts])


def read_trace(path: Path) -> list[list[tuple[float, float, str, int, int]]]:
    """A measured Chrome trace → per-rank timeline in units of the median F duration."""
    acts = _trace_acts(path)
    unit, t0 = _trace_unit(acts), min(e["ts"] for e in acts)
    ranks = sorted({e.get("pid", e.get("tid", 0)) for e in acts})
    rows = {r: [] for r in ranks}
    for e in acts:
        a = e["args"]
        rows[e.get("pid", e.get("tid", 0))].append(((e["ts"] - t0) / unit, (e["ts"] - t0 + e["dur"]) / unit,
                                                   a["kind"], a.get("stage", 0), a.get("micro", 0)))
    return [sorted(rows[r]) for r in ranks]


def bubble(timeline) -> float:
    """1 − Σ compute / (ranks × makespan), the makespan from the first start to the last end: the formula
    `parc.run --trace` prints its measured bubble with (runtime/parallel/pipeline.py `measured_bubble`)."""
    busy = sum(e - s for row in timeline for s, e, *_ in row)
    span = max(e for row in timeline for _, e, *_ in row) - min(s for row in timeline for s, *_ in row)
    return 1 - busy / (len(timeline) * span) if span else 0.0


# The colours of the timeline. Hue means pp rank, as in mesh.png (`_colour`): a row's cells and its
# label share its pp rank's hue. Lightness (and the border) means the action's kind: each has a legend
# cell. I and W (ZB-H1 splits a backward into them) differ in lightness and border.
KINDS = {"F": ("forward", 0.86, "solid"), "B": ("backward", 0.42, "solid"),
         "I": ("backward to the input (ZB-H1)", 0.42, "solid"), "W": ("backward to the weights (ZB-H1)", 0.66, "dashed")}


def _cell_colour(pp_rank: int, kind: str) -> str:
    return _colour(pp_rank, lightness=KINDS[kind][1])


def _ink(kind: str) -> str:
    return "white" if KINDS[kind][1] < 0.5 else "black"


def _table(timeline, lo: int, hi: int, axis: tuple[str, float]) -> str:
    """An HTML-table label for time units [lo, hi): a row per pp rank, one cell per unit of time, so the
    drawing is to scale (graphviz sizes spanning cells loosely); an action spans its units (clipped to
    the window), named in its first (`F3`: kind and micro-batch), its inner borders hidden."""
    rows = [_axis(lo, hi, *axis)]
    for r, row in enumerate(timeline):
        cells, t = [f'<TD BORDER="0" WIDTH="{LABEL_PX}" BGCOLOR="{_colour(r)}"><FONT POINT-SIZE="{FONT_PT}">'
                    f'pp {r}</FONT></TD>'], lo
        for s, e, kind, _, micro in row:
            s, e = round(s), max(round(e), round(s) + 1)
            s, e = max(s, t), min(e, hi)  # overlaps (a measured trace) start where the last action ended
            if e <= s:
                continue
            cells += [_unit("white", border=False) for _ in range(s - t)]
            for u in range(s, e):
                sides = "TB" + ("L" if u == s else "") + ("R" if u == e - 1 else "")
                cells.append(_unit(_cell_colour(r, kind), f"{kind}{micro}" if u == s else "", sides, kind))
            t = e
        cells += [_unit("white", border=False) for _ in range(hi - t)]
        rows.append("<TR>" + "".join(cells) + "</TR>")
    return '<<TABLE BORDER="0" CELLBORDER="1" CELLSPACING="0" CELLPADDING="0">' + "".join(rows) + "</TABLE>>"


def _unit(colour: str, label: str = "", sides: str = "LRTB", kind: str | None = None, border: bool = True) -> str:
    """One unit of time on one rank: SLOT_PX wide, whatever it holds."""
    edge = f'SIDES="{sides}"' if border else 'BORDER="0"'
    style = f' STYLE="{KINDS[kind][2]}"' if kind and KINDS[kind][2] != "solid" else ""
    ink = _ink(kind) if kind else "black"
    return (f'<TD WIDTH="{SLOT_PX}" HEIGHT="{ROW_PX}" FIXEDSIZE="TRUE" {edge}{style} BGCOLOR="{colour}">'
            f'<FONT POINT-SIZE="{FONT_PT}" COLOR="{ink}">{label or " "}</FONT></TD>')


def _axis(lo: int, hi: int, name: str, per_unit: float) -> str:
    """The time axis: its name in the label column, a tick every AXIS_TICK units (and at lo) labelled
    with the time there (`per_unit` × units: units themselves, or milliseconds of a measured trace)."""
    cells = [f'<TD BORDER="0" WIDTH="{LABEL_PX}" ALIGN="RIGHT"><FONT POINT-SIZE="{FONT_PT}">{name}</FONT></TD>']
    for t in range(lo, hi):
        tick = t % AXIS_TICK == 0 or t == lo
        sides = 'SIDES="L"' if tick else 'BORDER="0"'
        cells.append(f'<TD WIDTH="{SLOT_PX}" HEIGHT="16" FIXEDSIZE="TRUE" {sides} ALIGN="LEFT">'
                     f'<FONT POINT-SIZE="{FONT_PT}">{f"{t * per_unit:.4g}" if tick else " "}</FONT></TD>')
    return "<TR>" + "".join(cells) + "</TR>"


def _legend(kinds: set[str]) -> str:
    """What the colours mean: one sample cell per kind drawn (pp rank 0's hue), idle, and the hue."""
    cells = []
    for k in [k for k in KINDS if k in kinds]:
        cells.append(_unit(_cell_colour(0, k), f"{k}3", kind=k))
        cells.append(f'<TD BORDER="0" ALIGN="LEFT"><FONT POINT-SIZE="{FONT_PT}"> {KINDS[k][0]} of micro-batch 3'
                     f'   </FONT></TD>')
    cells.append(_unit("white"))
    cells.append(f'<TD BORDER="0" ALIGN="LEFT"><FONT POINT-SIZE="{FONT_PT}"> idle: the bubble   </FONT></TD>')
    cells.append(f'<TD BORDER="0" ALIGN="LEFT"><FONT POINT-SIZE="{FONT_PT}">hue: the row\'s pp rank, as in '
                 f'mesh.png</FONT></TD>')
    return '<<TABLE BORDER="0" CELLBORDER="1" CELLSPACING="0" CELLPADDING="2"><TR>' + "".join(cells) + \
        "</TR></TABLE>>"


def _panels(g: graphviz.Digraph, name: str, title: str, timeline, axis: tuple[str, float]) -> list[str]:
    """The timeline in windows of PANEL_UNITS, stacked top to bottom, so a long step stays readable."""
    end = max((round(e) for row in timeline for _, e, *_ in row), default=1)
    names = []
    for k, lo in enumerate(range(0, end, PANEL_UNITS)):
        hi = min(lo + PANEL_UNITS, end)
        lines = title if k == 0 else title[:1]
        lines = [f"{lines[0]}{'' if k == 0 else ', continued'}: units {lo}…{hi}", *lines[1:]]
        # the title is a node of its own: in the grid's table it would widen its columns (not to scale)
        names += [f"{name}{k}_title", f"{name}{k}"]
        g.node(names[-2], "<" + '<BR ALIGN="LEFT"/>'.join(html.escape(t) for t in lines) + '<BR ALIGN="LEFT"/>>',
               fontsize=str(TITLE_PT))
        g.node(names[-1], _table(timeline, lo, hi, axis))
    return names


def schedule_graph(pj: dict, trace: Path | None = None, priced: tuple[str, float] | None = None
                   ) -> graphviz.Digraph:
    """The simulated schedule (unit costs), and under it the measured one of `trace`. `priced`: (hardware,
    bubble) of `parc report`, which prices each stage's F and B: its bubble is stated beside the drawn one."""
    from parc.passes.schedule import bubble_formula

    sch = pj["schedule"]
    sim = simulated_timeline(pj)
    pp, m, v = sch["pp"], sch["micro_batches"], sch["virtual"]
    g = graphviz.Digraph("schedule", graph_attr={"fontname": "Helvetica", "rankdir": "TB", "ranksep": "0.15"},
                         node_attr={"shape": "plaintext", "fontname": "Helvetica"})
    costs = "F = 1, I = W = 1" if {k for row in sim for *_, k, _, _ in row} & {"I", "W"} else "F = 1, B = 2"
    title = [f"planned: {sch['name']}, pp {pp}, {m} micro-batches, virtual {v}",
             f"simulated at unit costs ({costs}): bubble {bubble(sim):.1%} "
             f"(formula {bubble_formula(sch['name'], pp, m, v):.1%})"]
    if priced is not None:
        title.append(f"parc report prices each stage's F and B on {priced[0]}: bubble {priced[1]:.1%} "
                     f"(differs from {bubble(sim):.1%} when the stages' priced costs are not in the unit costs' ratio)")
    kinds = {k for row in sim for _, _, k, _, _ in row}
    names = _panels(g, "simulated", title, sim, ("units", 1.0))
    if trace is not None:
        acts = _trace_acts(trace)
        measured, unit_ms = read_trace(trace), _trace_unit(acts) / 1000
        kinds |= {k for row in measured for _, _, k, _, _ in row}
        names += _panels(g, "measured", [f"measured: {trace.name}",
                                         f"1 unit = the median F, {unit_ms:.3g} ms; axis in ms",
                                         f"measured bubble {bubble(measured):.3f} of the step (as parc.run prints "
                                         "it: 1 − compute / (pp × span))"], measured, ("ms", unit_ms))
    g.node("legend", _legend(kinds))
    names.insert(0, "legend")
    for a, b in zip(names, names[1:]):
        g.edge(a, b, style="invis")  # one column of panels
    return g


# ---------------------------------------------------------------- stages

COLLECTIVE = re.compile(r"torch\.ops\.parc\.([A-Za-z_0-9]+)")


def _runtime_collectives(mesh: dict, prog: dict) -> list[str]:
    """The data-parallel collectives the runtime issues for a program's gradient buckets (they are not
    calls in the program's text, which holds one micro-batch's forward and loss). Under context
    parallelism a gradient is summed over dp × cp (runtime/context.py `gradient_group`), even at dp 1."""
    cp = mesh.get("cp", 1)
    over, size = ("dp×cp", mesh["dp"] * cp) if cp > 1 else ("dp", mesh["dp"])
    if size == 1:
        return []
    z = prog.get("zero")
    if z is None:
        return [f"{over} all-reduce × {_count(len(prog.get('buckets', [])), 'bucket')} (runtime)"]
    n = len(z["buckets"])
    if z["stage"] == 3:  # its parameter all-gathers are zero_unshard calls in the program itself
        return [f"{over} reduce-scatter × {_count(n, 'bucket')} (runtime, ZeRO-3)"]
    return [f"{over} reduce-scatter × {_count(n, 'bucket')}, all-gather × {n} (runtime, ZeRO-{z['stage']})"]


def _cp_backward(mesh: dict, calls: dict[str, int]) -> list[str]:
    """What the backward of a program's cp attentions sends (autograd runs it: no line of the program
    names it), per attention: the ring's hops, or Ulysses' all-to-alls (docs/context-parallel.md)."""
    cp = mesh.get("cp", 1)
    lines = []
    if calls.get("ring_attention"):
        lines.append(f"backward: bwd_ring_attention × {calls['ring_attention']} (autograd): K, V, dK, dV "
                     f"{_count(cp - 1, 'hop')} round the cp ring (dK, dV summed on their way home)")
    if calls.get("ulysses_attention"):
        lines.append(f"backward: bwd_ulysses_attention × {calls['ulysses_attention']} (autograd): 7 all-to-alls "
                     "over cp each")
    return lines


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def stages_graph(pj: dict, programs: dict[str, str]) -> graphviz.Digraph:
    # a long pipeline runs top to bottom: side by side, 16 stages are a 13,000 px strip
    across = "LR" if len({p["stage"] for p in pj["programs"].values()}) <= 4 else "TB"
    g = graphviz.Digraph("stages", graph_attr={"rankdir": across, "compound": "true", "fontname": "Helvetica", "label":
                         "programs per stage: the torch.ops.parc.* collectives each one calls, and the dp ones the runtime adds\\n"
                         "fill: pp rank, as in mesh.png; arrows: the values sent, by the module that made them", "labelloc": "t"},
                         node_attr={"shape": "box", "fontname": "Helvetica", "style": "filled"},
                         edge_attr={"fontname": "Helvetica", "fontsize": "10"})
    stages = {d.get("index", 0): d for d in pj.get("stages", [{"index": 0}])}
    by_stage: dict[int, list[str]] = {}
    box: dict[str, str] = {}  # program -> the box that draws it
    for name, prog in sorted(pj["programs"].items(), key=lambda kv: (kv[1]["stage"], kv[1]["tp_rank"])):
        by_stage.setdefault(prog["stage"], []).append(name)
    for s, names in sorted(by_stage.items()):
        d = stages.get(s, {})
        label = f"stage {s} (pp rank {d.get('pp_rank', s)})"
        if d.get("first"):
            label += f"\\n{d['first']} … {d['last']}"
        with g.subgraph(name=f"cluster_s{s}") as c:
            c.attr(label=label, style="rounded")
            alike: dict[tuple[str, ...], list[str]] = {}  # the tp ranks of a stage most often run alike programs
            for name in names:
                alike.setdefault(tuple(_program_lines(pj, programs, name)), []).append(name)
            for lines, group in alike.items():
                head = group[0] if len(group) == 1 else f"{group[0]} … {group[-1]} ({len(group)} programs, alike)"
                for name in group:
                    box[name] = group[0]
                c.node(group[0], "\\n".join([head, *lines]), fillcolor=_colour(d.get("pp_rank", s), lightness=0.9))
    for s, names in sorted(by_stage.items()):
        nxt = by_stage.get(s + 1)
        if not nxt:
            continue
        sends = pj["programs"][names[0]].get("send", [])
        label = "\\n".join(_value_label(d) for d in sends[:3]) + ("\\n…" if len(sends) > 3 else "")
        # from frame to frame (compound): an arrow into a box would cross its stage's title
        g.edge(box[names[0]], box[nxt[0]], label=label or "send", ltail=f"cluster_s{s}", lhead=f"cluster_s{s + 1}")
    return g


def _program_lines(pj: dict, programs: dict[str, str], name: str) -> list[str]:
    """A program's box below its name: the collectives it calls, the runtime's dp ones, what it recomputes."""
    calls: dict[str, int] = {}
    for op in COLLECTIVE.findall(programs.get(name, "")):
        calls[op] = calls.get(op, 0) + 1
    lines = [f"{op} × {n}" for op, n in sorted(calls.items())]
    lines += _cp_backward(pj["mesh"], calls)
    lines += _runtime_collectives(pj["mesh"], pj["programs"][name])
    if not lines:
        lines.append("(no collectives)")
    recomputed = pj["programs"][name].get("recompute") or []
    if recomputed:
        lines.append(f"recomputed: {recomputed[0]} … {recomputed[-1]} ({len(recomputed)})"
                     if len(recomputed) > 1 else f"recomputed: {recomputed[0]}")
    return lines


def _value_label(d: dict) -> str:
    """A value sent to the next stage, by the module that made it (plan.json `module`: `blocks.1 (2, 16, 64)`);
    a value of the model's own forward, or an artifact from before `module` was recorded, by its node name; a
    batch input that context parallelism cut (`cp_shard` node, e.g. the targets the last stage's loss reads) as such."""
    shape = tuple(d["shape"])
    if d["name"].startswith("cp_shard"):  # a batch input cut for this cp rank (its targets, for the last stage)
        return f"a batch input, this cp rank's tokens {shape}"
    if d.get("module"):
        return f"{d['module']} {shape}"
    return f"{d['name']} {shape} (the model's own forward)" if "module" in d else f"{d['name']} {shape}"


# ---------------------------------------------------------------- entry

def draw_all(compiled: Path, out: Path, *, trace: Path | None = None, fmt: str = "both") -> list[Path]:
    from parc import artifact

    if shutil.which("dot") is None:  # checked first: graphviz would fail mid-way and leave a stray source file
        raise ParcError("parc viz draws with graphviz's `dot` program, which is not on PATH",
                        hint="install graphviz: apt-get install graphviz (Debian, Ubuntu), brew install graphviz "
                             "(macOS) or conda install graphviz; the Python package alone is not enough")
    art = artifact.load(compiled)
    pj, out = art.plan, Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = _render(mesh_graph(pj), out, "mesh", fmt)
    if "schedule" in pj:
        paths += _render(schedule_graph(pj, trace, _priced_bubble(compiled)), out, "schedule", fmt)
        events = out / "schedule.trace.json"
        events.write_text(json.dumps({"traceEvents": trace_events(simulated_timeline(pj))}))
        paths.append(events)
    elif trace is not None:
        raise ParcError("--trace needs a pipelined plan (pp > 1): this plan.json has no schedule")
    paths += _render(stages_graph(pj, art.programs), out, "stages", fmt)
    return paths


def _priced_bubble(compiled: Path) -> tuple[str, float]:
    """(hardware, schedule bubble) as `parc report compiled/` prints them: each stage's F and B priced on the
    plan's preset (h100 without one), P2P free."""
    from parc.analysis import report

    rep = report.build(compiled)
    return rep["hardware"]["name"], rep["utilization"]["schedule_bubble"]

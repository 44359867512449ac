"""`parc viz compiled/ -o DIR`: Graphviz drawings of a compiled plan (SVG and PNG).

Start at `draw_all`. It writes three drawings, each from plan.json alone:

- `mesh`: the ranks placed on nodes (rank // gpus_per_node), each box naming its
  rank and (dp, pp, tp) coordinates, coloured by pp rank; a dashed frame around
  every tp group that shares a node. Nodes sit side by side, 8 to a row; meshes
  over 256 ranks draw their first 256.
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
PANEL_UNITS = 80  # time units per panel: 80 × 18 px fits a screen
AXIS_TICK = 10  # a labelled tick on the time axis every 10 units
SLOT_PX = 18  # width of one time unit in the timeline: fits a two-digit micro-batch at 7 pt


def _colour(i: int, n: int, dark: bool = False) -> str:
    """A distinct hue per micro-batch (golden-ratio steps so neighbours differ), darker for backward."""
    h = (i * 0.618033988749895) % 1.0
    r, g, b = colorsys.hls_to_rgb(h, 0.42 if dark else 0.72, 0.75)
    return f"#{int(r * 255):02x}{int(g * 255):02x}{int(b * 255):02x}"


def _render(g: graphviz.Digraph, out: Path, name: str, fmt: str) -> list[Path]:
    formats = ("svg", "png") if fmt == "both" else (fmt,)
    paths = []
    for f in formats:
        g.format = f
        paths.append(Path(g.render(filename=name, directory=str(out), cleanup=True)))
    return paths


# ---------------------------------------------------------------- mesh

def mesh_graph(pj: dict) -> graphviz.Digraph:
    """Nodes side by side, NODES_PER_ROW to a row; in a node, one line per tp group (or per rank)."""
    mesh, ranks = pj["mesh"], pj["ranks"][:MAX_RANKS]
    gpn = _gpus_per_node(pj)
    g = graphviz.Digraph("mesh", graph_attr={"rankdir": "TB", "fontname": "Helvetica", "nodesep": "0.15",
                         "label": f"mesh dp {mesh['dp']} × pp {mesh['pp']} × tp {mesh['tp']} = {mesh['world_size']} "
                         f"ranks, order {','.join(mesh['order'])} (inner → outer), {gpn} GPUs per node; "
                         f"colour = pp rank" + _ep_label(mesh) + (f"; first {MAX_RANKS} ranks" if mesh["world_size"] > MAX_RANKS
                                               else ""), "labelloc": "t"},
                         node_attr={"shape": "box", "style": "filled", "fontname": "Helvetica", "fontsize": "10"})
    by_node: dict[int, list[dict]] = {}
    for r in ranks:
        by_node.setdefault(r["rank"] // gpn, []).append(r)
    tp_of = {r: i for i, grp in enumerate(pj["groups"]["tp"]) for r in grp}
    first_last: dict[int, tuple[str, str]] = {}
    for node, members in sorted(by_node.items()):
        lines: dict[int, list[dict]] = {}  # a tp group's ranks share a line; with tp 1 every rank has its own
        for r in members:
            lines.setdefault(tp_of[r["rank"]] if mesh["tp"] > 1 else r["rank"], []).append(r)
        with g.subgraph(name=f"cluster_node{node}") as c:
            c.attr(label=f"node {node}", style="rounded", color="#555555")
            heads = []
            for gi, rs in lines.items():
                framed = mesh["tp"] > 1 and len(rs) > 1
                with (c.subgraph(name=f"cluster_tp{gi}_n{node}") if framed else contextlib.nullcontext(c)) as t:
                    if framed:
                        t.attr(label=f"tp group {gi}", style="dashed", color="#888888")
                    with t.subgraph() as same:
                        same.attr(rank="same")
                        for r in rs:
                            ep = f" ep {r['ep']}" if "ep" in r else ""  # mesh ep > 1: which experts it holds
                            same.node(f"r{r['rank']}", f"r{r['rank']}\ndp {r['dp']} pp {r['pp']} tp {r['tp']}{ep}",
                                      fillcolor=_colour(r["pp"], mesh["pp"]))
                        for x, y in zip(rs, rs[1:]):  # an edge within a rank orders it left to right
                            same.edge(f"r{x['rank']}", f"r{y['rank']}", style="invis")
                heads.append(f"r{rs[0]['rank']}")
            for a, b in zip(heads, heads[1:]):  # the node's lines top to bottom
                c.edge(a, b, style="invis")
        first_last[node] = (heads[0], heads[-1])
    _ep_edges(g, pj, {r["rank"] for r in ranks})
    for node, (_, last) in first_last.items():  # wrap: node k + NODES_PER_ROW below node k
        below = first_last.get(node + NODES_PER_ROW)
        if below:
            g.edge(last, below[0], style="invis")
    return g


def _ep_label(mesh: dict) -> str:
    return f"; red dashed: ep groups of {mesh['ep']} (all-to-all)" if mesh.get("ep", 1) > 1 else ""


def _ep_edges(g: graphviz.Digraph, pj: dict, shown: set[int]) -> None:
    """mesh ep > 1: a red dashed edge joins the ranks of each ep group (they exchange tokens by all-to-all,
    docs/moe.md); the edges do not move the layout."""
    for grp in pj["groups"].get("ep", []):
        members = [r for r in grp if r in shown]
        for a, b in zip(members, members[1:]):
            g.edge(f"r{a}", f"r{b}", label="ep", color="#cc3333", fontcolor="#cc3333", style="dashed",
                   constraint="false", dir="none")


def _gpus_per_node(pj: dict) -> int:
    m = re.search(r"gpus_per_node=(\d+)", pj["plan"].get("source", ""))
    return int(m.group(1)) if m else 8


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


def read_trace(path: Path) -> list[list[tuple[float, float, str, int, int]]]:
    """A measured Chrome trace → per-rank timeline in units of the median F duration."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ParcError(f"cannot read trace {path}: {e}") from None
    events = data.get("traceEvents", []) if isinstance(data, dict) else data
    acts = [a for a in map(_compute_event, events if isinstance(events, list) else []) if a is not None]
    if not acts:
        raise ParcError(f"trace {path} has no complete events (ph X) of compute: args.kind F, B, I or W, "
                        "or names like F(s0,m3) as `parc.run --trace` writes them")
    unit = statistics.median(e["dur"] for e in acts if e["args"]["kind"] == "F") if any(
        e["args"]["kind"] == "F" for e in acts) else statistics.median(e["dur"] for e in acts)
    t0 = min(e["ts"] for e in acts)
    ranks = sorted({e.get("pid", e.get("tid", 0)) for e in acts})
    rows = {r: [] for r in ranks}
    for e in acts:
        a = e["args"]
        rows[e.get("pid", e.get("tid", 0))].append(((e["ts"] - t0) / unit, (e["ts"] - t0 + e["dur"]) / unit,
                                                   a["kind"], a.get("stage", 0), a.get("micro", 0)))
    return [sorted(rows[r]) for r in ranks]


def _table(timeline, m: int, lo: int, hi: int) -> str:
    """An HTML-table label for time units [lo, hi): a row per rank, one cell per unit of time, so the
    drawing is to scale (graphviz sizes spanning cells loosely); an action spans its units (clipped to
    the window), its label in the first, its inner borders hidden."""
    rows = [_axis(lo, hi)]
    for r, row in enumerate(timeline):
        cells, t = [f'<TD BORDER="0" WIDTH="40">r{r}</TD>'], lo
        for s, e, kind, _, micro in row:
            s, e = round(s), max(round(e), round(s) + 1)
            s, e = max(s, t), min(e, hi)  # overlaps (a measured trace) start where the last action ended
            if e <= s:
                continue
            cells += [_unit("white", border=False) for _ in range(s - t)]
            label = f"{kind}{micro}" if e - s > 1 else f"{micro}"  # one-unit cells: the number only
            colour = _colour(micro, m, dark=kind != "F")
            for u in range(s, e):
                sides = "TB" + ("L" if u == s else "") + ("R" if u == e - 1 else "")
                cells.append(_unit(colour, label if u == s else "", sides))
            t = e
        cells += [_unit("white", border=False) for _ in range(hi - t)]
        rows.append("<TR>" + "".join(cells) + "</TR>")
    return '<<TABLE BORDER="0" CELLBORDER="1" CELLSPACING="0" CELLPADDING="0">' + "".join(rows) + "</TABLE>>"


def _unit(colour: str, label: str = "", sides: str = "LRTB", border: bool = True) -> str:
    """One unit of time on one rank: SLOT_PX wide, whatever it holds."""
    edge = f'SIDES="{sides}"' if border else 'BORDER="0"'
    return (f'<TD WIDTH="{SLOT_PX}" HEIGHT="22" FIXEDSIZE="TRUE" {edge} BGCOLOR="{colour}">'
            f'<FONT POINT-SIZE="7">{label or " "}</FONT></TD>')


def _axis(lo: int, hi: int) -> str:
    """The time axis: a tick labelled with its unit every AXIS_TICK units (the first at lo)."""
    cells = ['<TD BORDER="0" WIDTH="40"><FONT POINT-SIZE="7">time</FONT></TD>']
    for t in range(lo, hi):
        tick = t % AXIS_TICK == 0 or t == lo
        cells.append(f'<TD WIDTH="{SLOT_PX}" HEIGHT="12" FIXEDSIZE="TRUE" BORDER="0" ALIGN="LEFT">'
                     f'<FONT POINT-SIZE="7">{t if tick else " "}</FONT></TD>')
    return "<TR>" + "".join(cells) + "</TR>"


def _panels(g: graphviz.Digraph, name: str, title: str, timeline, m: int) -> list[str]:
    """The timeline in windows of PANEL_UNITS, stacked top to bottom, so a long step stays readable."""
    end = max((round(e) for row in timeline for _, e, *_ in row), default=1)
    names = []
    for k, lo in enumerate(range(0, end, PANEL_UNITS)):
        hi = min(lo + PANEL_UNITS, end)
        head = title if k == 0 else f"{title.split(':')[0]}, continued"
        # the title is a node of its own: in the grid's table it would widen its columns (not to scale)
        names += [f"{name}{k}_title", f"{name}{k}"]
        g.node(names[-2], f"<<B>{html.escape(f'{head}  [t {lo}…{hi}]')}</B>>")
        g.node(names[-1], _table(timeline, m, lo, hi))
    return names


def schedule_graph(pj: dict, trace: Path | None = None) -> graphviz.Digraph:
    from parc.passes.schedule import bubble_formula

    sch = pj["schedule"]
    sim = simulated_timeline(pj)
    pp, m, v = sch["pp"], sch["micro_batches"], sch["virtual"]
    g = graphviz.Digraph("schedule", graph_attr={"fontname": "Helvetica", "rankdir": "TB", "ranksep": "0.15"},
                         node_attr={"shape": "plaintext", "fontname": "Helvetica"})
    busy = sum(e - s for row in sim for s, e, *_ in row)
    span = max(e for row in sim for _, e, *_ in row)
    title = (f"simulated {sch['name']}: pp {pp}, {m} micro-batches, virtual {v}; F = 1, B = 2 units; "
             f"bubble {1 - busy / (pp * span):.1%} (formula {bubble_formula(sch['name'], pp, m, v):.1%})")
    names = _panels(g, "simulated", title, sim, m)
    if trace is not None:
        names += _panels(g, "measured", f"measured: {trace.name} (unit = median F duration)", read_trace(trace), m)
    for a, b in zip(names, names[1:]):
        g.edge(a, b, style="invis")  # one column of panels
    return g


# ---------------------------------------------------------------- stages

COLLECTIVE = re.compile(r"torch\.ops\.parc\.([A-Za-z_0-9]+)")


def _runtime_collectives(dp: int, prog: dict) -> list[str]:
    """The data-parallel collectives the runtime issues for a program's gradient buckets (they are not
    calls in the program's text, which holds one micro-batch's forward and loss)."""
    if dp == 1:
        return []
    z = prog.get("zero")
    if z is None:
        return [f"dp all-reduce × {_count(len(prog.get('buckets', [])), 'bucket')} (runtime)"]
    n = len(z["buckets"])
    if z["stage"] == 3:  # its parameter all-gathers are zero_unshard calls in the program itself
        return [f"dp reduce-scatter × {_count(n, 'bucket')} (runtime, ZeRO-3)"]
    return [f"dp reduce-scatter × {_count(n, 'bucket')}, all-gather × {n} (runtime, ZeRO-{z['stage']})"]


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def stages_graph(pj: dict, programs: dict[str, str]) -> graphviz.Digraph:
    g = graphviz.Digraph("stages", graph_attr={"rankdir": "LR", "fontname": "Helvetica", "label":
                         "programs per stage: the torch.ops.parc.* collectives each one calls, and the dp ones the runtime adds", "labelloc": "t"},
                         node_attr={"shape": "box", "fontname": "Helvetica", "style": "filled",
                                    "fillcolor": "#eef3fb"})
    stages = {d.get("index", 0): d for d in pj.get("stages", [{"index": 0}])}
    by_stage: dict[int, list[str]] = {}
    for name, prog in sorted(pj["programs"].items(), key=lambda kv: (kv[1]["stage"], kv[1]["tp_rank"])):
        by_stage.setdefault(prog["stage"], []).append(name)
    for s, names in sorted(by_stage.items()):
        d = stages.get(s, {})
        label = f"stage {s} (pp rank {d.get('pp_rank', s)})"
        if d.get("first"):
            label += f"\\n{d['first']} … {d['last']}"
        with g.subgraph(name=f"cluster_s{s}") as c:
            c.attr(label=label, style="rounded")
            for name in names:
                calls: dict[str, int] = {}
                for op in COLLECTIVE.findall(programs.get(name, "")):
                    calls[op] = calls.get(op, 0) + 1
                lines = [name] + [f"{op} × {n}" for op, n in sorted(calls.items())]
                lines += _runtime_collectives(pj["mesh"]["dp"], pj["programs"][name])
                if len(lines) == 1:
                    lines.append("(no collectives)")
                recomputed = pj["programs"][name].get("recompute") or []
                if recomputed:
                    lines.append(f"recomputed: {recomputed[0]} … {recomputed[-1]} ({len(recomputed)})"
                                 if len(recomputed) > 1 else f"recomputed: {recomputed[0]}")
                c.node(name, "\\n".join(lines))
    for s, names in sorted(by_stage.items()):
        nxt = by_stage.get(s + 1)
        if not nxt:
            continue
        sends = pj["programs"][names[0]].get("send", [])
        label = ", ".join(f"{d['name']} {tuple(d['shape'])}" for d in sends[:3]) + (" …" if len(sends) > 3 else "")
        g.edge(names[0], nxt[0], label=label or "send", fontsize="10")
    return g


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
        paths += _render(schedule_graph(pj, trace), out, "schedule", fmt)
        events = out / "schedule.trace.json"
        events.write_text(json.dumps({"traceEvents": trace_events(simulated_timeline(pj))}))
        paths.append(events)
    elif trace is not None:
        raise ParcError("--trace needs a pipelined plan (pp > 1): this plan.json has no schedule")
    paths += _render(stages_graph(pj, art.programs), out, "stages", fmt)
    return paths

"""The HTML report: content, escaping and caps, and a real headless Chromium rendering it.

The browser tests (``slow``) drive Debian's ``/usr/bin/chromium`` with playwright-python
(``.ci/install-browser`` installs it); they skip, saying why, when either is missing.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import polars as pl
import pytest
from prism_trace.analysis.report.data import lane_quotas, rank_ranges
from prism_trace.analysis.report.figures import ms_text, time_unit
from prism_trace.analysis.report.html import DRAWN_JS, ReportSummary, write_report
from prism_trace.analysis.report.packed import (
    pack,
    page_figures,
    plotly_js_packed,
    unpack,
    unpack_script,
)
from prism_trace.analysis.report.sections import ReportLimits
from prism_trace.replay import emulate_run

from prism_trace.errors import RunNotFoundError
from prism_trace.ingestion.pipeline import ingest
from prism_trace.layout.mesh import ParallelLayout
from prism_trace.slicing.slicer import slice_run
from prism_trace.store.connection import Store, open_store

# Slow: writes reports and drives a headless browser; `scripts/test -m "not slow"` leaves it out.
pytestmark = pytest.mark.slow

CHROMIUM = os.environ.get("PRISM_CHROMIUM", "/usr/bin/chromium")
NASTY = "<script>alert(1)</script> \"quotes\" & 'apos'"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory, sample_template: Path) -> Store:
    """The sample (`sample`, one op and one thread renamed to hostile strings), sliced to 8192
    ranks (`big`) and emulated (`big_emu`), and the sample emulated as is (`sample_emu`)."""
    db = tmp_path_factory.mktemp("report") / "s.duckdb"
    shutil.copyfile(sample_template, db)  # the sample, ingested once per test run
    with open_store(db) as s:
        rid = s.require_run("sample")
        s.con.execute(
            "UPDATE event SET name = $2 WHERE run_id = $1 AND rank = 0 AND event_id = 0",
            [rid, NASTY],
        )
        s.con.execute(
            "UPDATE track SET name = $2 WHERE run_id = $1 AND rank = 0 AND track_id = 0",
            [rid, NASTY],
        )
        slice_run(
            s,
            run="sample",
            layout=ParallelLayout.parse("tp=2,dp=2048,pp=2"),
            world=8192,
            out_run="big",
        )
        emulate_run(s, run="big", out_run="big_emu")
        emulate_run(s, run="sample", out_run="sample_emu")
    return open_store(db, read_only=True)


def test_rank_ranges() -> None:
    assert rank_ranges([0, 2, 4, 6, 8]) == "0..8 step 2"
    assert rank_ranges([5, 1, 3, 8, 9, 10, 11]) == "1..5 step 2, 8..11"
    assert rank_ranges([7]) == "7"
    assert rank_ranges([*list(range(0, 40, 2)), 41, 50, 60, 61, 70, 99]).endswith("...")


def test_sample_report_contents(store: Store, tmp_path: Path) -> None:
    out = tmp_path / "r.html"
    rep = write_report(store, run="sample", out=out)
    assert isinstance(rep, ReportSummary)
    assert rep.figures == ["timeline", "temporal", "ops", "waits", "iterations", "memory"]
    assert rep.lane_groups == 8
    assert rep.events == 44880
    assert rep.events_drawn == ReportLimits().timeline_events
    assert rep.compare is None
    page = out.read_text()
    assert rep.bytes == out.stat().st_size
    # plotly.js packed exactly once, nothing fetched from a CDN.
    assert page.count('id="prism-plotly"') == 1
    assert re.findall(r"<script[^>]*\bsrc=", page) == []
    assert page.count("class='prism-fig'") == 6  # one per section (the CPU sample has no kernels)
    assert len(page_figures(page)) == 6
    assert rep.bytes <= 2 * 2**20  # 8 ranks, 30 000 bars drawn (was 7.2 MiB)
    text = _text(page)
    # Trace strings never reach the page as markup.
    assert "<script>alert(1)" not in text
    assert "&lt;script&gt;alert(1)&lt;" in text
    assert "timeline: 30000 of 44880 events drawn" in text
    assert "peak" in text


def _text(page: str) -> str:
    """The page's HTML and the JSON of the figures it packs: what a reader of it sees."""
    return page + json.dumps(page_figures(page), separators=(",", ":"))


def test_packing_round_trips_with_html_safe_text() -> None:
    """Packed text never holds a character that means something in HTML or a JS string, and
    unpacks to the bytes it packed, whatever their length (the page cuts the padding)."""
    for data in (b"", b"x", b"\0" * 7, bytes(range(256)) * 41, b"plotly" * 10_001):
        text, length = pack(data)
        assert not set(text) & set("<>&\"'`\\/$ \n")
        assert unpack(text, length) == data
    # the timeline's bar starts travel as differences of whole units; the page sums them back
    starts = [round(0.001 * i * i, 3) for i in range(500)] + [1e6 + 0.123456]
    fig = {"data": [{"type": "bar", "base": starts, "x": [1.0] * len(starts)}], "layout": {}}
    page = unpack_script([fig], {})
    assert '"prism_delta"' not in page  # packed, not plain
    assert page_figures(page) == [fig]
    js, _ = plotly_js_packed()
    assert len(js) < 0.42 * 4_815_814  # plotly.min.js, 4.6 MiB as plotly.py ships it


@pytest.mark.shared_data
def test_dlrm_report_is_at_most_2_mib(tmp_path: Path, dlrm_hta_template: Path) -> None:
    """The 8-rank DLRM report, every event drawn, fits in 2 MiB (was 6.2 MiB: plotly.js alone
    was 4.6 MiB); a one-rank run's waits say why there are none instead of a blank map."""
    with open_store(dlrm_hta_template, read_only=True) as s:
        rep = write_report(s, run="dlrm", out=tmp_path / "dlrm.html")
        assert rep.events_drawn == rep.events == 19781
        assert rep.bytes <= 2 * 2**20, rep.bytes
        one = write_report(s, run="hta", out=tmp_path / "hta.html")
    assert "waits" not in one.figures
    page = (tmp_path / "hta.html").read_text()
    assert "No waits to show: the run has one rank" in page
    assert any("collective waits: none to show" in n for n in one.notes)


def test_lane_quotas_keep_every_lane() -> None:
    counts = pl.DataFrame(
        {"rank": [0, 0, 0, 1], "track_id": [0, 1, 2, 0], "n": [10_000, 40, 5_000, 7]},
        schema={"rank": pl.Int32, "track_id": pl.Int32, "n": pl.Int64},
    )
    q = {(r, t): n for r, t, n in lane_quotas(counts, 1000).iter_rows()}
    assert q[(0, 1)] == 40  # a small lane keeps all its events
    assert q[(0, 0)] == q[(0, 2)] == 480  # the rest is shared equally
    assert sum(v for k, v in q.items() if k[0] == 0) <= 1000
    assert q[(1, 0)] == 7
    tiny = lane_quotas(counts, 2)  # fewer events than lanes: every lane still keeps one
    assert (tiny.filter(pl.col("rank") == 0)["quota"] >= 1).all()


def test_units_and_ms_text() -> None:
    assert time_unit(9e9) == (1e6, "ms")
    assert time_unit(70e9) == (1e9, "s")
    assert ms_text(1234567) == "1.23 ms"
    assert ms_text(4120) == "0.00412 ms"
    assert ms_text(2_345_600_000) == "2346 ms"
    assert ms_text(None) == "-"


def test_report_lanes_colours_and_kernels(
    store: Store, tmp_path: Path, sample_template: Path
) -> None:
    """Negative Kineto thread ids read unsigned; comm kernels have their own colour; an
    emulated run's kernels are weighted by class size."""
    from prism_trace.analysis.report.data import timeline_tracks

    shutil.copyfile(sample_template, tmp_path / "t.duckdb")  # the sample, ingested once per run
    with open_store(tmp_path / "t.duckdb") as s:
        rid = s.require_run("sample")
        s.con.execute(
            "UPDATE track SET tid = -549452224, name = NULL WHERE run_id = $1 AND rank = 0"
            " AND track_id = 0",
            [rid],
        )
        names = timeline_tracks(s, rid, [0])["name"].to_list()
    assert "thread 3745515072" in names
    assert not any("-" in n.split(" ")[1] for n in names if n.startswith("thread"))


def test_emulated_report_classes_and_compare(store: Store, tmp_path: Path) -> None:
    out = tmp_path / "big.html"
    rep = write_report(store, run="big_emu", out=out)
    assert rep.compare == "sample"  # emulated → the recorded run it came from
    assert rep.lane_groups == 4
    assert rep.events == rep.events_drawn
    assert "iterations" in rep.figures
    text = _text(out.read_text())
    assert "class 0: ranks 0..4094 step 2 (2048)" in text
    assert "4 equivalence classes stand for 8192 ranks" in text
    assert rep.bytes < 20 * 2**20
    # the report's work is its 4 classes' (the time it takes is benchmarks/bench_report.py's):
    # every timed event of the run is its exemplars', and those are all it read to draw
    timed = store.con.execute(
        "SELECT count(*), count(DISTINCT rank) FROM event WHERE run_id = $1 AND ts IS NOT NULL",
        [store.require_run("big_emu")],
    ).fetchall()
    assert timed == [(rep.events, 4)]
    # memory: one line per class, named with its ranks
    assert "class 4096: ranks 4096..8190 step 2 (2048) cpu:-1" in text
    # the waits heatmap has one row per class, named with its ranks, and a 0-based scale
    assert '"zmin":0.0' in text.replace(" ", "")


def test_compare_and_caps(store: Store, tmp_path: Path) -> None:
    limits = ReportLimits(timeline_events=800, timeline_groups=3, memory_lines=2, heatmap_cells=40)
    rep = write_report(
        store, run="sample", out=tmp_path / "c.html", compare="sample_emu", limits=limits
    )
    assert rep.compare == "sample_emu"
    assert rep.lane_groups == 3
    assert rep.events_drawn <= 800
    joined = "\n".join(rep.notes)
    assert "3 of 8 lane groups drawn" in joined
    # the 3 drawn groups cover both pipeline stages of the sample (ranks 0-3: pp 0, 4-7: pp 1)
    assert "omitted rank 1, rank 2, rank 3, rank 5, rank 6" in joined
    assert "memory: 2 of 8" in joined
    assert re.search(r"collective waits: \d+ of 232 instances", joined)  # 168 coll. + 64 p2p
    assert rep.summary().startswith("report of run 'sample' vs 'sample_emu'")
    # The run diff section: every op of the sample aligns with its emulation through the graph.
    text = (tmp_path / "c.html").read_text()
    diff = text[text.index("Run diff</h2>") :]
    assert re.search(r"\d+ ops aligned \(node\)", diff[:2000])
    assert "<h3>Top contributors</h3>" in diff
    # tables in ms with 3 significant digits, not raw ns with long decimals
    tables = diff[: diff.index("</section>")]
    assert "<th>shift (ms)</th>" in tables
    assert "<th>dur_diff (ms)</th>" in tables
    assert not re.search(r"<td>-?\d+\.\d{6,}</td>", tables)
    assert "e+0" not in tables


def test_unknown_run(store: Store, tmp_path: Path) -> None:
    with pytest.raises(RunNotFoundError, match="nope"):
        write_report(store, run="nope", out=tmp_path / "x.html")
    with pytest.raises(RunNotFoundError, match="nope"):
        write_report(store, run="sample", out=tmp_path / "x.html", compare="nope")
    assert not (tmp_path / "x.html").exists()


# --- the browser -------------------------------------------------------------------------------


_PIXEL_STATS = """
async (pngs) => {
  // Each PNG (base64) decoded by the browser's image decoder, no colour conversion: distinct
  // colours of every other pixel, and the share of those pixels that are not near-white.
  const out = [];
  for (const b64 of pngs) {
    const bytes = Uint8Array.from(atob(b64), c => c.charCodeAt(0));
    const bmp = await createImageBitmap(new Blob([bytes], {type: 'image/png'}),
                                        {colorSpaceConversion: 'none', premultiplyAlpha: 'none'});
    const canvas = new OffscreenCanvas(bmp.width, bmp.height);
    const g = canvas.getContext('2d', {willReadFrequently: true});
    g.drawImage(bmp, 0, 0);
    const px = g.getImageData(0, 0, bmp.width, bmp.height).data;  // RGBA
    const seen = new Set();
    let ink = 0;
    for (let i = 0; i < px.length; i += 8) {
      const r = px[i], gr = px[i + 1], b = px[i + 2];
      seen.add((r << 16) | (gr << 8) | b);
      if (Math.min(r, gr, b) < 235) ink++;
    }
    out.push([seen.size, ink / (bmp.width * bmp.height / 2)]);
  }
  return out;
}
"""


def png_stats(browser: Any, paths: list[Path]) -> list[tuple[int, float]]:
    """Distinct colours, and the share of pixels that are not near-white, of each PNG.

    The browser decodes them (a blank page of its own, native code): a decoder in Python spent
    seconds per report on the rows Chromium's encoder filters with Paeth or Average.
    """
    import base64

    page = browser.new_page()
    try:
        pngs = [base64.b64encode(p.read_bytes()).decode() for p in paths]
        return [(int(n), float(ink)) for n, ink in page.evaluate(_PIXEL_STATS, pngs)]
    finally:
        page.close()


_CHECK_PLOTS = """
() => Array.from(document.querySelectorAll('.js-plotly-plot')).map(gd => {
  const r = gd.getBoundingClientRect();
  const svg = gd.querySelector('svg.main-svg');
  const sr = svg ? svg.getBoundingClientRect() : {width: 0, height: 0};
  const points = (gd.calcdata || []).reduce((n, cd) => n + cd.length, 0);
  const marks = gd.querySelectorAll(
      '.bars path, .scatterlayer path.js-line, .scatterlayer .point, .hm image, .heatmaplayer image'
  ).length;
  return {id: gd.id, traces: (gd.data || []).length, points, width: r.width, height: r.height,
          svg_w: sr.width, svg_h: sr.height, marks, section: gd.closest('section')?.id};
})
"""


_CHART_DATA = """
() => {
  // Numbers of an array, a typed array (plotly decodes base64 data into those) or nested arrays.
  const flat = v => {
    if (v == null) return [];
    if (ArrayBuffer.isView(v)) return Array.from(v);
    if (Array.isArray(v)) return v.flatMap(flat);
    return [v];
  };
  const num = a => a.filter(v => typeof v === 'number' && isFinite(v));
  return Array.from(document.querySelectorAll('.js-plotly-plot')).map(gd => {
    // What each chart draws (plotly's resolved traces): finite values and their spread.
    const data = gd._fullData || gd.data || [];
    const vals = [];
    for (const t of data) {
      const arrs = t.type === 'heatmap' ? flat(t.z) : [].concat(flat(t.x), flat(t.y));
      vals.push(...num(arrs));
    }
    const heat = data.filter(t => t.type === 'heatmap').map(t => {
      const z = num(flat(t.z));
      return {n: z.length, min: Math.min(...z), max: Math.max(...z), zmin: t.zmin, zmax: t.zmax};
    });
    let lo = Infinity, hi = -Infinity;
    for (const v of vals) { if (v < lo) lo = v; if (v > hi) hi = v; }
    return {section: gd.closest('section')?.id, finite: vals.length,
            spread: vals.length ? hi - lo : 0, heat};
  });
}
"""


@pytest.fixture(scope="module")
def browser() -> Any:
    """One headless Chromium for the module's browser tests (each opens its own context)."""
    sync_api = pytest.importorskip(
        "playwright.sync_api", reason="playwright not installed (pip install playwright)"
    )
    if not Path(CHROMIUM).exists() and not shutil.which("chromium"):
        pytest.skip(f"chromium not found at {CHROMIUM} (run .ci/install-browser)")
    with sync_api.sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            yield b
        finally:
            b.close()


def browser_check(browser: Any, html: Path, shot: Path) -> dict[str, Any]:
    """Open ``html`` in a fresh context of ``browser``; return errors, per-plot facts and the
    PNGs (each section's too when ``PRISM_SCREENSHOTS`` asks to keep them)."""
    errors: list[str] = []
    dialogs: list[str] = []
    ctx = browser.new_context(viewport={"width": 1400, "height": 1000})
    try:
        page = ctx.new_page()

        def on_console(m: Any) -> None:
            if m.type == "error":
                errors.append(m.text)

        page.on("console", on_console)
        page.on("pageerror", lambda e: errors.append(f"pageerror: {e}"))

        def on_dialog(d: Any) -> None:
            dialogs.append(d.message)
            d.dismiss()

        page.on("dialog", on_dialog)
        # (the timeouts only guard against a hang: the render time is bench_report.py's)
        page.goto(html.resolve().as_uri(), wait_until="load", timeout=120_000)
        page.wait_for_function(DRAWN_JS, timeout=120_000)
        plots = page.evaluate(_CHECK_PLOTS)
        # Hover the middle of the timeline: a hover label must appear, without errors.
        tl = page.locator("#timeline .js-plotly-plot .nsewdrag").first
        box = tl.bounding_box()
        hover = 0
        if box:
            for fx in (0.1, 0.3, 0.5, 0.7):  # until one point shows a label
                page.mouse.move(box["x"] + box["width"] * fx, box["y"] + 12)
                page.wait_for_timeout(150)
                hover = max(hover, page.locator("#timeline .hoverlayer .hovertext").count())
                if hover:
                    break
        page.mouse.move(1, 1)
        charts = page.evaluate(_CHART_DATA)
        if os.environ.get("PRISM_SCREENSHOTS"):  # for a person to look at; nothing reads them
            for sec in {p["section"] for p in plots}:
                page.locator(f"section#{sec}").screenshot(
                    path=str(shot.with_name(f"{shot.stem}_{sec}.png"))
                )
        # each chart's plot area alone (no titles, ticks or legend): its ink is data
        for i, chart in enumerate(charts):
            area = page.locator(".js-plotly-plot").nth(i).locator(".nsewdrag").first
            chart["area_png"] = str(shot.with_name(f"{shot.stem}_plot{i}.png"))
            area.screenshot(path=chart["area_png"])
        page.locator("#timeline").scroll_into_view_if_needed()
        page.screenshot(path=str(shot))
    finally:
        ctx.close()
    return {
        "errors": errors,
        "dialogs": dialogs,
        "plots": plots,
        "charts": charts,
        "hover": hover,
    }


def assert_renders(browser: Any, html: Path, tmp: Path, *, sections: set[str]) -> dict[str, Any]:
    shot = tmp / f"{html.stem}.png"
    res = browser_check(browser, html, shot)
    assert res["errors"] == []
    assert res["dialogs"] == []
    assert {p["section"] for p in res["plots"]} == sections
    for p in res["plots"]:
        assert p["traces"] > 0, p
        assert p["points"] > 0, p
        assert min(p["width"], p["height"], p["svg_w"], p["svg_h"]) > 100, p
        assert p["marks"] > 0, p
    assert res["hover"] > 0
    # every chart draws data: finite values with a spread, a heatmap that is not one flat block
    # on a -0.5..0.5 scale, and ink in its own plot area's screenshot
    for c in res["charts"]:
        assert c["finite"] > 0, c
        assert c["spread"] > 0, c
        for h in c["heat"]:
            assert h["n"] > 0, c
            assert h["max"] > h["min"], c  # not a flat block
            assert h["zmin"] == 0, c
            assert h["zmax"] >= 1, c
    *areas, (colors, ink) = png_stats(
        browser, [*(Path(c["area_png"]) for c in res["charts"]), shot]
    )
    for c, (_, area_ink) in zip(res["charts"], areas, strict=True):
        assert area_ink > 0.02, (c["section"], area_ink)  # the thinnest (memory lines) ~4 %
    keep = os.environ.get("PRISM_SCREENSHOTS")
    if keep:
        Path(keep).mkdir(parents=True, exist_ok=True)
        for png in shot.parent.glob(f"{shot.stem}*.png"):
            shutil.copy(png, Path(keep) / png.name)
    assert colors >= 20, colors
    assert ink > 0.03, ink
    res["shot"], res["colors"], res["ink"] = shot, colors, ink
    return res


@pytest.mark.slow
def test_browser_sample(browser: Any, store: Store, tmp_path: Path) -> None:
    out = tmp_path / "sample.html"
    write_report(store, run="sample", out=out)
    assert_renders(
        browser,
        out,
        tmp_path,
        sections={"timeline", "temporal", "ops", "waits", "iterations", "memory"},
    )


@pytest.mark.slow
def test_browser_emulated_8192(browser: Any, store: Store, tmp_path: Path) -> None:
    out = tmp_path / "big_emu.html"
    rep = write_report(store, run="big_emu", out=out)
    assert rep.bytes < 20 * 2**20
    # an emulated run carries its units' re-timed memory events (replay.memory)
    res = assert_renders(
        browser,
        out,
        tmp_path,
        sections={"timeline", "temporal", "ops", "waits", "iterations", "memory"},
    )
    # what the browser drew of 8192 ranks is within the caps (bench_report.py times it)
    caps = ReportLimits()
    assert rep.events_drawn <= caps.timeline_events
    assert all(h["n"] <= caps.heatmap_cells for c in res["charts"] for h in c["heat"])


@pytest.mark.slow
@pytest.mark.shared_data
def test_browser_dlrm(browser: Any, tmp_path: Path, dlrm_hta_template: Path) -> None:
    shutil.copyfile(dlrm_hta_template, tmp_path / "d.duckdb")  # dlrm (and hta), ingested once
    with open_store(tmp_path / "d.duckdb") as s:
        out = tmp_path / "dlrm.html"
        rep = write_report(s, run="dlrm", out=out)
    assert rep.events == rep.events_drawn == 19781
    assert "ops" in rep.figures
    # DLRM was recorded without allocator events: its memory is derived from the host ET
    assert "memory" in rep.figures
    assert "derived from the host execution trace" in " ".join(rep.notes)
    assert "No allocator events" not in out.read_text()
    assert_renders(
        browser,
        out,
        tmp_path,
        sections={"timeline", "temporal", "ops", "waits", "iterations", "memory"},
    )


@pytest.mark.slow
@pytest.mark.shared_data
def test_browser_op_timeline(browser: Any, shared_datasets: Path, tmp_path: Path) -> None:
    """ST (a Megatron-style op timeline): compute and communication drawn, seconds on the axis,
    the temporal breakdown not 0 % compute, top ops listed."""
    with open_store(tmp_path / "st.duckdb") as s:
        ingest(s, [shared_datasets / "megatron-straggler-st-8rank"], run="st", progress=False)
        out = tmp_path / "st.html"
        rep = write_report(s, run="st", out=out)
    text = _text(out.read_text())
    assert "No kernels or host ops" not in text
    assert "Timeline (s from the first event)" in text
    assert "timeline mode" in text
    res = assert_renders(
        browser, out, tmp_path, sections={"timeline", "temporal", "ops", "waits", "iterations"}
    )
    assert rep.figures == ["timeline", "temporal", "ops", "waits", "iterations"]
    temporal = next(c for c in res["charts"] if c["section"] == "temporal")
    assert temporal["spread"] > 30  # compute shares of 40-64 %, not 0

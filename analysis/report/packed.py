"""The report's figures and plotly.js packed small: gzip, then base-85 text, unpacked in the page.

plotly.js alone is 4.6 MiB, so a self-contained page could not be smaller than that, whatever it
showed. Gzipped it is 1.4 MiB, and base 85 (a quarter larger, where base 64 is a third) keeps it
text; the figures' JSON compresses tenfold (the timeline's bars repeat their names and
categories). The page unpacks both with the browser's own ``DecompressionStream`` (Chromium 80,
Firefox 113, Safari 16.4), runs plotly.js, then draws each figure into its place, so it still
opens from ``file://`` with no network. The alphabet leaves out the characters that mean
something in HTML or a JS string (``< > & " ' ` \\ / $``): the text is safe anywhere.
"""

from __future__ import annotations

import base64
import functools
import gzip
import itertools
import json
import re
from pathlib import Path
from typing import Any

__all__ = ["ALPHABET", "pack", "page_figures", "plotly_js_packed", "unpack", "unpack_script"]

_RFC1924 = b"0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz!#$%&()*+-;<=>?@^_`{|}~"
ALPHABET = b"0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz!#%()*+,-.:;=?@[]^_{|}~"
"""The 85 digits, in value order: printable ASCII less ``< > & " ' ` \\ / $``."""

_TO_OURS = bytes.maketrans(_RFC1924, ALPHABET)
_TO_RFC = bytes.maketrans(ALPHABET, _RFC1924)


def pack(data: bytes) -> tuple[str, int]:
    """``(text, length)``: ``data`` gzipped (level 9, no timestamp: the same bytes give the same
    page) in base 85 over ``ALPHABET``, padded to whole 4-byte groups; ``length`` is the gzip's
    own size, where the page cuts the padding off."""
    z = gzip.compress(data, compresslevel=9, mtime=0)
    padded = z + b"\0" * (-len(z) % 4)
    return base64.b85encode(padded).translate(_TO_OURS).decode("ascii"), len(z)


def unpack(text: str, length: int) -> bytes:
    """``pack``'s inverse (the page does this in JavaScript; the tests check both agree)."""
    raw = base64.b85decode(text.encode("ascii").translate(_TO_RFC))
    return gzip.decompress(raw[:length])


def _delta_bases(figure: dict[str, Any]) -> dict[str, Any]:
    """``figure`` with each long numeric ``base`` (the timeline's bar starts) written as whole
    units of its decimals and the difference from the previous bar, ``{"prism_delta": [...],
    "digits": d}``, which the page sums back before drawing (``page_figures`` too).

    Starts in time order differ by a few digits where the values themselves have seven: the
    32 000 bars of an 8-rank sample's timeline pack to a third of the bytes. Exact: the page
    divides the same integers by the same power of ten as Python's ``round`` produced them.
    """
    out = dict(figure)
    traces = []
    for trace in figure.get("data", []):
        base = trace.get("base")
        if isinstance(base, list) and len(base) > 16:
            for digits in (3, 6):
                scale = 10**digits
                ints = [round(v * scale) for v in base]
                if all(i / scale == v for i, v in zip(ints, base, strict=True)):
                    deltas = [ints[0], *(b - a for a, b in itertools.pairwise(ints))]
                    trace = {**trace, "base": {"prism_delta": deltas, "digits": digits}}
                    break
        traces.append(trace)
    out["data"] = traces
    return out


def _sum_bases(figure: dict[str, Any]) -> dict[str, Any]:
    """``_delta_bases``' inverse, as the page does it."""
    for trace in figure.get("data", []):
        base = trace.get("base")
        if isinstance(base, dict) and "prism_delta" in base:
            scale, v, values = 10 ** base["digits"], 0, []
            for d in base["prism_delta"]:
                v += d
                values.append(v / scale)
            trace["base"] = values
    return figure


@functools.cache
def plotly_js_packed() -> tuple[str, int]:
    """plotly.py's own plotly.min.js, packed once per process (0.3 s of gzip)."""
    import plotly

    path = Path(plotly.__file__).parent / "package_data" / "plotly.min.js"
    return pack(path.read_bytes())


def unpack_script(figures: list[dict[str, Any]], config: dict[str, Any]) -> str:
    """The page's script: unpack plotly.js and the figures, run the one, draw the others.

    Each figure goes to ``<div class='prism-fig' data-fig=i>``; when all are drawn the body gets
    ``data-prism-drawn`` (``html.DRAWN_JS`` waits for it), or ``data-prism-error`` with the
    reason, also shown at the top of the page.
    """
    js, js_len = plotly_js_packed()
    compact = [_delta_bases(f) for f in figures]
    figs, figs_len = pack(json.dumps(compact, separators=(",", ":")).encode())
    return f"""<script type="text/plain" id="prism-plotly" data-length="{js_len}">
{js}
</script>
<script type="text/plain" id="prism-figures" data-length="{figs_len}">
{figs}
</script>
<script>
(async () => {{
  const A = {json.dumps(ALPHABET.decode())};
  const digit = new Uint8Array(128);
  for (let i = 0; i < 85; i++) digit[A.charCodeAt(i)] = i;
  const bytes = (s, n) => {{
    const out = new Uint8Array(s.length / 5 * 4);
    for (let i = 0, o = 0; i < s.length; i += 5) {{
      let v = 0;
      for (let j = 0; j < 5; j++) v = v * 85 + digit[s.charCodeAt(i + j)];
      out[o++] = v >>> 24; out[o++] = (v >>> 16) & 255; out[o++] = (v >>> 8) & 255;
      out[o++] = v & 255;
    }}
    return out.subarray(0, n);
  }};
  const text = id => {{
    const el = document.getElementById(id);
    return new Response(new Blob([bytes(el.textContent.trim(), +el.dataset.length)]).stream()
        .pipeThrough(new DecompressionStream('gzip'))).text();
  }};
  try {{
    const lib = document.createElement('script');
    lib.textContent = await text('prism-plotly');
    document.head.appendChild(lib);
    const figs = JSON.parse(await text('prism-figures'));
    for (const f of figs) for (const t of f.data || []) {{
      if (t.base && t.base.prism_delta) {{  // see _delta_bases
        const s = 10 ** t.base.digits;
        let v = 0;
        t.base = t.base.prism_delta.map(d => (v += d) / s);
      }}
    }}
    const config = {json.dumps(config)};
    await Promise.all(Array.from(document.querySelectorAll('div.prism-fig')).map(
        div => {{ const f = figs[+div.dataset.fig];
                 return Plotly.newPlot(div, f.data, f.layout || {{}}, config); }}));
    document.body.dataset.prismDrawn = '1';
  }} catch (e) {{
    document.body.dataset.prismError = String(e);
    const p = document.createElement('p');
    p.className = 'what';
    p.textContent = 'The charts could not be drawn (' + e + '): this page needs a browser with'
        + ' DecompressionStream (Chromium 80, Firefox 113, Safari 16.4 or later).';
    document.body.prepend(p);
    throw e;
  }}
}})();
</script>"""


_PACKED = re.compile(
    r'<script type="text/plain" id="(prism-[a-z]+)" data-length="(\d+)">\n([^<]*)\n</script>'
)


def page_figures(page: str) -> list[dict[str, Any]]:
    """The figures a written page draws, unpacked (for tests and for reading a page's data
    without a browser); empty when it has none."""
    for name, length, text in _PACKED.findall(page):
        if name == "prism-figures":
            figures: list[dict[str, Any]] = json.loads(unpack(text, int(length)))
            return [_sum_bases(f) for f in figures]
    return []

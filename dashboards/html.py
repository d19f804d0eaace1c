"""A self-contained HTML page: inline CSS, figures embedded as base64 PNGs, no network, no JS library.

The page carries a small script that checks, once loaded, that every figure decoded and the summary
table has rows, and writes the verdict into ``#render-status`` (and ``body[data-render-check]``):
a reader sees it in the footer and a headless browser test reads it from the DOM.
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from dataclasses import dataclass, field
from html import escape

_CSS = """
body { font: 15px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; color: #1d2430; margin: 0;
       background: #f6f7f9; }
header, section, footer { max-width: 1200px; margin: 0 auto; padding: 0 24px; }
header { padding-top: 20px; }
h1 { font-size: 24px; margin: 8px 0 4px; }
h2 { font-size: 19px; margin: 0 0 10px; border-bottom: 1px solid #d5d9e0; padding-bottom: 4px; }
h3 { font-size: 16px; margin: 16px 0 6px; }
section { background: #fff; border: 1px solid #e1e4e8; border-radius: 6px; padding: 16px 24px;
          margin-top: 16px; }
nav a { margin-right: 14px; }
.meta { color: #566073; font-size: 13px; }
table { border-collapse: collapse; font-size: 13.5px; margin: 6px 0; }
th, td { border: 1px solid #d5d9e0; padding: 4px 9px; text-align: right; vertical-align: top; }
th { background: #eef1f5; }
td.text, th.text { text-align: left; }
tbody tr:nth-child(even) { background: #fafbfc; }
code, td.id { font-family: ui-monospace, "SFMono-Regular", Menlo, monospace; font-size: 12.5px; }
figure { margin: 10px 0 18px; }
figure img { max-width: 100%; height: auto; border: 1px solid #eceef1; }
figcaption { color: #566073; font-size: 13px; }
.note { color: #566073; font-size: 13px; }
footer { color: #8a93a3; font-size: 12px; padding: 16px 24px 30px; }
#render-status[data-state="error"] { color: #b00020; font-weight: bold; }
"""

# Runs first in <head>, so it also sees errors thrown by anything after it.
_CHECK_JS = """
(function () {
  var errors = [];
  window.addEventListener("error", function (e) {
    errors.push(e.message || ("failed to load " + ((e.target && e.target.tagName) || "resource")));
  }, true);
  window.addEventListener("load", function () {
    var images = Array.prototype.slice.call(document.images);
    var broken = images.filter(function (img) { return !(img.complete && img.naturalWidth > 0); });
    var rows = document.querySelectorAll("#summary table tbody tr").length;
    var problems = errors.slice();
    if (images.length === 0) problems.push("no figures");
    if (broken.length) problems.push(broken.length + " figure(s) did not decode");
    if (rows === 0) problems.push("the summary table has no rows");
    var ok = problems.length === 0;
    var status = document.getElementById("render-status");
    status.dataset.state = ok ? "ok" : "error";
    status.textContent = ok
      ? "page check: ok, " + images.length + " figures and " + rows + " table rows rendered"
      : "page check: error: " + problems.join("; ");
    document.body.dataset.renderCheck = ok ? "ok" : "error";
  });
})();
"""


@dataclass
class Cell:
    """A table cell: the text a person reads, and optionally the exact number behind it."""

    text: str
    value: float | None = None
    std: float | None = None
    css: str = ""

    def render(self, tag: str = "td") -> str:
        attrs = f' class="{self.css}"' if self.css else ""
        if self.value is not None:
            attrs += f' data-value="{self.value!r}"'
        if self.std is not None:
            attrs += f' data-std="{self.std!r}"'
        return f"<{tag}{attrs}>{escape(self.text)}</{tag}>"


@dataclass
class Section:
    id: str
    title: str
    blocks: list[str] = field(default_factory=list)

    def add(self, block: str) -> Section:
        self.blocks.append(block)
        return self


def paragraph(text: str, css: str = "") -> str:
    cls = f' class="{css}"' if css else ""
    return f"<p{cls}>{escape(text)}</p>"


def heading(text: str) -> str:
    return f"<h3>{escape(text)}</h3>"


def figure(png: bytes, alt: str, caption: str) -> str:
    data = base64.b64encode(png).decode("ascii")
    return (
        f'<figure><img alt="{escape(alt)}" src="data:image/png;base64,{data}">'
        f"<figcaption>{escape(caption)}</figcaption></figure>"
    )


def table(headers: Sequence[str | Cell], rows: Sequence[Sequence[Cell | str]], css: str = "") -> str:
    def cell(c: Cell | str, tag: str) -> str:
        return (c if isinstance(c, Cell) else Cell(str(c), css="text")).render(tag)

    head = "".join(cell(h, "th") for h in headers)
    body = "".join("<tr>" + "".join(cell(c, "td") for c in row) + "</tr>" for row in rows)
    cls = f' class="{css}"' if css else ""
    return f"<table{cls}><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def page(title: str, meta: list[str], sections: list[Section]) -> str:
    nav = " ".join(f'<a href="#{s.id}">{escape(s.title)}</a>' for s in sections)
    meta_html = "".join(f'<div class="meta">{escape(m)}</div>' for m in meta)
    body = "\n".join(
        f'<section id="{s.id}"><h2>{escape(s.title)}</h2>\n' + "\n".join(s.blocks) + "</section>"
        for s in sections
    )
    return (
        "<!doctype html>\n"
        '<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{escape(title)}</title><style>{_CSS}</style><script>{_CHECK_JS}</script></head>\n"
        f"<body><header><h1>{escape(title)}</h1>{meta_html}<nav>{nav}</nav></header>\n{body}\n"
        '<footer><span id="render-status" data-state="pending">'
        "</span></footer></body></html>\n"
    )

"""Synthetic scores for the report tests, and the parsed HTML they are checked against."""

from __future__ import annotations

from dataclasses import dataclass, field
from html.parser import HTMLParser

import torch

from gradtrace.score import Scores

SCRIPT_TEXT = "<script>document.body.setAttribute('data-pwned', '1')</script> & <b>bold</b> \"quoted\""
META = {"spec": {"projection": {"kind": "logra", "rank_rows": 8, "rank_cols": 8, "vector_rank": 8, "seed": 3},
                 "model": {"class": "GPT2LMHeadModel", "arch": "3e02bd5231879d5a", "weights": "74aafb750b7667ae"}}}


def synthetic(num_queries: int = 4, num_train: int = 60, *, matrix: bool = True, topk: int = 10,
              seed: int = 0) -> tuple[Scores, dict[str, str], dict[str, str]]:
    """Scores (grad_dot) of ``num_queries`` queries against ``num_train`` examples, with texts; training example
    ``t3`` carries a script and HTML-special characters."""
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(num_queries, num_train, generator=gen)  # [Q, N]
    train_ids = [f"t{i}" for i in range(num_train)]
    query_ids = [f"query-{i}" for i in range(num_queries)]
    top = torch.topk(values, topk, dim=1)
    bottom = torch.topk(values, topk, dim=1, largest=False)
    scores = Scores(train_ids, query_ids, "grad_dot", matrix=values if matrix else None,
                    top=(top.values, top.indices), bottom=(bottom.values, bottom.indices), meta=dict(META))
    texts = {t: f"training text of {t}: the lighthouse keeper counted gulls." for t in train_ids}
    texts["t3"] = SCRIPT_TEXT
    queries = {q: f"How many gulls did the keeper count? ({q})" for q in query_ids}
    return scores, texts, queries


@dataclass
class Page:
    """What the report's HTML holds, from :class:`html.parser.HTMLParser`."""

    tags: list[tuple[str, dict[str, str | None]]] = field(default_factory=list)
    text: str = ""  # the text shown (script content left out)
    ids: dict[str, int] = field(default_factory=dict)  # element id -> position in tags
    scripts: list[str] = field(default_factory=list)  # the content of each script element

    def by_class(self, name: str) -> list[dict[str, str | None]]:
        return [attrs for _, attrs in self.tags if name in (attrs.get("class") or "").split()]

    def count(self, tag: str) -> int:
        return sum(t == tag for t, _ in self.tags)


class _Parser(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.page = Page()
        self.chunks: list[str] = []
        self.in_script = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        attributes = dict(attrs)
        if attributes.get("id"):
            assert attributes["id"] not in self.page.ids, f"duplicate id {attributes['id']}"
            self.page.ids[attributes["id"]] = len(self.page.tags)  # type: ignore[index]
        self.page.tags.append((tag, attributes))
        if tag == "script":
            self.page.scripts.append("")
            self.in_script = True

    def handle_endtag(self, tag: str) -> None:
        self.in_script = False if tag == "script" else self.in_script

    def handle_data(self, data: str) -> None:
        if self.in_script:
            self.page.scripts[-1] += data
        else:
            self.chunks.append(data)


def parse(html: str) -> Page:
    parser = _Parser()
    parser.feed(html)
    parser.close()
    parser.page.text = " ".join(parser.chunks)  # one data chunk per text node (charrefs converted)
    return parser.page


def report_script() -> str:
    """The one script a report holds (the search box), as shipped."""
    from importlib.resources import files

    return (files("gradtrace.report") / "templates" / "report.js").read_text(encoding="utf-8")


def only_our_script(page: Page) -> bool:
    """The page holds exactly the shipped script, and its Content-Security-Policy runs that one alone."""
    import base64
    import hashlib

    digest = base64.b64encode(hashlib.sha256(report_script().encode()).digest()).decode()
    policies = [a.get("content") for t, a in page.tags if t == "meta" and a.get("http-equiv") ==
                "Content-Security-Policy"]
    expected = (f"default-src 'none'; style-src 'unsafe-inline'; script-src 'sha256-{digest}'; base-uri 'none'; "
                "form-action 'none'")
    return page.scripts == [report_script()] and policies == [expected]


def section(html: str, element_id: str) -> str:
    """The HTML of the element ``id="element_id"`` (up to the next element of the same tag: sections and articles
    are not nested in themselves)."""
    start = html.index(f'id="{element_id}"')
    tag_start = html.rindex("<", 0, start)
    tag = html[tag_start + 1:start].split()[0]
    return html[tag_start:html.index(f"</{tag}>", start)]


def read_png(data: bytes):
    """Decode an 8-bit, non-interlaced RGB/RGBA PNG (what Chromium writes) to a ``[H, W, C]`` uint8 array."""
    import struct
    import zlib

    import numpy as np

    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat, header = 8, b"", None
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + length]
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    width, height, depth, color, _, _, interlace = header  # type: ignore[misc]
    assert depth == 8 and color in (2, 6) and interlace == 0, header
    channels = 4 if color == 6 else 3
    raw = np.frombuffer(zlib.decompress(idat), dtype=np.uint8).reshape(height, 1 + width * channels)
    out = np.zeros((height, width * channels), dtype=np.int32)
    prev = np.zeros(width * channels, dtype=np.int32)
    for y in range(height):
        kind, row = raw[y, 0], raw[y, 1:].astype(np.int32)
        if kind == 0:
            cur = row
        elif kind == 2:
            cur = (row + prev) % 256
        elif kind == 1:  # Sub: a running sum along the row, per channel
            cur = (row.reshape(width, channels).cumsum(0) % 256).reshape(-1)
        elif kind in (3, 4):  # these depend on the reconstructed pixel to the left: one byte at a time
            cur_list, row_list, prev_list = [0] * (width * channels), row.tolist(), prev.tolist()
            for x in range(width * channels):
                left = cur_list[x - channels] if x >= channels else 0
                up, up_left = prev_list[x], (prev_list[x - channels] if x >= channels else 0)
                if kind == 3:
                    pred = (left + up) // 2
                else:
                    p = left + up - up_left
                    pa, pb, pc = abs(p - left), abs(p - up), abs(p - up_left)
                    pred = left if pa <= pb and pa <= pc else (up if pb <= pc else up_left)
                cur_list[x] = (row_list[x] + pred) % 256
            cur = np.asarray(cur_list, dtype=np.int32)
        else:
            raise AssertionError(f"unknown PNG filter {kind}")
        out[y], prev = cur, cur
    return out.reshape(height, width, channels).astype(np.uint8)

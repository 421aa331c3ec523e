"""The report's HTML, parsed: every query and top-k id, values as scored, nothing external, nothing executable."""

from __future__ import annotations

import html as htmllib
import re

import pytest
import torch

from gradtrace.options.report import ReportOptions
from gradtrace.report import render_report
from gradtrace.report.content import RANK_TABLE_QUERIES
from gradtrace.report.errors import ReportError
from gradtrace.report.svg import HEIGHT, PAD_BOTTOM, PAD_TOP, PAD_X, WIDTH, histogram_counts, histogram_of
from gradtrace.score.scores import SIGN_CONVENTION
from tests.report.helpers import SCRIPT_TEXT, only_our_script, parse, section, synthetic


def _column(html: str, css_class: str, tag: str = r"\w+") -> list[str]:
    """Unescaped text of every ``<tag class="css_class">`` element up to its first child, in document order."""
    return [htmllib.unescape(m) for m in re.findall(rf'<{tag} class="{css_class}"[^>]*>([^<]*)<', html)]


def _lists(article: str) -> tuple[str, str]:
    helpful, _, harmful = article.partition('<h3 class="neg">')
    return helpful, harmful


def test_every_query_and_top_k_id_in_rank_order_with_scores():
    scores, texts, queries = synthetic(num_queries=4, num_train=60)
    html = render_report(scores, texts, queries, options=ReportOptions(k=5))
    helpful, harmful = scores.topk(5), scores.topk(5, largest=False)
    for q, qid in enumerate(scores.query_ids):
        article = section(html, f"q{q}")
        assert f"<code>{qid}</code>" in article
        top_html, bottom_html = _lists(article)
        assert _column(top_html, "tid") == helpful.ids[q]
        assert _column(bottom_html, "tid") == harmful.ids[q]
        shown = [float(v) for v in _column(top_html, r"sc (?:pos|neg)") + _column(bottom_html, r"sc (?:pos|neg)")]
        expected = helpful.values[q].tolist() + harmful.values[q].tolist()
        assert shown == pytest.approx(expected, rel=5e-4)  # printed with 4 significant digits
        texts_shown = _column(top_html, "tx", "div")
        assert texts_shown == [texts[t] for t in helpful.ids[q]]


def test_score_bars_are_proportional_to_the_scores():
    scores, texts, queries = synthetic(num_queries=1, num_train=40)
    html = render_report(scores, texts, queries, options=ReportOptions(k=4))
    widths = [float(w) for w in re.findall(r'class="bar (?:pos|neg)" style="width:([0-9.]+)%"', section(html, "q0"))]
    values = scores.topk(4).values[0].tolist() + scores.topk(4, largest=False).values[0].tolist()
    scale = max(abs(v) for v in values)
    assert widths == pytest.approx([100 * abs(v) / scale for v in values], abs=0.051)  # one decimal


def test_no_external_resource_and_only_our_script():
    scores, texts, queries = synthetic()
    html = render_report(scores, texts, queries, self_scores=torch.rand(60))
    page = parse(html)
    assert not {"link", "img", "iframe", "object", "embed", "base", "form"} & {t for t, _ in page.tags}
    assert only_our_script(page)  # the search box's, allowed by the page's Content-Security-Policy alone
    for tag, attrs in page.tags:
        for name, value in attrs.items():
            assert not name.startswith("on"), (tag, name)
            assert name not in ("src", "srcset", "action", "formaction"), (tag, name)
            if name == "href":
                assert value and value.startswith("#"), value
    assert "http:" not in html and "https:" not in html and "url(" not in html and "@import" not in html


def test_script_in_training_text_query_and_ids_is_inert():
    scores, texts, queries = synthetic(num_queries=2, num_train=30)
    scores.matrix[:, 3] = 100.0  # t3 (the script text) tops every query
    scores.query_ids[1] = "<script>alert('q')</script>"
    queries = {scores.query_ids[0]: queries["query-0"], scores.query_ids[1]: "<img src=x onerror=alert(1)>"}
    scores.meta["answers"] = {scores.query_ids[0]: "</p><script>alert('answer')</script>"}
    html = render_report(scores, texts, queries, options=ReportOptions(k=3))
    page = parse(html)
    assert only_our_script(page) and page.count("img") == 0
    assert SCRIPT_TEXT in page.text  # shown as text, exactly
    assert "<img src=x onerror=alert(1)>" in page.text and "</p><script>alert('answer')</script>" in page.text
    assert "&lt;script&gt;document.body" in html


def test_header_states_method_projection_fingerprint_and_sign():
    scores, texts, queries = synthetic()
    page = parse(render_report(scores, texts, queries))
    text = " ".join(page.text.split())
    assert "method grad_dot" in text
    assert "projection LoGra rank 8x8 (vectors 8), seed 3" in text
    assert "model GPT2LMHeadModel, architecture 3e02bd5231879d5a, weights 74aafb750b7667ae" in text
    assert SIGN_CONVENTION in text and "negative = it hurts the query" in text
    assert "60 training examples" in text and "kept full score matrix" in text


def test_header_of_metagradients_names_the_run_and_the_steps_differentiated():
    scores, texts, queries = synthetic()
    scores.meta = {"metagradients": {"run_dir": "/runs/r1", "steps": 12, "replay_difference": 0.0,
                                     "options": {"start_step": 9}}}
    text = " ".join(parse(render_report(scores, texts, queries)).text.split())
    assert "projection none (exact derivatives through the recorded run)" in text
    assert "run /runs/r1: steps 9..11 of 12 differentiated (a truncated pass" in text
    assert "replay difference 0.00e+00" in text and "not recorded" not in text
    scores.meta["metagradients"]["options"] = {"start_step": 0}
    text = " ".join(parse(render_report(scores, texts, queries)).text.split())
    assert "run /runs/r1: all 12 steps differentiated" in text


def test_header_of_an_ensemble_says_how_it_combines_and_names_the_models():
    scores, texts, queries = synthetic()
    scores.meta.update(checkpoints=3, ensemble={"members": 3, "weights": [0.5, 0.25, 0.25], "normalize": True},
                       config={"model": ["/runs/a/checkpoint-5", "/runs/a/checkpoint-10", "/runs/b/final"]})
    text = " ".join(parse(render_report(scores, texts, queries)).text.split())
    assert ("combines ensemble of 3 members (weights 0.5, 0.25, 0.25; each member's scores divided by their mean "
            "|score|)") in text
    assert "models a/checkpoint-5, a/checkpoint-10, b/final" in text
    assert "model (first member) GPT2LMHeadModel" in text
    scores.meta["ensemble"].update(weights=[1 / 3] * 3, normalize=False)
    assert scores.combination == "ensemble of 3 members (equal weights; member scores summed as they are)"
    del scores.meta["ensemble"]
    assert scores.combination == "3 checkpoints"  # a method that combines checkpoints itself (tracin)
    scores.meta["checkpoints"] = 1
    assert scores.combination is None and "combines" not in parse(render_report(scores, texts, queries)).text


def test_histogram_bars_and_ticks_are_where_the_values_are():
    values = torch.tensor([0.0, 0.0, 0.0, 1.2, 1.2, 2.0])
    svg = str(histogram_of(values, helpful=[2.0, 1.2], harmful=[0.0], bins=4))
    bars = re.search(r'class="hb" d="([^"]*)"', svg).group(1)
    plot_h, plot_w = HEIGHT - PAD_TOP - PAD_BOTTOM, WIDTH - 2 * PAD_X
    steps = re.findall(r"V([0-9.]+)H([0-9.]+)", bars)  # each bin: up to its top, across to its right edge
    heights = [PAD_TOP + plot_h - float(y) for y, _ in steps]
    counts = torch.tensor([3.0, 0.0, 2.0, 1.0])  # bins [0, .5) [.5, 1) [1, 1.5) [1.5, 2]
    expected = (torch.log1p(counts) / torch.log1p(counts.max()) * plot_h).tolist()
    assert heights == pytest.approx(expected, abs=0.5)  # whole pixels
    assert [float(x) for _, x in steps] == pytest.approx([PAD_X + plot_w * (i + 1) / 4 for i in range(4)], abs=0.01)
    ticks = lambda cls: [float(x) for x in re.findall(r"M([0-9.]+) ", re.search(rf'class="{cls}" d="([^"]*)"',
                                                                                  svg).group(1))]
    assert ticks("hp") == pytest.approx([PAD_X + plot_w, PAD_X + 0.6 * plot_w], abs=0.051)
    assert ticks("hn") == pytest.approx([PAD_X], abs=0.051)


def test_distribution_only_with_the_full_matrix():
    scores, texts, queries = synthetic(num_queries=3)
    with_matrix = render_report(scores, texts, queries, options=ReportOptions(k=5))
    assert all('<svg class="hist"' in section(with_matrix, f"q{q}") for q in range(3))
    scores.matrix = None
    top_only = render_report(scores, texts, queries, options=ReportOptions(k=5))
    assert '<svg class="hist"' not in top_only
    assert all("only the top/bottom scores were kept" in section(top_only, f"q{q}") for q in range(3))
    assert "score distributions are not shown" in top_only


def test_token_heat_and_module_bars_when_the_scores_carry_them():
    scores, texts, queries = synthetic(num_queries=2, num_train=20)
    plain = render_report(scores, texts, queries, options=ReportOptions(k=3))
    assert 'class="heat"' not in plain and 'class="mods"' not in plain
    top = scores.topk(3)
    tid, value = top.ids[0][0], float(top.values[0, 0])
    scores.meta["tokens"] = [{"query_id": "query-0", "train_id": tid,
                              "train_tokens": ["The", " <keeper>", " counted"],
                              "train_scores": [0.6 * value, 0.5 * value, -0.1 * value],
                              "query_tokens": ["How", " many"], "query_scores": [0.25 * value, 0.75 * value]}]
    scores.meta["modules"] = [{"query_id": "query-0", "train_id": tid,
                               "modules": {"h.0.mlp": 0.4 * value, "h.1.attn": 0.7 * value, "lm_head": -0.1 * value}}]
    html = render_report(scores, texts, queries, options=ReportOptions(k=3))
    first = section(html, "q0").split("<li>")[1]  # [query, first helpful row, ...]
    levels = re.findall(r'<span class="([pn]\d)(?: l)?" title="([^"]+)">([^<]*)</span>', first)
    assert [(cls, tok) for cls, _, tok in levels[:3]] == [("p5", "The"), ("p4", " &lt;keeper&gt;"), ("n1", " counted")]
    assert [float(v) for _, v, _ in levels[:3]] == pytest.approx([0.6 * value, 0.5 * value, -0.1 * value], rel=5e-4)
    assert [(cls, tok) for cls, _, tok in levels[3:]] == [("p2", "How"), ("p5", " many")]  # query side
    assert _column(first, "mn", "td") == ["h.1.attn", "h.0.mlp", "lm_head"]  # largest |contribution| first
    widths = [float(w) for w in re.findall(r'<td class="mb"><span class="bar \w+" style="width:([0-9.]+)%', first)]
    assert widths == pytest.approx([100, 100 * 4 / 7, 100 / 7], abs=0.051)
    assert "token heat: against the top helpful example" in section(html, "q0")  # query text shown as heat
    assert 'class="heat"' not in section(html, "q1")  # no attribution for that query


def test_answer_is_shown_when_the_scores_carry_it():
    scores, texts, queries = synthetic(num_queries=2)
    scores.meta["answers"] = {"query-1": "Forty two gulls."}
    html = render_report(scores, texts, queries)
    assert "Forty two gulls." in section(html, "q1") and "Answer" not in section(html, "q0")


def _index_rows(html: str) -> list[list[str]]:
    """The index table's cells, as text, row by row."""
    body = section(html, "index").split("<tbody>")[1]
    text = lambda cell: " ".join(htmllib.unescape(re.sub(r"<[^>]+>", " ", cell)).split())
    return [[text(cell) for cell in re.findall(r"<td[^>]*>(.*?)</td>", row, re.S)]
            for row in re.findall(r"<tr>(.*?)</tr>", body, re.S)]


def test_answers_on_the_index_next_to_the_prompt_and_in_full_on_the_query_page():
    scores, texts, queries = synthetic(num_queries=3)
    long_answer = "The keeper counted forty two gulls on the north rock,\nthen " + "went home and slept " * 10 + "<end>"
    scores.meta["answers"] = {"query-0": "Forty two.", "query-2": long_answer}  # gradtrace score --generate
    html = render_report(scores, texts, queries)
    header = re.findall(r"<th[^>]*>([^<]*)</th>", section(html, "index"))
    assert header[:3] == ["query", "text", "answer"]
    rows = _index_rows(html)
    assert [row[2] for row in rows[:2]] == ["Forty two.", "none"]  # next to the prompt; none for query-1
    shown = rows[2][2]
    assert shown.endswith("…") and len(shown) <= 90 and " ".join(long_answer.split()).startswith(shown[:-1])
    assert not shown[:-1].endswith(" ") and long_answer[len(shown) - 1] == " "  # cut between words
    page = section(html, "q2")  # in full, line breaks kept (white-space: pre-wrap)
    assert '<p class="answer">' + htmllib.escape(long_answer, quote=False) + "</p>" in page.replace("&#34;", '"')
    del scores.meta["answers"]
    assert "<th>answer</th>" not in render_report(scores, texts, queries)  # no column without answers


def _training_index(html: str) -> dict[str, list[tuple[str, str]]]:
    """``{train id: [(cell class, rank text), ...]}`` of the training-example index, in its row order."""
    body = section(html, "train").split("<tbody>")[1]
    out = {}
    for row in re.findall(r'<tr class="te" id="x\d+">(.*?)</tr>', body, re.S):
        tid = htmllib.unescape(re.search(r'<code class="tid">([^<]*)</code>', row).group(1))
        out[tid] = re.findall(r'<td(?: class="(\w+)")?>([\d,·]+)</td>', row)
    return out


def test_training_index_ranks_every_shown_example_as_the_scores_do():
    scores, texts, queries = synthetic(num_queries=4, num_train=60)
    self_values = torch.rand(60, generator=torch.Generator().manual_seed(4))
    html = render_report(scores, texts, queries, options=ReportOptions(k=3, self_k=4), self_scores=self_values)
    ranking = scores.topk(60)  # Scores' own order of all training examples, per query
    helpful, harmful = scores.topk(3), scores.topk(3, largest=False)
    shown = {t for ids in helpful.ids + harmful.ids for t in ids}
    shown |= {f"t{j}" for j in torch.topk(self_values, 4).indices.tolist()}
    index = _training_index(html)
    assert list(index) == sorted(shown, key=lambda t: int(t[1:]))  # every shown example, in training order
    for tid, cells in index.items():
        assert [int(rank) for _, rank in cells] == [ranking.ids[q].index(tid) + 1 for q in range(4)], tid
        sides = ["pos" if tid in helpful.ids[q] else "neg" if tid in harmful.ids[q] else "" for q in range(4)]
        assert [side for side, _ in cells] == sides, tid
    rows = re.findall(r'<tr class="te" id="(x\d+)"><td><code class="tid">([^<]*)</code>', section(html, "train"))
    row_of = {tid: anchor for anchor, tid in rows}
    for q in range(4):  # each example on a query page links to its row
        links = re.findall(r'<a class="tl" href="#(x\d+)"[^>]*><code class="tid">([^<]*)</code>',
                           section(html, f"q{q}"))
        assert len(links) == 6 and all(row_of[tid] == anchor for anchor, tid in links)


def test_training_index_with_the_top_and_bottom_k_only():
    scores, texts, queries = synthetic(num_queries=3, num_train=50)
    scores.matrix = None  # kept: top/bottom 10
    html = render_report(scores, texts, queries, options=ReportOptions(k=4))
    helpful, harmful = scores.topk(4), scores.topk(4, largest=False)
    for tid, cells in _training_index(html).items():
        expected = []
        for q in range(3):
            if tid in helpful.ids[q]:
                expected.append(("pos", str(helpful.ids[q].index(tid) + 1)))
            elif tid in harmful.ids[q]:  # the r-th most harmful of N ranks N - r + 1
                expected.append(("neg", str(50 - harmful.ids[q].index(tid))))
            else:
                expected.append(("", "·"))  # not known: neither kept
        assert cells == expected, tid
    assert "not among them" in section(html, "train")


def test_training_index_lists_the_showing_queries_only_with_many_queries():
    num_queries = RANK_TABLE_QUERIES + 1
    scores, texts, queries = synthetic(num_queries=num_queries, num_train=40)
    html = render_report(scores, texts, queries, options=ReportOptions(k=2))
    helpful, harmful = scores.topk(2), scores.topk(2, largest=False)
    body = section(html, "train").split("<tbody>")[1]
    rows = re.findall(r'<code class="tid">([^<]*)</code>.*?<td class="places">(.*?)</td>', body, re.S)
    assert rows and all(len(re.findall(r"<td", row)) == 2 for row in body.split("<tr")[1:])  # no per-query table
    for tid, places in rows:
        found = re.findall(r'<span class="(pos|neg)"><a href="#q(\d+)">([^<]*)</a> #(\d+) \(([^)]*)\)</span>', places)
        expected = []
        for q in range(num_queries):
            if tid in helpful.ids[q]:
                r = helpful.ids[q].index(tid)
                expected.append(("pos", str(q), f"query-{q}", str(r + 1), f"{float(helpful.values[q, r]):+.4g}"))
            elif tid in harmful.ids[q]:
                r = harmful.ids[q].index(tid)
                expected.append(("neg", str(q), f"query-{q}", str(40 - r), f"{float(harmful.values[q, r]):+.4g}"))
        assert found == expected, tid


def test_loss_tokens_are_marked_exactly_where_the_mask_says():
    scores, texts, queries = synthetic(num_queries=2, num_train=20)
    top = scores.topk(3)
    value = float(top.values[0, 0])
    train_mask, query_mask = [False, True, True, False], [0, 0, 1]  # bools or 0/1
    scores.meta["tokens"] = [{"query_id": "query-0", "train_id": top.ids[0][0],
                              "train_tokens": ["A", " b", " c", " d"], "train_scores": [0.25 * value] * 4,
                              "train_in_loss": train_mask,
                              "query_tokens": ["x", " y", " z"], "query_scores": [0.5 * value, 0.25 * value,
                                                                                  0.25 * value],
                              "query_in_loss": query_mask},
                             {"query_id": "query-1", "train_id": top.ids[1][0], "train_tokens": ["e", "f"],
                              "train_scores": [0.5 * float(top.values[1, 0])] * 2}]  # no mask recorded
    html = render_report(scores, texts, queries, options=ReportOptions(k=3))
    heat = lambda part: [("l" in cls.split(), tok) for cls, tok in re.findall(
        r'<span class="([pn]\d(?: l)?)" title="[^"]+">([^<]*)</span>', part)]
    first = section(html, "q0").split("<li>")[1]  # the top helpful row: its training side, then its query side
    assert heat(first) == [(False, "A"), (True, " b"), (True, " c"), (False, " d"),
                           (False, "x"), (False, " y"), (True, " z")]
    assert heat(section(html, "q0").split("<li>")[0]) == [(False, "x"), (False, " y"), (True, " z")]  # query text
    assert "the tokens in the loss" in section(html, "q0")
    assert heat(section(html, "q1")) == [(False, "e"), (False, "f")]  # no mask: nothing marked
    assert '<span class="l">underlined</span>: in the loss' in html.split("<nav>")[0]  # the legend
    del scores.meta["tokens"][0]
    # no legend when nothing is marked
    assert "in the loss" not in render_report(scores, texts, queries, options=ReportOptions(k=3))
    scores.meta["tokens"][0]["train_in_loss"] = [True]  # one flag for two tokens
    with pytest.raises(ReportError, match="2 tokens but 1 in_loss flags"):
        render_report(scores, texts, queries, options=ReportOptions(k=3))
    scores.meta["tokens"][0]["train_in_loss"] = ["yes", "no"]
    with pytest.raises(ReportError, match="one true/false"):
        render_report(scores, texts, queries, options=ReportOptions(k=3))


def test_self_influence_lists_the_highest_in_order():
    scores, texts, queries = synthetic(num_train=50)
    values = torch.linspace(0, 1, 50)[torch.randperm(50, generator=torch.Generator().manual_seed(1))]
    html = render_report(scores, texts, queries, options=ReportOptions(self_k=7), self_scores=values,
                         self_method="grad_dot")
    part = section(html, "self")
    order = torch.argsort(values, descending=True)[:7].tolist()
    assert _column(part, "tid") == [f"t{i}" for i in order]
    assert "(grad_dot)" in part and '<svg class="hist"' in part
    assert "are equal for this method" not in part
    by_id = {f"t{i}": 1.0 + 1e-4 * (-1) ** i for i in range(50)}  # grad_cos: 1, up to float32 rounding
    constant = section(render_report(scores, texts, queries, self_scores=by_id), "self")
    assert "All self-influence values are equal for this method" in constant


def test_pages_index_and_navigation():
    scores, texts, queries = synthetic(num_queries=5)
    html = render_report(scores, texts, queries, options=ReportOptions(per_page=2))
    page = parse(html)
    pages = [i for i in page.ids if i.startswith("page-")]
    assert pages == ["page-1", "page-2", "page-3"]
    for q in range(5):
        assert f'id="q{q}"' in section(html, f"page-{q // 2 + 1}")
    index = section(html, "index")
    assert re.findall(r'<a href="#(q\d+)">', index) == [f"q{q}" for q in range(5)]
    top = scores.topk(1)
    assert re.findall(r"<code>(t\d+)</code>", index) == [ids[0] for ids in top.ids]
    nav = re.search(r"<nav>(.*?)</nav>", html, re.S).group(1)
    assert re.findall(r'href="#([\w-]+)"', nav) == ["index", "page-1", "page-2", "page-3", "train"]


def test_long_texts_are_cut_and_counted():
    scores, texts, queries = synthetic(num_queries=1, num_train=10)
    texts = {t: "x" * 5000 for t in texts}
    html = render_report(scores, texts, queries, options=ReportOptions(k=2, max_chars=100))
    assert _column(section(html, "q0"), "tx", "div")[0] == "x" * 100
    assert "4900 more characters" in section(html, "q0")


def test_file_size_does_not_grow_with_the_training_set():
    small, texts, queries = synthetic(num_queries=20, num_train=1_000)
    big, big_texts, _ = synthetic(num_queries=20, num_train=100_000)
    # the rank numbers of the training-example index have more digits; the rest does not grow
    without_ranks = lambda html: re.sub(r'(<td(?: class="\w+")?>)[\d,]+</td>', r"\1</td>", html)
    small_html = render_report(small, texts, queries, options=ReportOptions(k=5))
    big_html = render_report(big, big_texts, queries, options=ReportOptions(k=5))
    # top-k rows, a fixed-size histogram per query, and at most 2 k examples per query in the index
    assert len(without_ranks(big_html).encode()) < 1.05 * len(without_ranks(small_html).encode())
    assert big_html.count('<tr class="te"') <= 2 * 5 * 20


def test_to_html_writes_the_same_page(tmp_path):
    scores, texts, queries = synthetic()
    path = scores.to_html(tmp_path / "r.html", texts, queries, options=ReportOptions(k=3))
    assert path == tmp_path / "r.html"
    assert path.read_text(encoding="utf-8") == render_report(scores, texts, queries, options=ReportOptions(k=3))
    assert path.stat().st_mode & 0o777 == 0o644


def test_how_far_the_top_example_stands_out():
    scores, texts, queries = synthetic(num_queries=1, num_train=100)
    row = scores.matrix[0]
    spread = (float(row.max()) - float(row.mean())) / float(row.std())
    html = render_report(scores, texts, queries)
    assert (f"Median {float(row.median()):.4g}; the top example is {spread:.1f} standard deviations above the mean."
            in section(html, "q0"))


def test_histogram_counts_of_all_rows_match_torch_histc():
    values = torch.randn(6, 1000, generator=torch.Generator().manual_seed(2)) * torch.arange(1, 7)[:, None]
    values[5] = 0.25  # a constant row: one bar around the value
    counts, low, high = histogram_counts(values, bins=32)
    for r in range(6):
        expected = torch.histc(values[r].double(), bins=32, min=float(low[r]), max=float(high[r]))
        assert torch.equal(counts[r], expected), r
    assert counts.sum(1).tolist() == [1000.0] * 6
    assert low[:5].tolist() == values[:5].min(1).values.double().tolist()
    assert (low[5], high[5]) == (0.125, 0.375)


def test_the_diagnostics_of_the_scores_and_their_warnings_are_shown_in_the_header():
    from gradtrace.score.diagnostics import diagnose

    scores, texts, queries = synthetic(num_queries=3)
    assert 'class="diagnostics"' not in render_report(scores, texts, queries)  # nothing measured, nothing shown
    found = diagnose(scores)
    scores.meta["diagnostics"] = {**found.to_dict(), "warnings": ["the model has memorised <its> training set"]}
    html = render_report(scores, texts, queries)
    block = html[html.index('<div class="diagnostics">'):html.index("</div>", html.index('<div class="diagnostics">'))]
    for line in found.lines():
        assert htmllib.escape(line, quote=False) in block.replace("&#39;", "'").replace("&#34;", '"')
    assert '<p class="warning"><b>Warning:</b> the model has memorised &lt;its&gt; training set</p>' in block


def test_report_options_set_what_the_report_shows():
    """Each field of ReportOptions is what the built report holds: k rows per side (the exact top and bottom k of
    the matrix), texts cut at max_chars, per_page queries a page, self_k self-influence rows, the title; the
    defaults are those of ReportOptions()."""
    from gradtrace.report import build_report

    scores, texts, queries = synthetic(num_queries=5)
    texts = {t: f"{t} " + "long text " * 20 for t in texts}
    self_values = torch.rand(60, generator=torch.Generator().manual_seed(1))
    options = ReportOptions(k=3, per_page=2, max_chars=50, self_k=4, title="My report")
    report = build_report(scores, texts, queries, options, self_scores=self_values, self_method="grad_dot")
    assert report.k == 3 and report.pages == 3 and report.title == "My report"
    assert [view.page for view in report.queries] == [1, 1, 2, 2, 3]
    for q, view in enumerate(report.queries):
        top, low = torch.topk(scores.matrix[q], 3), torch.topk(scores.matrix[q], 3, largest=False)
        assert [row.train_id for row in view.helpful] == [scores.train_ids[j] for j in top.indices.tolist()]
        assert [row.train_id for row in view.harmful] == [scores.train_ids[j] for j in low.indices.tolist()]
        assert [row.score for row in view.helpful] == top.values.tolist()
        for row in view.helpful + view.harmful:
            assert row.text == texts[row.train_id][:50] and row.cut == len(texts[row.train_id]) - 50
    assert report.self_influence.method == "grad_dot"
    assert report.self_influence.train_rows == torch.topk(self_values, 4).indices.tolist()
    default = build_report(scores, texts, queries)
    assert default.k == ReportOptions().k == 5 and default.title == "GradTrace report: grad_dot"
    assert default.pages == 1 and default.self_influence is None
    html = render_report(scores, texts, queries, options=options, self_scores=self_values, self_method="grad_dot")
    assert "<title>My report</title>" in html


def test_header_shows_the_training_store_coverage_and_warns_below_100_percent(tmp_path):
    """The share of trainable parameters the training store captured: read from the store the scores record
    (``meta["config"]["store"]``, as gradtrace score writes it), a warning when it is below 100%, nothing when the
    store records none."""
    import json

    from gradtrace.capture.coverage import Coverage, LeftOut

    scores, texts, queries = synthetic(num_queries=3)
    assert "coverage" not in " ".join(parse(render_report(scores, texts, queries)).text.split())
    partial = Coverage(captured=7040, trainable=7360, captured_params=6, trainable_params=10, partial=True,
                       left_out=[LeftOut("mixer.D", "mixer", "unsupported", "MambaMixer: no rule", 320)])
    store = tmp_path / "store"
    store.mkdir()
    (store / "manifest.json").write_text(json.dumps({"config": {"gradtrace": {"coverage": partial.to_dict()}}}))
    scores.meta["config"] = {**(scores.meta.get("config") or {}), "store": str(store)}
    html = render_report(scores, texts, queries)
    text = " ".join(parse(html).text.split())
    line = "95.6% of trainable parameters (7,040 of 7,360 elements); left out: mixer (unsupported)"
    assert f"coverage {line}" in text
    assert (f'<p class="warning"><b>Warning:</b> the training gradients cover only {line}: the scores ignore what '
            "the left-out parameters contribute</p>") in html
    full = Coverage(captured=10, trainable=10, captured_params=2, trainable_params=2)
    scores.meta["coverage"] = full.to_dict()  # recorded with the scores: it wins over the store's
    html = render_report(scores, texts, queries)
    assert "coverage 100.0% of trainable parameters (10 of 10 elements)" in " ".join(parse(html).text.split())
    assert "the training gradients cover only" not in html

"""The HTML report in a real headless Chromium: what the rendered DOM shows, and that its controls work.

Pages come from real runs: the determinism check under determ_aot_eager (a nondeterministic custom op),
and a 2,000+ node dynamo graph under determ_eager.  Skipped where chromium/chromedriver are missing.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from backend_helpers import DeepChain, NondetModel, compile_run
from browser_helpers import load, open_browser, script_errors

pytestmark = pytest.mark.browser


@pytest.fixture(scope="module")
def browser():
    d = open_browser()
    yield d
    d.quit()


@pytest.fixture(scope="module")
def small_run(tmp_path_factory) -> Path:
    torch.manual_seed(0)
    _, run_dir = compile_run(NondetModel(), (torch.randn(4, 64),), "determ_aot_eager",
                             tmp_path_factory.mktemp("page"), "nd", check="determinism")
    return run_dir


@pytest.fixture(scope="module")
def big_run(tmp_path_factory) -> Path:
    torch.manual_seed(0)
    _, run_dir = compile_run(DeepChain(667), (torch.randn(4, 16),), "determ_eager", tmp_path_factory.mktemp("big"), "deep",
                             check="determinism")
    return run_dir


def _rows(run_dir: Path):
    return [json.loads(ln) for ln in (run_dir / "pairs-0.jsonl").read_text().splitlines()]


def _css(d, sel):
    return d.find_elements("css selector", sel)


def _shown(d):
    return [tr.get_attribute("data-row") for tr in _css(d, "#nodes tbody tr")]


def _type(d, text):
    from selenium.webdriver.common.keys import Keys

    box = _css(d, "#filter")[0]
    box.send_keys(Keys.CONTROL, "a")
    box.send_keys(Keys.BACKSPACE)  # typed, so the page sees the input (clear() fires no event)
    if text:
        box.send_keys(text)
    time.sleep(0.4)  # the filter waits for typing to pause


def test_header_plot_and_table_of_a_finding(browser, small_run):
    d = browser
    load(d, small_run / "report.html")
    root = json.loads((small_run / "report.json").read_text())["first_divergence"]
    assert _css(d, "#root-node")[0].text == root["node"] == "nd_rowsum"
    assert root["op"] in _css(d, "#root-op")[0].text and "backend_helpers.py" in _css(d, "#root-source")[0].text
    assert "nd_rowsum(h * 1000.0)" in _css(d, "#snippet .hl")[0].text
    rows = _rows(small_run)
    points = _css(d, "#plot circle.pt")
    assert len(points) == len(rows)  # one point per traced node
    assert len(_css(d, "#plot circle.pt.root")) == 1 and len(_css(d, "#plot circle.pt.masked")) == 1
    assert _css(d, "#root-label")[0].text == "root cause: nd_rowsum"
    assert len(_shown(d)) == len(rows) and script_errors(d) == []


def test_filter_sort_and_producer_links(browser, small_run):
    d = browser
    load(d, small_run / "report.html")
    _type(d, "v:root")
    shown = _shown(d)
    assert len(shown) == 1 and _css(d, "#nodes tbody tr td.c-n")[0].text == "nd_rowsum"
    _type(d, "addmm")
    # addmm itself, and mul and mul_1 whose inputs column names it
    assert {td.text for td in _css(d, "#nodes tbody tr td.c-n")} == {"addmm", "mul", "mul_1"}
    _type(d, "")
    # the root's input is a link to its producer's row
    link = _css(d, "tr.v-root td.c-in a.producer")[0]
    assert link.text == "mul"
    target = link.get_attribute("data-row")
    link.click()
    assert d.execute_script("return location.hash") == f"#row-{target}"
    tr = _css(d, f"#row-{target}")[0]
    assert tr.find_element("css selector", "td.c-n").text == "mul" and "flash" in tr.get_attribute("class")
    # the neighbourhood: producers and consumers, each a link to its row
    names = [a.find_element("css selector", "title").get_attribute("textContent").split(" ")[0]
             for a in _css(d, "#neighbourhood a.nb")]
    assert names == ["mul", "nd_rowsum", "mul_1"]
    consumer = _css(d, "#neighbourhood a.consumer")[0]
    target = consumer.get_attribute("data-row")
    consumer.click()
    assert d.execute_script("return location.hash") == f"#row-{target}"
    # sort by verdict: the header toggles the order
    th = [h for h in _css(d, "#nodes thead th") if h.text.startswith("verdict")][0]
    th.click()
    first = _css(d, "#nodes tbody tr td.c-v")[0].text
    th.click()
    assert _css(d, "#nodes tbody tr td.c-v")[0].text != first
    assert script_errors(d) == []


def test_screenshot_is_not_blank(small_run, tmp_path, capsys):
    """``repro-tools report --screenshot``: headless Chromium's picture of the page's top."""
    from PIL import Image

    from repro_tools.cli import main
    from repro_tools.report.screenshot import find_chromium

    if find_chromium() is None:
        pytest.skip("chromium is not installed (apt-get install chromium)")
    page, png = tmp_path / "r.html", tmp_path / "r.png"
    assert main(["report", str(small_run), "-o", str(page), "--screenshot", str(png), "--size", "1000x900"]) == 1
    assert capsys.readouterr().out.split() == [str(page), str(png)]
    img = Image.open(png).convert("RGB")
    assert img.size == (1000, 900)
    colors = img.getcolors(maxcolors=1 << 20)
    assert len(colors) > 50
    white = sum(n for n, c in colors if c == (255, 255, 255))
    assert white < 0.95 * img.size[0] * img.size[1]
    reds = sum(n for n, c in colors if c[0] > 180 and c[1] < 80 and c[2] < 100)  # the root-cause border and marks
    assert reds > 20


def test_a_2000_node_page(browser, big_run):
    d = browser
    seconds = load(d, big_run / "report.html")
    rows = _rows(big_run)
    assert len(rows) > 2000
    assert len(_css(d, "#plot circle.pt")) == len(rows) and len(_css(d, "#plot circle.pt.root")) == 1
    assert len(_shown(d)) == 200 and "of %d nodes" % len(rows) in _css(d, "#count")[0].text
    # the root's row lies on a later page: its header link turns the page and scrolls to it
    root_row = _css(d, "#root-node")[0].get_attribute("data-row")
    _css(d, "#root-node")[0].click()
    assert root_row in _shown(d) and _css(d, f"#row-{root_row}")[0].get_attribute("class").startswith("v-root")
    _type(d, "v:root")
    assert len(_shown(d)) == 1
    assert script_errors(d) == []
    print(f"2000-node page: {len(rows)} rows loaded and drawn in {seconds:.2f} s")


def test_a_dump_compare_page(browser, tmp_path):
    """The ptdbg CSV's columns, the root-cause API's row marked, no script error (dumps have no data-flow links)."""
    import dump_helpers as dh

    from repro_tools.report import build, write_html

    a = dh.dump_run(tmp_path, "npu", dh.make_net(perturb="fc1.weight", scale=0.5))
    b = dh.dump_run(tmp_path, "bench", dh.make_net())
    rep = build([str(a), str(b)])
    page = write_html(rep, tmp_path / "dump.html")
    d = browser
    load(d, page)
    heads = [h.text for h in _css(d, "#nodes thead th")]
    assert heads[:2] == ["NPU Name", "Bench Name"] and "Root Cause" in heads
    marked = _css(d, "#nodes tbody tr.v-root")
    assert len(marked) >= 1 and marked[0].find_element("css selector", "td.c-c0").text == rep.root["node"]
    assert _css(d, "#root-node")[0].text == rep.root["node"]
    assert len(_css(d, "#plot circle.pt")) == len(rep.rows) and script_errors(d) == []


def test_edge_values_render_without_script_errors(browser, tmp_path):
    """Non-finite errors sit in a band above the scale (never on the zero line); unknown producers are plain text;
    a word with a colon that names no column is searched as text; numbers sort as numbers."""
    from repro_tools.report import render
    from repro_tools.report.model import Report

    values = [float("nan"), float("inf"), float("-inf"), None, 0.0, 1e-6, 2.5, 10.0]
    rows = [{"id": i, "n": f"n{i}", "op": "module:fc1" if i == 3 else "aten.add", "v": "differs", "e": v, "r": None,
             "in": [None], "ins": ["outside"]} for i, v in enumerate(values)]
    page = tmp_path / "edge.html"
    page.write_text(render(Report(kind="diff", title="edge", inputs=[], checked="", divergent=True, verdict="x",
                                  rows=rows)))
    d = browser
    load(d, page)
    ys = {c.get_attribute("data-row"): float(c.get_attribute("cy")) for c in _css(d, "#plot circle.pt")}
    band = float(_css(d, "#nonfinite-band")[0].get_attribute("y")) - 4
    assert ys["0"] == ys["1"] == ys["2"] == band and ys["3"] == ys["4"] > ys["5"] > ys["6"] > ys["7"] > band
    assert _css(d, "#nodes tbody tr td.c-in a") == [] and "outside" in _css(d, "#nodes tbody tr td.c-in")[0].text
    _type(d, "module:fc1")
    assert _shown(d) == ["3"]
    _type(d, "")
    th = [h for h in _css(d, "#nodes thead th") if h.text == "error"][0]
    th.click()
    # -inf, 0, 1e-6, 2.5, 10, inf in numeric order, then NaN and the unmeasured
    assert _shown(d)[:6] == ["2", "4", "5", "6", "7", "1"] and set(_shown(d)[6:]) == {"0", "3"}
    assert script_errors(d) == []

"""A real browser on the real MLflow UI: the highlighted culprit text is what a person sees.

The README's spike-demo run (clip=adagc) and a short clip=none run are logged to an SQLite store, ``mlflow server``
serves it on 127.0.0.1, and headless Chromium (Debian's chromium + chromium-driver) opens the
run through the link the demo printed (no switch to the "Model training" view), then its
highlight artifact, the culprit table (rendered as a table), and the experiment's chart view
the summary links for comparing runs. Screenshots go to the test's tmp dir, and to
docs/img/ when GRADLOC_UPDATE_SCREENSHOTS=1 (that is how the README's pictures are made).
"""
from __future__ import annotations

import io
import os
import re
import shutil
import time
from pathlib import Path

import pytest

from gradloc_track.artifacts import read_table

from ..conftest import CONF_DIR, ROOT, running_mlflow_server
from .conftest import CHROMIUM, DRIVER, NO_BROWSER, save_screenshot, wait_for

pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.skipif(not (CHROMIUM and DRIVER), reason=NO_BROWSER)]


@pytest.fixture(scope="module")
def demo_store(tmp_path_factory):
    """The README's demo run (shared with tests/examples and tests/docs: one run per session) and, in a
    copy of its store, a short clip=none run so the chart view has two runs to overlay."""
    from hydra import compose, initialize_config_dir

    from gradloc_track.config import to_config
    from gradloc_track.console import TrainConsole
    from gradloc_track.demo.config import register_configs

    from ..examples.demo_run import demo_run
    from ..examples.load import load_example

    demo = demo_run(tmp_path_factory)
    root = tmp_path_factory.mktemp("browser_store")  # a copy: the shared demo's own store stays as it ran
    shutil.copyfile(demo.root / "mlflow.db", root / "mlflow.db")  # (its artifacts stay where the demo wrote them)
    uri = f"sqlite:///{root / 'mlflow.db'}"
    train_lm = load_example("train_lm").train_lm  # the example app's loop
    register_configs()
    cwd = os.getcwd()
    os.chdir(root)  # MLflow puts the default artifact root next to the working directory, as the demo's
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
            cfg = to_config(compose("config", overrides=[
                "experiment=spike_demo", "train.steps=10", "clip=none", "tracker=mlflow",
                f"tracker.mlflow.tracking_uri={uri}", "run_name='spike_demo[clip=none]'",
                f"train.cache_dir={root / 'cache'}"]))
            out = io.StringIO()
            train_lm(cfg, root / "runs" / "none", console=TrainConsole(stream=out))
    finally:
        os.chdir(cwd)
    return uri, root, {"adagc": demo.console, "none": out.getvalue()}


def close_assistant_panel(driver) -> None:
    """MLflow 3.x opens an assistant side panel; close it so the screenshot shows the artifact."""
    from selenium.webdriver.common.by import By

    for button in driver.find_elements(By.CSS_SELECTOR, "button[aria-label='Close']"):
        if button.is_displayed():
            button.click()
            time.sleep(1.0)
            return


def save(driver, tmp_path: Path, name: str) -> Path:
    out = tmp_path / name
    save_screenshot(driver, out)
    if os.environ.get("GRADLOC_UPDATE_SCREENSHOTS") == "1":
        shutil.copyfile(out, ROOT / "docs" / "img" / name)
    print(f"screenshot: {out}")
    return out


def test_artifact_pages_show_highlighted_culprits_and_the_table_and_charts_overlay_both_runs(demo_store, browser,
                                                                                              tmp_path):
    from mlflow.tracking import MlflowClient
    from selenium.webdriver.common.by import By

    uri, root, printed = demo_store
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("gradloc-track")
    runs = {r.info.run_name: r for r in client.search_runs([exp.experiment_id])}
    (run,) = [r for name, r in runs.items() if name.startswith("spike_demo clip=adagc")]  # the demo's own name
    local = Path(client.download_artifacts(run.info.run_id, "spikes", str(tmp_path)))
    table = read_table(local.parent, "spikes/tokens")
    tokens = {row[table["columns"].index("token")] for row in table["data"]}
    assert tokens
    # the link the demo printed (for `mlflow ui` on port 5000), pointed at this test's server
    run_path = f"/#/experiments/{exp.experiment_id}/runs/{run.info.run_id}"
    links = re.findall(r"http://127\.0\.0\.1:5000(/#/experiments/\S+)", printed["adagc"])
    assert f"{run_path}?workflowType=machine_learning" in links  # the summary's link
    highlight = f"{run_path}/artifacts/spikes/highlight/step_000100.html?workflowType=machine_learning"
    assert highlight in links  # the spike block's link
    with running_mlflow_server(uri, root) as server:
        browser.get(server + f"{run_path}?workflowType=machine_learning")
        # the run page itself, in the model-training view (no GenAI side bar: traces, sessions)
        body = wait_for(browser, lambda: (t := browser.find_element(By.TAG_NAME, "body").text)
                        and run.info.run_name in t and "Run ID" in t and t,
                        what="the run page opened by the printed link")
        assert "Sessions" not in body and "Evaluation runs" not in body, body[:500]
        close_assistant_panel(browser)
        save(browser, tmp_path, "mlflow_run.png")
        browser.get(server + highlight)

        def culprit_text():
            frames = browser.find_elements(By.TAG_NAME, "iframe")
            for frame in frames:
                browser.switch_to.frame(frame)
                try:
                    # culprits in the visible context window (the collapsed full text has copies); the
                    # sample may have a line of its own columns (dataset_index) above its meta line
                    spans = browser.find_elements(By.CSS_SELECTOR, "h2 ~ div.text > span.c")
                    texts = [s.text for s in spans if s.text]
                finally:
                    browser.switch_to.default_content()
                if texts:
                    return texts
            return None

        texts = wait_for(browser, culprit_text, what="the highlighted culprit tokens in the artifact viewer")
        assert set(texts) <= tokens and "".join(texts) == "\u00e2\u20ac\u2122"  # the mojibake answer, as text
        close_assistant_panel(browser)
        assert wait_for(browser, culprit_text, what="the culprits after closing the side panel") == texts
        shot = save(browser, tmp_path, "mlflow_highlight.png")
        assert shot.stat().st_size > 10_000

        # the culprit table, opened as a person does (the tree: tokens/ -> the step's .csv): MLflow's
        # viewer shows the part's CSV view as a table (the JSON part it shows raw)
        def click_node(name):
            css = f"[data-testid='artifact-tree-node'][artifact-name='{name}']"
            nodes = browser.find_elements(By.CSS_SELECTOR, css)
            if nodes and nodes[0].is_displayed():
                nodes[0].click()
                return True
            return None

        wait_for(browser, lambda: click_node("tokens"), what="the tokens/ folder in the artifact tree")
        wait_for(browser, lambda: click_node("step_000100.csv"), what="the table part's CSV view in the tree")

        def table_cells():
            heads = [h.text for h in browser.find_elements(By.CSS_SELECTOR, "table th") if h.text]
            cells = [c.text for c in browser.find_elements(By.CSS_SELECTOR, "table td")]
            return (heads, cells) if heads[:4] == ["step", "level", "token", "share"] and cells else None

        heads, cells = wait_for(browser, table_cells, what="the culprit table rendered as a table")
        assert tokens <= set(cells) and "100" in cells  # one row per culprit token, its text in a cell
        close_assistant_panel(browser)
        save(browser, tmp_path, "mlflow_table.png")

        # comparing runs: the experiment's chart view the summary links (every metric, runs overlaid)
        charts = re.findall(r"http://127\.0\.0\.1:5000(/#/experiments/\S+compareRunsMode=CHART\S*)", printed["adagc"])
        assert charts == [f"/#/experiments/{exp.experiment_id}/runs?compareRunsMode=CHART&"
                          "workflowType=machine_learning"]
        browser.get(server + charts[0])
        body = wait_for(browser, lambda: (t := browser.find_element(By.TAG_NAME, "body").text)
                        and "spike_demo[clip=none] (clip/total_norm_post)" in t
                        and re.search(r"spike_demo clip=adagc[^\n]*\(clip/total_norm_post\)", t) and t,
                        what="the chart view with both runs overlaid")
        assert "grad_norm" in body and "Sessions" not in body
        close_assistant_panel(browser)
        save(browser, tmp_path, "mlflow_charts.png")

"""The run page tells the story (``trackers/spike_story.py``): the MLflow run's description and the W&B run's
summary name each spike's culprit text and where its highlighted text is, built from the tables every front
door logs; culprit text is shown, never interpreted."""
from __future__ import annotations

from gradloc_track.config import TrackerConfig
from gradloc_track.trackers import make_tracker
from gradloc_track.trackers.spike_story import SpikeStory, unescape_bytes

from ..wandb_reader import summary

EVENTS = ["step", "signal", "localization"]
TOKENS = ["step", "level", "token", "share", "sample", "position", "end"]


def demo_like(tracker) -> None:
    """What the artifact writer logs for the demo's step 100 (three mojibake tokens, 90%) and a spike at
    step 120 that was not localized."""
    tracker.log_table("spikes/events", EVENTS, [[100, "global", "localized"]], 100)
    tracker.log_table("spikes/tokens", TOKENS, [[100, "token", t, 0.3, 3, p, p + 1]
                                                for p, t in zip((40, 41, 42), "\u00e2\u20ac\u2122")], 100)
    tracker.log_table("spikes/events", EVENTS, [[120, "wpe", "locate.max_events=1 used up"]], 120)


def test_the_story_names_each_spikes_culprit_text_and_why_one_has_none():
    story = SpikeStory()
    demo_like(type("T", (), {"log_table": lambda self, k, c, r, s: story.add(k, c, r)})())
    assert story.text().splitlines() == [
        "2 gradient spike(s) detected, at step 100, 120",
        "step 100: sample 3, tokens 40-42: '\u00e2\u20ac\u2122'  (90% of the batch's squared grad norm)",
        "step 120: not localized: locate.max_events=1 used up"]
    md = story.markdown(lambda step, localized: f"#/x/{step}/{'highlight' if localized else 'events'}")
    assert "- step 100: sample 3, tokens 40-42: '\u00e2\u20ac\u2122'  (90% of the batch's squared grad norm) — " \
           "[the highlighted text](#/x/100/highlight)" in md
    assert "- step 120: not localized: locate.max\\_events=1 used up — [the event](#/x/120/events)" in md


def test_culprit_text_is_escaped_and_byte_tokens_read_as_text():
    story = SpikeStory()
    story.add("spikes/tokens", TOKENS, [[7, "sample", "<script>*x*</script>", 0.9, 1, 0, 9]])
    md = story.markdown()
    assert "<script>" not in md and "&lt;script&gt;\\*x\\*&lt;/script&gt;" in md
    assert unescape_bytes("\\xc3\\xa2\\xe2\\x82\\xac\\xe2\\x84\\xa2 ok") == "\u00e2\u20ac\u2122 ok"
    assert unescape_bytes("\\xff!") == "\\xff!"  # invalid UTF-8 keeps its escape


def test_the_mlflow_description_holds_the_spikes_and_links_to_the_highlight_page(tmp_path, sqlite_uri):
    from mlflow.tracking import MlflowClient

    cfg = TrackerConfig(kind="mlflow")
    cfg.mlflow.tracking_uri = sqlite_uri
    tracker = make_tracker(cfg, run_dir=tmp_path / "run", run_name="story")
    demo_like(tracker)
    tracker.finish("success")
    client = MlflowClient(sqlite_uri)
    (run,) = client.search_runs([client.get_experiment_by_name("gradloc-track").experiment_id])
    note = run.data.tags["mlflow.note.content"]
    rid, exp = run.info.run_id, run.info.experiment_id
    assert note.startswith("**2 gradient spike(s) detected, at step 100, 120**")
    # relative (any host, any port), in the UI's model-training view (without it the page opens in the GenAI view)
    assert (f"[the highlighted text](#/experiments/{exp}/runs/{rid}/artifacts/spikes/highlight/step_000100.html"
            "?workflowType=machine_learning)") in note and "'\u00e2\u20ac\u2122'" in note
    assert "gradloc-track run. Gradient norms" in note  # what is where, after the story


def test_a_joined_runs_own_description_is_left_alone(tmp_path, sqlite_uri):
    from mlflow.tracking import MlflowClient

    from gradloc_track.trackers.mlflow_tracker import MlflowTracker

    client = MlflowClient(sqlite_uri)
    run = client.create_run(client.create_experiment("theirs"), tags={"mlflow.note.content": "my notes"})
    tracker = MlflowTracker(tracking_uri=sqlite_uri, run_id=run.info.run_id, run_dir=tmp_path / "run")
    demo_like(tracker)
    assert client.get_run(run.info.run_id).data.tags["mlflow.note.content"] == "my notes"


def test_a_resumed_run_whose_description_is_ours_goes_on_telling_its_spikes(tmp_path, sqlite_uri):
    """The run's second process (a resume joining it) reads the spikes the first one logged (held-out tester,
    stop 56: the description kept "1 gradient spike(s) detected, at step 60" after step 100 spiked)."""
    from mlflow.tracking import MlflowClient

    from gradloc_track.trackers.mlflow_tracker import MlflowTracker

    cfg = TrackerConfig(kind="mlflow")
    cfg.mlflow.tracking_uri = sqlite_uri
    first = make_tracker(cfg, run_dir=tmp_path / "run", run_name="story")
    first.log_table("spikes/events", EVENTS, [[100, "global", "localized"]], 100)
    first.log_table("spikes/tokens", TOKENS, [[100, "sample", "abc", 0.9, 3, 0, 9]], 100)
    first.finish("success")
    client = MlflowClient(sqlite_uri)
    (run,) = client.search_runs([client.get_experiment_by_name("gradloc-track").experiment_id])
    again = MlflowTracker(tracking_uri=sqlite_uri, run_id=run.info.run_id, run_dir=tmp_path / "run2")
    again.log_table("spikes/events", EVENTS, [[150, "wpe", "locate.enabled=false"]], 150)
    note = client.get_run(run.info.run_id).data.tags["mlflow.note.content"]
    assert note.startswith("**2 gradient spike(s) detected, at step 100, 150**"), note
    assert "- step 100: sample 3, the whole sample: 'abc'" in note and "- step 150: not localized" in note
    # a resume from an older checkpoint logs step 100 again: its rows now, not both processes'
    again.log_table("spikes/events", EVENTS, [[100, "global", "localized"]], 100)
    again.log_table("spikes/tokens", TOKENS, [[100, "sample", "xyz", 0.8, 2, 0, 9]], 100)
    note = client.get_run(run.info.run_id).data.tags["mlflow.note.content"]
    assert "- step 100: sample 2, the whole sample: 'xyz'  (80% " in note and "'abc'" not in note, note


def test_the_story_quotes_culprit_text_as_the_console_does():
    """One quote for every line of prose (``text.quoted``): the story once quoted with ``repr()``, a tab as
    ``\\t`` and an apostrophe's text in double quotes, where the console's block shows ``→`` and single quotes."""
    from gradloc_track.text import quoted
    from gradloc_track.trackers.spike_story import QUOTE, SpikeStory

    text = "it's\tcol\nnext " + "x" * 80
    story = SpikeStory()
    story.add("spikes/events", EVENTS, [[100, "global", "localized"]])
    story.add("spikes/tokens", TOKENS, [[100, "sample", text, 0.9, 3, 0, 9]])
    quote = quoted(text, QUOTE)
    assert story.culprit(100) == f"sample 3, the whole sample: {quote}  (90% of the batch's squared grad norm)"
    assert quote.startswith("'it's→col↵next x") and quote.endswith("x…'") and len(quote) == QUOTE + 3


def test_the_wandb_summary_holds_the_spikes(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    tracker = make_tracker(TrackerConfig(kind="wandb"), run_dir=tmp_path / "run", run_name="t")
    demo_like(tracker)
    tracker.finish("success")
    (run_dir,) = (tmp_path / "wandb").glob("offline-run-*")
    text = summary(run_dir)["spike_summary"]
    assert "step 100: sample 3, tokens 40-42: '\u00e2\u20ac\u2122'  (90% of" in text
    assert text.endswith("highlighted text: the spikes/highlight panel")

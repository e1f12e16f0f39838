"""The learning-curve command reads metrics.jsonl rows (train and eval) and writes a PNG."""

import json
import re

import pytest

from searchlite.data import DataError, write_jsonl
from searchlite.plot import labels, plot, read_metrics, series


def write_run(folder, rows):
    write_jsonl(folder / "metrics.jsonl", rows)
    return folder


def drawn(monkeypatch):
    """Figures `plot` saves, kept instead of written."""
    import matplotlib.figure

    figs = []
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda fig, *a, **k: figs.append(fig))
    return figs


def test_series_and_png(tmp_path):
    pytest.importorskip("matplotlib")
    rows = [{"step": 0, "eval/all": {"em": 0.2, "searches": 0.5, "n": 4}},
            {"step": 1, "reward": 0.1, "searches": 0.4, "response_len": 20.0, "kl": 0.0},
            {"step": 2, "reward": 0.3, "searches": 0.9, "response_len": 25.0, "kl": 0.01,
             "eval/all": {"em": 0.5, "searches": 1.0, "n": 4}}]
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    got = read_metrics(run)
    assert series(got, "reward") == ([1, 2], [0.1, 0.3])
    assert series(got, "eval/all") == ([0, 2], [0.2, 0.5])
    out = plot([str(run)], str(tmp_path / "c.png"))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    # matplotlib wrote 'curves' as curves.png while the path printed was 'curves'; '.txt' was a traceback
    for name in ("curves", "c.txt"):
        with pytest.raises(DataError, match=rf"--out .*{name}: give a file ending in one of .*\.png"):
            plot([str(run)], str(tmp_path / name))
    assert plot([str(run)], str(tmp_path / "c.svg")).read_text().lstrip().startswith("<?xml")


def test_the_command_without_out_writes_curves_png_here(tmp_path, monkeypatch, capsys):
    """`python -m searchlite.plot RUN` writes curves.png in the current folder (its default dropped,
    test_plot passed: its runs give --out)."""
    pytest.importorskip("matplotlib")
    from searchlite.plot import main

    (tmp_path / "run").mkdir()
    run = write_run(tmp_path / "run", [{"step": 1, "reward": 0.1}, {"step": 2, "reward": 0.3}])
    monkeypatch.chdir(tmp_path)
    main([str(run)])
    assert (tmp_path / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert capsys.readouterr().out.strip() == "curves.png"


def test_a_running_run_is_read_as_it_stands_and_bad_input_is_named(tmp_path):
    from searchlite.plot import main

    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b'{"step": 1, "reward": 0.1}\n{"step": 2, "rew')  # train.py is writing step 2
    assert read_metrics(tmp_path) == [{"step": 1, "reward": 0.1}]
    assert path.read_bytes().endswith(b'"rew')  # left as it is: the writer owns the file
    path.write_text('{"step": 1}\nnot json\n')
    with pytest.raises(SystemExit, match=r"metrics.jsonl:2: bad JSON"):
        main([str(tmp_path)])
    with pytest.raises(SystemExit, match=r"nowhere: no metrics.jsonl"):
        main([str(tmp_path / "nowhere")])
    path.write_text('{"step": 1}\n')
    with pytest.raises(SystemExit, match=r"no step logged any of reward, em, eval/all"):
        main([str(tmp_path)])


def test_a_row_without_a_step_is_named_by_its_file_and_line(tmp_path):
    """A row without `step` raised KeyError: 'step'. It is an error, not a row skipped: train.py
    logs a step in every row, so such a row means another file was given."""
    from searchlite.plot import main

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "reward": 0.1}\n\n{"reward": 0.2}\n')  # line 3: the blank line counts
    with pytest.raises(SystemExit, match=f"^error: {re.escape(str(path))}:3: no 'step'; every row train.py logs"):
        main([str(tmp_path), "--out", str(tmp_path / "c.png")])
    path.write_text('{"step": "2", "reward": 0.2}\n')
    with pytest.raises(SystemExit, match=f"^error: {re.escape(str(path))}:1: 'step' is '2', not a number"):
        main([str(path), "--out", str(tmp_path / "c.png")])


def test_reward_and_em_panels_and_run_labels(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    # an r1pp run's reward adds format and group terms (it can be -2); its EM is logged apart
    r1pp = write_run(tmp_path / "runs" / "r1pp", [{"step": 1, "reward": -1.5, "em": 0.25}])
    old = write_run(tmp_path / "runs" / "old", [{"step": 1, "reward": 0.5}])  # from before train.py logged em
    figs = drawn(monkeypatch)
    plot([str(r1pp / "metrics.jsonl"), str(old)], str(tmp_path / "c.png"))  # a file and a folder
    axes = {ax.get_title(): ax for ax in figs[0].axes}
    assert list(axes)[:2] == ["train reward", "train EM"]
    assert [list(line.get_ydata()) for line in axes["train reward"].lines] == [[-1.5], [0.5]]
    assert [list(line.get_ydata()) for line in axes["train EM"].lines] == [[0.25]]
    names = [t.get_text() for t in axes["train reward"].get_legend().get_texts()]
    assert names == ["r1pp", "old"]  # a file is named by its run folder
    plot([str(old)], str(tmp_path / "c.png"))
    assert "train EM" not in [ax.get_title() for ax in figs[1].axes]  # no run logged em


def test_a_plotted_figure_is_closed(tmp_path):
    """plot() called again and again (a notebook, a sweep) leaves no figure open behind it."""
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    run = write_run(tmp_path / "run", [{"step": 1, "reward": 0.5}])
    plt.close("all")
    for _ in range(3):
        plot([str(run)], str(tmp_path / "c.png"))
    assert plt.get_fignums() == []


def test_without_matplotlib_the_error_says_how_to_get_it(tmp_path, monkeypatch):
    from searchlite.plot import main

    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward": 0.5}) + "\n")
    monkeypatch.setitem(__import__("sys").modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    with pytest.raises(SystemExit, match=r"error: plotting needs matplotlib .*\./setup\.sh plot"):
        main([str(run), "--out", str(tmp_path / "c.png")])


def test_each_run_keeps_its_colour_and_a_name_of_its_own(tmp_path, monkeypatch):
    """Colours came from each panel's own cycle, so a run with nothing in a panel (one that has only
    logged its step-0 evaluation) shifted the later runs' colours there, while the legend, drawn from
    the first panel, named them by their colours in that one. A run set aside beside its folder's
    new one was labelled alike."""
    pytest.importorskip("matplotlib")
    first = {"step": 0, "eval/all": {"em": 0.2}}
    starting, run = tmp_path / "starting", tmp_path / "run"
    for folder, rows in ((starting, [first]), (run, [first, {"step": 1, "reward": 0.5}, {"step": 2, "reward": 0.7}])):
        folder.mkdir()
        (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "metrics.previous.jsonl").write_text(json.dumps(first) + "\n")
    figs = drawn(monkeypatch)
    plot([str(starting), str(run), str(run / "metrics.previous.jsonl")], str(tmp_path / "c.png"))
    reward, test_em = figs[0].axes[:2]  # the panels: train reward (run's only), held-out test EM (all three)
    assert [(line.get_label(), line.get_color()) for line in reward.get_lines()] == [("run", "C1")]
    assert [(line.get_label(), line.get_color()) for line in test_em.get_lines()] == [
        ("starting", "C0"), ("run", "C1"), ("run/metrics.previous.jsonl", "C2")]
    legend = reward.get_legend()
    assert [(t.get_text(), h.get_color()) for t, h in zip(legend.get_texts(), legend.legend_handles)] == [
        ("starting", "C0"), ("run", "C1"), ("run/metrics.previous.jsonl", "C2")]
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "run").mkdir()
    assert labels([str(run), str(tmp_path / "b" / "run")]) == [str(run), str(tmp_path / "b" / "run")]


def test_every_logged_key_gets_its_panel_with_its_values(tmp_path, monkeypatch):
    """A run logging all six keys gets all six panels, in order, each line holding its own key's
    values against the step, with 'step' on the x axis."""
    pytest.importorskip("matplotlib")
    rows = [{"step": 1, "reward": 0.1, "em": 0.2, "searches": 1.5, "response_len": 30.0, "kl": 0.01},
            {"step": 3, "reward": 0.4, "em": 0.5, "searches": 2.5, "response_len": 40.0, "kl": 0.02,
             "eval/all": {"em": 0.6, "searches": 9.0}}]
    figs = drawn(monkeypatch)
    plot([str(write_run(tmp_path / "run", rows))], str(tmp_path / "c.png"))
    got = [(ax.get_title(), ax.get_xlabel(), [(list(ln.get_xdata()), list(ln.get_ydata())) for ln in ax.get_lines()])
           for ax in figs[0].axes]
    assert got == [("train reward", "step", [([1, 3], [0.1, 0.4])]),
                   ("train EM", "step", [([1, 3], [0.2, 0.5])]),
                   ("held-out test EM", "step", [([3], [0.6])]),
                   ("valid searches / rollout", "step", [([1, 3], [1.5, 2.5])]),
                   ("response length (policy tokens)", "step", [([1, 3], [30.0, 40.0])]),
                   ("KL to reference", "step", [([1, 3], [0.01, 0.02])])]


def test_a_zero_is_a_point_not_a_gap():
    """A reward, KL or EM of 0 is a value and is plotted; only a missing key leaves a gap."""
    rows = [{"step": 0, "kl": 0.0, "eval/all": {"em": 0.0}}, {"step": 1, "kl": 0, "reward": 0.0},
            {"step": 2, "kl": 0.5}]
    assert series(rows, "kl") == ([0, 1, 2], [0.0, 0.0, 0.5])
    assert series(rows, "reward") == ([1], [0.0])
    assert series(rows, "eval/all") == ([0], [0.0])


def test_evaluations_and_lone_points_have_markers_and_lines_of_steps_do_not(tmp_path, monkeypatch):
    """Held-out evaluations (a few points) and any series of one step are drawn with markers; a
    train series of several steps is a plain line."""
    pytest.importorskip("matplotlib")
    rows = [{"step": 0, "eval/all": {"em": 0.1}, "kl": 0.0}, {"step": 1, "reward": 0.2, "kl": 0.1},
            {"step": 2, "reward": 0.3, "kl": 0.2, "eval/all": {"em": 0.4}}]
    figs = drawn(monkeypatch)
    plot([str(write_run(tmp_path / "run", rows))], str(tmp_path / "c.png"))
    markers = {ax.get_title(): [ln.get_marker() for ln in ax.get_lines()] for ax in figs[0].axes}
    assert markers == {"train reward": ["None"], "held-out test EM": ["o"], "KL to reference": ["None"]}
    figs.clear()
    plot([str(write_run(tmp_path / "one", [{"step": 5, "reward": 0.2}]))], str(tmp_path / "c.png"))
    assert [ln.get_marker() for ln in figs[0].axes[0].get_lines()] == ["o"]


@pytest.mark.parametrize("step", [True, False])
def test_a_boolean_step_is_named_not_taken_as_a_number(tmp_path, step):
    """JSON true is not a step number (bool is an int in Python)."""
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps({"step": step, "reward": 0.1}) + "\n")
    with pytest.raises(DataError, match=rf"metrics.jsonl:1: 'step' is {step!r}, not a number"):
        read_metrics(tmp_path)


def test_a_float_step_is_a_number(tmp_path):
    """A numeric step, integral or not, is taken as it is."""
    write_run(tmp_path, [{"step": 1.5, "reward": 0.1}, {"step": 2, "reward": 0.2}])
    assert series(read_metrics(tmp_path), "reward") == ([1.5, 2], [0.1, 0.2])


def test_the_current_folder_and_a_relative_path_are_named_by_the_folder(tmp_path, monkeypatch):
    """`plot .` or `plot ../run` names the run by its folder, not '.' or '..'."""
    run = write_run(tmp_path / "myrun", [{"step": 1, "reward": 0.1}])
    (run / "sub").mkdir()
    monkeypatch.chdir(run)
    assert labels(["."]) == ["myrun"]
    monkeypatch.chdir(run / "sub")
    assert labels([".."]) == ["myrun"]
    assert labels(["../metrics.jsonl"]) == ["myrun"]


def test_an_upper_case_suffix_is_a_known_format(tmp_path):
    """--out C.PNG is a PNG file like c.png."""
    pytest.importorskip("matplotlib")
    run = write_run(tmp_path / "run", [{"step": 1, "reward": 0.1}])
    out = plot([str(run)], str(tmp_path / "C.PNG"))
    assert out == tmp_path / "C.PNG" and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_out_in_a_new_folder_is_written_there(tmp_path):
    """--out in a folder not made yet: the folders are made, as view's --out does (it stopped on
    'No such file or directory')."""
    pytest.importorskip("matplotlib")
    run = write_run(tmp_path / "run", [{"step": 1, "reward": 0.1}])
    out = plot([str(run)], str(tmp_path / "figs" / "new" / "c.png"))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    from searchlite.plot import main

    with pytest.raises(SystemExit, match="^" + re.escape(f"error: {out}: File exists") + "$"):  # not a traceback
        main([str(run), "--out", str(out / "c.png")])  # its folder would be a file


def test_a_run_given_twice_is_named_before_anything_is_drawn(tmp_path, monkeypatch):
    """The same run twice, as its folder, its metrics.jsonl or another path to it, is refused naming
    both arguments: its two lines would share a name in the legend and look like two runs that agree."""
    run = write_run(tmp_path / "run", [{"step": 1, "reward": 0.5}])
    other = write_run(tmp_path / "other", [{"step": 1, "reward": 0.2}])
    monkeypatch.chdir(tmp_path)
    for a, b in (("run", "run"), ("run", "run/metrics.jsonl"), (str(run), "other/../run/")):
        with pytest.raises(DataError, match="^" + re.escape(f"{a} and {b} are the same run (")):
            plot([a, str(other), b], str(tmp_path / "c.png"))
    assert not (tmp_path / "c.png").exists()

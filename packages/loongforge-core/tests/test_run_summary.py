"""The end-of-run summary: besides the first and last step's loss (one batch each), the mean loss
of the first and last tenth of the steps, which a noisy per-step loss does not hide."""

from __future__ import annotations

from types import SimpleNamespace

from loongforge.core.training.run import loss_trend

NOISY = [1.50, 0.84, 1.32, 1.18, 1.11, 0.40, 0.68, 1.39, 0.56, 1.21, 0.70, 0.60, 0.65, 0.55, 0.60, 0.50, 0.62,
         0.48, 0.52, 0.44]


def steps(losses):
    return [SimpleNamespace(step=i + 1, loss=loss) for i, loss in enumerate(losses)]


def test_the_summary_compares_window_means():
    assert loss_trend(steps(NOISY)) == ("mean loss of steps 1-2 1.1700 -> steps 19-20 0.4800 "
                                        "(each step's loss is one batch's; metrics.jsonl's loss_avg is the mean "
                                        "since its previous record)")
    assert loss_trend(steps(NOISY * 3)).startswith("mean loss of steps 1-6 1.0583 -> steps 55-60 ")


def test_a_short_run_has_no_trend_line():
    assert loss_trend(steps(NOISY[:9])) == ""


def test_resume_is_offered_only_where_a_checkpoint_was_saved(tmp_path, capsys):
    from loongforge.core.training.run import RunSummary, print_summary

    results = [SimpleNamespace(step=1, loss=2.0, tokens=100, samples=1, seconds=0.5)]
    print_summary("lf-x", RunSummary(tmp_path, tmp_path / "checkpoints", 0, results, last_checkpoint=None))
    unsaved = capsys.readouterr().out
    assert "no checkpoint saved" in unsaved and "resume:" not in unsaved
    assert f"curves: lf-x plot {tmp_path}" in unsaved
    print_summary("lf-x", RunSummary(tmp_path, tmp_path / "checkpoints", 0, results,
                                     last_checkpoint=tmp_path / "checkpoints" / "step_1"))
    saved = capsys.readouterr().out
    assert f"resume: the same command (it continues from {tmp_path / 'checkpoints' / 'latest'})" in saved

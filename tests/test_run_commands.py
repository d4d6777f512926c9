"""``plot`` and ``compare`` on run directories work the same from every ``lf-*`` CLI."""

import importlib
import json

import pytest

CLIS = ["loongforge.llm.cli", "loongforge.vlm.cli", "loongforge.diffusion.cli", "loongforge.embodied.cli"]


def _run(path, scale: float):
    path.mkdir()
    (path / "metrics.jsonl").write_text("".join(
        json.dumps({"step": s, "loss": scale * 4.0 / s, "tokens_per_s": 10.0}) + "\n" for s in range(1, 21)))
    return path


@pytest.mark.parametrize("module", CLIS)
def test_compare_and_plot_from_each_cli(module, tmp_path, capsys):
    main = importlib.import_module(module).main
    a, b = _run(tmp_path / "a", 1.0), _run(tmp_path / "b", 1.03)
    assert main(["compare", str(a), str(b)]) == 0
    assert "from step 1: 3.00% (steps " in capsys.readouterr().out
    assert main(["compare", str(a), str(b), "--tolerance", "0.01"]) == 1
    assert main(["compare", str(a), str(tmp_path / "missing")]) == 2
    assert "missing/metrics.jsonl: no such file" in capsys.readouterr().err
    assert main(["plot", str(tmp_path / "missing")]) == 2
    assert "missing/metrics.jsonl: no such file" in capsys.readouterr().err
    assert main(["plot", str(a)]) == 0
    assert (a / "curves.png").stat().st_size > 1000

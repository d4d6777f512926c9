"""loongforge-core without its ``plot``, ``tensorboard`` and ``wandb`` extras: importing the core needs
none of them, a run without tensorboard logs to metrics.jsonl with a one-line notice, and ``lf-* plot``
without matplotlib is one ``error:`` line naming the extra (``log.wandb=true`` without wandb:
tests/test_wandb_logging.py)."""

import argparse
import ast
import json
import sys
from pathlib import Path

from loongforge.core.cli import add_run_commands, run_main
from loongforge.core.metrics import MetricsLogger, read_metrics

CORE_SRC = Path(__file__).resolve().parents[1] / "src" / "loongforge" / "core"
EXTRAS = {"matplotlib", "tensorboard", "wandb"}  # the top-level modules of loongforge-core[plot] / [tensorboard] / [wandb]


def _module_level_imports(tree: ast.Module) -> set[str]:
    """Top-level module names imported outside any function body."""
    found: set[str] = set()

    def visit(node):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                continue
            if isinstance(child, ast.Import):
                names = [a.name for a in child.names]
            elif isinstance(child, ast.ImportFrom) and child.level == 0 and child.module:
                names = [child.module, *(f"{child.module}.{a.name}" for a in child.names)]
            else:
                names = []
            for name in names:
                # torch.utils.tensorboard is tensorboard's torch front end
                found.add("tensorboard" if name.startswith("torch.utils.tensorboard") else name.split(".")[0])
            visit(child)

    visit(tree)
    return found


def test_core_modules_import_the_extras_only_inside_functions():
    sources = sorted(CORE_SRC.rglob("*.py"))
    assert len(sources) > 20
    offenders = {}
    for file in sources:
        hits = _module_level_imports(ast.parse(file.read_text(encoding="utf-8"), str(file))) & EXTRAS
        if hits:
            offenders[file.relative_to(CORE_SRC).as_posix()] = sorted(hits)
    assert not offenders, f"module-level imports of optional extras: {offenders}"


def test_metrics_without_tensorboard_write_jsonl_and_print_a_notice(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # import tensorboard -> ModuleNotFoundError
    with MetricsLogger(tmp_path / "run", tensorboard=True) as logger:
        logger.log(1, {"loss": 2.5})
        logger.log(2, {"loss": 2.0})
    err = capsys.readouterr().err
    assert err.count("notice:") == 1 and "loongforge-core[tensorboard]" in err
    assert [r["loss"] for r in read_metrics(tmp_path / "run")] == [2.5, 2.0]
    assert not (tmp_path / "run" / "tensorboard").exists()


def test_metrics_with_tensorboard_write_event_files(tmp_path, capsys):
    with MetricsLogger(tmp_path / "run", tensorboard=True) as logger:
        logger.log(1, {"loss": 2.5})
    assert list((tmp_path / "run" / "tensorboard").glob("events.out.tfevents.*"))
    assert "notice:" not in capsys.readouterr().err


def test_plot_without_matplotlib_is_one_error_line(tmp_path, monkeypatch, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 1.0}) + "\n")
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    parser = argparse.ArgumentParser()
    add_run_commands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["plot", str(run)])
    assert run_main(lambda: args.fn(args)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: plotting needs matplotlib")
    assert "loongforge-core[plot]" in err[0]
    assert not (run / "curves.png").exists()

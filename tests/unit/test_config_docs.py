"""docs/configuration.md is generated from the settings trees and must not be stale."""
from __future__ import annotations

import os

from services.config import ROOTS
from services.config_docs import DOCS_PATH, render_docs
from pdcore.config_tree import tree

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_configuration_docs_are_fresh():
    with open(os.path.join(REPO, DOCS_PATH)) as f:
        committed = f.read()
    assert committed == render_docs(ROOTS), (
        f"{DOCS_PATH} is stale: run `pdserve config docs --out {DOCS_PATH}`")


def test_docs_list_every_setting_with_its_help():
    text = render_docs(ROOTS)
    for cls in ROOTS.values():
        for name, spec in tree(cls).items():
            assert f"| `{name}` |" in text, name
            assert spec.help.replace("|", "\\|") in text, name


def test_check_mode_detects_a_stale_page(tmp_path, monkeypatch, capsys):
    from pdserve import config_cli
    assert config_cli.main(["docs", "--check"]) == 0
    (tmp_path / "docs").mkdir()
    (tmp_path / DOCS_PATH).write_text("# old\n")
    monkeypatch.setattr(config_cli, "REPO", str(tmp_path))
    assert config_cli.main(["docs", "--check"]) == 1
    assert "stale" in capsys.readouterr().err

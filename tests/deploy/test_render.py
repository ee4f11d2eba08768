"""deploy/render.py: the checked-in manifests and scrape config are what the chart renders now."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from deploy import render


def test_generated_files_are_current() -> None:
    assert render.stale_files() == [], "run: python -m deploy.render"


def test_check_reports_a_stale_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    stale = tmp_path / "pdserve.yaml"
    stale.write_text("# old\n")
    monkeypatch.setattr(render, "MANIFESTS", stale)
    monkeypatch.setattr(render, "DEPLOY_DIR", tmp_path)
    monkeypatch.setattr(render, "SCRAPE_CONFIG", tmp_path / "missing.yaml")
    monkeypatch.setattr(render, "ALERT_RULES", tmp_path / "alerts.yaml")
    assert render.main(["--check"]) == 1
    assert render.main([]) == 0
    assert render.main(["--check"]) == 0 and stale.read_text() != "# old\n"


def test_manifests_hold_no_helm_test_hook_and_apply_as_plain_objects() -> None:
    objects = [o for o in yaml.safe_load_all(render.MANIFESTS.read_text()) if o]
    kinds = {o["kind"] for o in objects}
    assert {"Deployment", "StatefulSet", "Service", "Role", "ConfigMap"} <= kinds
    assert not [o for o in objects if "helm.sh/hook" in (o["metadata"].get("annotations") or {})]

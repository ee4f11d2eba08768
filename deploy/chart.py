"""Render the Helm chart in helm/ with Helm's own Go library (helm-python-sdk), no helm binary or cluster."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

REPO_ROOT = Path(__file__).resolve().parent.parent
CHART_DIR = REPO_ROOT / "helm"
NOTES_SUFFIX = "NOTES.txt"


def render_chart(
    values: dict[str, Any] | None = None,
    *,
    release: str = "pdserve",
    namespace: str = "default",
    chart_dir: Path = CHART_DIR,
) -> dict[str, str]:
    """Template path -> rendered text, as `helm template` makes it (values checked against the schema).

    Raises helm_python.HelmValuesError for values the schema rejects, HelmRenderError for template failures.
    """
    # A 250 MB native library: loaded only when a chart is rendered. Its loader logs one INFO line on
    # stderr for the helm/dashboards symlink it follows; that is expected.
    import helm_python as helm

    with helm.Chart.load(chart_dir) as chart:
        return chart.render(values, name=release, namespace=namespace, is_install=True)


def is_test_hook(obj: dict[str, Any]) -> bool:
    annotations = obj.get("metadata", {}).get("annotations") or {}
    return "test" in str(annotations.get("helm.sh/hook", "")).split(",")


def rendered_objects(rendered: dict[str, str], *, include_tests: bool = False) -> list[dict[str, Any]]:
    """Kubernetes objects of a render, in template order; NOTES.txt and empty documents dropped."""
    objects = []
    for template in sorted(rendered):
        if template.endswith(NOTES_SUFFIX):
            continue
        for document in yaml.safe_load_all(rendered[template]):
            if not document:
                continue
            if is_test_hook(document) and not include_tests:
                continue
            objects.append(document)
    return objects


def manifests_yaml(objects: list[dict[str, Any]]) -> str:
    """One multi-document YAML stream for `kubectl apply -f`."""
    return "".join("---\n" + yaml.safe_dump(obj, sort_keys=False, width=120) for obj in objects)

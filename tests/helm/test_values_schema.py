"""values.schema.json: Helm refuses bad values before rendering, naming the key and what was expected."""

from __future__ import annotations

from typing import Any

import helm_python as helm
import pytest
from chart_objects import VALUE_SETS

from deploy.chart import CHART_DIR, render_chart

BAD_VALUES: list[tuple[dict[str, Any], str]] = [
    ({"router": {"routing": {"policy": "fastest"}}},
     r"/router/routing/policy': value must be one of 'prefix', 'round_robin', 'least_load'"),
    ({"pools": {"decode": {"ranks": 0}}}, r"/pools/decode/ranks': minimum: got 0, want 1"),
    ({"engine": {"gpuMemoryFraction": 1.5}}, r"/engine/gpuMemoryFraction': maximum: got 1.5, want 1"),
    ({"engine": {"pageSize": "64"}}, r"/engine/pageSize': got string, want integer"),
    ({"model": {"source": "hostPath"}}, r"/model/hostPath/path': minLength: got 0, want 1"),
    ({"model": {"source": "s3"}}, r"/model/source': value must be one of 'existingClaim', 'hostPath', 'download'"),
    ({"model": {"source": "existingClaim", "existingClaim": {"claimName": ""}}},
     r"/model/existingClaim/claimName': minLength"),
    ({"routr": {"replicas": 2}}, r"additional properties 'routr' not allowed"),
    ({"pools": {"prefil": {"enabled": True}}}, r"/pools': additional properties 'prefil' not allowed"),
    ({"monitoring": {"scrapeInterval": "15"}}, r"/monitoring/scrapeInterval': '15' does not match pattern"),
    ({"worker": {"shmSize": "lots"}}, r"/worker/shmSize': 'lots' does not match pattern"),
    ({"pools": {"prefill": {"multiNode": {"enabled": True, "nodes": 1}}}},
     r"/pools/prefill/multiNode/nodes': minimum: got 1, want 2"),
    ({"router": {"service": {"type": "Ingress"}}}, r"/router/service/type': value must be one of"),
    ({"planner": {"intervalSeconds": -30}}, r"/planner/intervalSeconds': exclusiveMinimum: got -30, want 0"),
    ({"planner": {"slo": {"itlSeconds": 0}}}, r"/planner/slo/itlSeconds': exclusiveMinimum: got 0, want 0"),
    ({"planner": {"minDecode": 0}}, r"/planner/minDecode': minimum: got 0, want 1"),
]


@pytest.mark.parametrize(("values", "message"), BAD_VALUES, ids=[m.split("'")[0] or m for _, m in BAD_VALUES])
def test_bad_values_are_rejected_naming_the_key(values: dict[str, Any], message: str) -> None:
    with pytest.raises(helm.HelmValuesError, match=message):
        render_chart(values)


@pytest.mark.parametrize("value_set", sorted(VALUE_SETS))
def test_value_sets_pass_the_schema(value_set: str) -> None:
    with helm.Chart.load(CHART_DIR) as chart:
        chart.validate_schema(VALUE_SETS[value_set])
        assert chart.schema is not None and chart.schema["additionalProperties"] is False

"""Tooling around the Helm chart: rendering it, the dashboards' metric names, Prometheus scrape configs."""

"""The SLO planner: sizes the prefill and decode pools from what the routers measure and a step profile of the model,
and scales them (Kubernetes StatefulSets, or a cluster on this machine). docs/planner.md."""

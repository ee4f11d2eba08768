"""Where the workers are (static list, Kubernetes pods): read by the router to route and by workers to know their
hand-off peers."""

"""HTTP server plumbing shared by the router and the worker."""

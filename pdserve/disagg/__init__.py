"""The prefill -> decode hand-off: the decode rank reserves pages (`receiver.py`), the prefill rank computes and
writes into them (`sender.py`), each request's progress one explicit state per role; the worker edge admits a hand-off
only between discovered peers and for a reservation the decode rank confirms (`guard.py`). See docs/transfer.md."""

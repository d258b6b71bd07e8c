"""A pytest plugin that writes each failure's report the moment it happens, to $PYTEST_FAILURE_LOG.

    PYTEST_FAILURE_LOG=failures.log python -m pytest -p scripts.pytest_failure_log ...

For runs that a time limit may cut before pytest's own summary (scripts/gpu_check.sh on a lent GPU):
what failed, and why, is on disk already.
"""

import os


def pytest_runtest_logreport(report) -> None:
    if report.failed and os.environ.get("PYTEST_FAILURE_LOG"):
        with open(os.environ["PYTEST_FAILURE_LOG"], "a") as log:
            log.write(f"=== {report.nodeid} ({report.when})\n{report.longreprtext[-4000:]}\n\n")

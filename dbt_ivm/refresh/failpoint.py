"""The crash test's hook (tests/integration/test_exactly_once.py): a refresh
passes ``failpoint(name, relation)`` just before and just after its commit;
``DBT_IVM_FAILPOINT`` unset (always, outside that test), it does nothing."""

from __future__ import annotations

import os
import signal
import threading

from dbt_ivm.names import canonical


def failpoint(name: str, relation: str) -> None:
    """Crash-test hook: ``DBT_IVM_FAILPOINT=<name>`` kills the process here
    (SIGKILL, no cleanup), as a power cut would; ``<name>:<relation>`` only in
    that model's refresh; ``<name>+<seconds>`` that long after passing here
    (the statement that follows in flight: over a Thrift connection, the
    server is left running it for a client that is gone). Used by the
    exactly-once tests."""
    point, _, model = os.environ.get("DBT_IVM_FAILPOINT", "").partition(":")
    point, _, delay = point.partition("+")
    if point == name and (not model or canonical(model) == relation):
        if not delay:
            os.kill(os.getpid(), signal.SIGKILL)
        threading.Timer(float(delay), os.kill, (os.getpid(), signal.SIGKILL)).start()

"""Worker-side half of tests/test_execution_context.py, run as ``python -m`` in a fresh process.

Reads an ExecutionContext as orjson bytes on stdin (nothing else crosses the boundary), rebuilds
its backend from the URL inside it, writes one business row and acknowledges in one fenced
transaction, and reports on stdout as JSON. Exit 3 means the term was stale.
"""

from __future__ import annotations

import sys

import orjson
from sqlalchemy import text

from apsup.context import ExecutionContext, dispose_backends
from apsup.errors import StaleTermError


def main() -> int:
    ctx = ExecutionContext.from_bytes(sys.stdin.buffer.read())
    try:
        with ctx.fenced() as conn:
            conn.execute(
                text("INSERT INTO ctx_business (scope_id, note) VALUES (:s, :n)"),
                {"s": ctx.scope_id, "n": f"child {ctx.worker_id}"},
            )
            moved = ctx.acknowledge(conn)
    except StaleTermError as exc:
        sys.stdout.buffer.write(orjson.dumps({"stale": str(exc)}))
        return 3
    finally:
        dispose_backends()
    sys.stdout.buffer.write(orjson.dumps({"moved": moved, "acknowledged": ctx.acknowledged}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

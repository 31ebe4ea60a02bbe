"""Publish intent from a separate process, on the application's own engine:
``python publish.py request|mark_dirty SCOPE``. Prints the time right after COMMIT."""

import sys
import time

from myapp.db import engine, invoices
from sqlalchemy import insert

action, scope = sys.argv[1], sys.argv[2]
if action == "request":
    from myapp.families import report as fam
else:
    from myapp.digests import digest as fam

with engine().begin() as conn:
    conn.execute(insert(invoices).values(customer=scope))
    generation = getattr(fam, action)(conn, scope)
print(time.time(), generation)

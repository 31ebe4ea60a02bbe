from alembic import context
from myapp.db import engine, metadata

import apsup.migrations

with engine().begin() as conn:
    context.configure(
        connection=conn, target_metadata=metadata, include_name=apsup.migrations.include_name
    )
    with context.begin_transaction():
        context.run_migrations()

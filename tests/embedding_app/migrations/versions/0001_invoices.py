import sqlalchemy as sa
from alembic import op

revision = "0001"  # bare ids, as apsup's own used to be: they must not collide any more
down_revision = None
branch_labels = None
depends_on = None


def upgrade():
    op.create_table(
        "invoices",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("customer", sa.String(64), nullable=False),
    )


def downgrade():
    op.drop_table("invoices")

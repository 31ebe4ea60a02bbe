import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade():
    op.create_table(
        "myapp_runs",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("family", sa.String(64), nullable=False),
        sa.Column("scope_id", sa.String(64), nullable=False),
        sa.Column("started", sa.Float, nullable=False),
        sa.Column("pid", sa.Integer, nullable=False),
    )


def downgrade():
    op.drop_table("myapp_runs")

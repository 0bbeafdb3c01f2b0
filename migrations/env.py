"""Alembic entry point, configured by `kvtierd.storage.sql_migrate` rather than an ini file.

Logging is left to the daemon: no `fileConfig` here.
"""

from __future__ import annotations

from alembic import context
from sqlalchemy import create_engine, pool
from sqlalchemy.engine import Connection

from kvtierd.storage.sql_models import Base

config = context.config
target_metadata = Base.metadata


def _configure(connection: Connection) -> None:
    # SQLite cannot ALTER most things in place; batch mode copies the table instead.
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=connection.dialect.name == "sqlite",
    )


def run_migrations_offline() -> None:
    """Emit SQL to stdout (`alembic upgrade --sql`) without a database."""
    url = config.get_main_option("sqlalchemy.url")
    context.configure(
        url=url,
        target_metadata=target_metadata,
        literal_binds=True,
        render_as_batch=url is not None and url.startswith("sqlite"),
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    # A caller that already holds a connection (the store's engine) passes it in;
    # its transaction is the caller's to commit.
    shared: Connection | None = config.attributes.get("connection")
    if shared is not None:
        _configure(shared)
        with context.begin_transaction():
            context.run_migrations()
        return

    url = config.get_main_option("sqlalchemy.url")
    if not url:
        raise RuntimeError("kvtierd.migrations needs sqlalchemy.url or a connection in config.attributes")
    engine = create_engine(url, poolclass=pool.NullPool)
    try:
        with engine.connect() as connection:
            _configure(connection)
            with context.begin_transaction():
                context.run_migrations()
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()

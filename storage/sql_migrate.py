"""Apply the chat-session store's alembic migrations, configured in code (no alembic.ini)."""

from __future__ import annotations

from alembic import command
from alembic.config import Config
from sqlalchemy.engine import Connection

SCRIPT_LOCATION = "kvtierd.migrations:"


def alembic_config(url: str, *, connection: Connection | None = None) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", SCRIPT_LOCATION)
    cfg.set_main_option("path_separator", "os")
    # ConfigParser treats "%" as interpolation; URL-escaped passwords contain it.
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    if connection is not None:
        cfg.attributes["connection"] = connection
    return cfg


def upgrade_to_head(url: str, *, connection: Connection | None = None) -> None:
    """Bring the database at `url` to the newest schema; a no-op when it is already there.

    With `connection`, migrations run on it and inside its transaction (the caller commits),
    so the store's engine settings (SQLite pragmas, connect timeout) apply to them too.
    """
    command.upgrade(alembic_config(url, connection=connection), "head")

"""Alembic environment of the chat-session store (`script_location = "kvtierd.migrations:"`)."""

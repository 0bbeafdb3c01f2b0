"""Schema revisions, applied in order by `kvtierd.storage.sql_migrate.upgrade_to_head`."""
